"""tree.radix_top_k: exactly lax.top_k (values bitwise, indices) on hard rows, and the same tree."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import tree as tree_module
from dflash_jax.tree import build_tree, preselect_fanout, radix_top_k


def hard_rows(seed: int, length: int, k: int) -> np.ndarray:
    """[10, length] float32 rows that stress an exact top-k: ties everywhere, ties at the k-th
    value, -inf, -0.0 / +0.0, NaN of both signs, adjacent floats and plain random values."""
    rng = np.random.default_rng(seed)
    rows = np.empty((10, length), np.float32)
    rows[0] = rng.standard_normal(length)                                     # plain random
    rows[1] = -1.5                                                            # one value everywhere
    rows[2] = rng.choice(np.array([-0.5, -1.0, -2.0], np.float32), length)    # a few values
    # Many copies of the k-th value, spread over the row and straddling the cut.
    rows[3] = -3.0 * rng.random(length)
    kth = np.sort(rows[3])[-k]
    rows[3, rng.random(length) < 0.3] = kth
    rows[4] = rng.choice(np.array([-np.inf, -1.0], np.float32), length, p=[0.9, 0.1])
    rows[4, :3] = -np.inf                                                     # mostly -inf
    rows[5] = rng.choice(np.array([0.0, -0.0, -1.0], np.float32), length)    # -0.0 below +0.0
    rows[6] = rng.standard_normal(length)
    rows[6, rng.random(length) < 0.2] = np.nan                                # NaN above all
    rows[6, rng.random(length) < 0.2] = -np.nan                               # -NaN below -inf
    # Adjacent float32 values: a run of nextafter steps around one value, shuffled.
    steps = np.empty(length, np.float32)
    steps[0] = -0.75
    for i in range(1, length):
        steps[i] = np.nextafter(steps[i - 1], np.float32(0.0))
    rows[7] = rng.permutation(steps)
    rows[8] = rng.choice(steps[:3], length)                                   # 3 adjacent values
    rows[9] = rng.choice(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32), length)
    return rows


def check_equal(got: tuple[jax.Array, jax.Array], want: tuple[jax.Array, jax.Array]) -> None:
    got_val, got_idx = got
    want_val, want_idx = want
    assert got_idx.dtype == jnp.int32 and got_val.dtype == want_val.dtype
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    bits = np.dtype(f"uint{8 * got_val.dtype.itemsize}")
    np.testing.assert_array_equal(np.asarray(got_val).view(bits), np.asarray(want_val).view(bits))


# Lengths not multiples of anything, length == k, and lengths long enough for a preselection
# level at prechunk 4 (length // 4 >= k) or not.
@pytest.mark.parametrize("k,length", [(1, 1), (1, 37), (2, 2), (2, 1001), (7, 7), (7, 613),
                                      (64, 64), (64, 997), (256, 256), (256, 1237), (512, 2053)])
@pytest.mark.parametrize("prechunk", [1, 4])
def test_radix_top_k_equals_top_k(k: int, length: int, prechunk: int) -> None:
    rows = jnp.asarray(hard_rows(k * 7919 + length, length, k))
    got = jax.jit(radix_top_k, static_argnums=(1, 2, 3))(rows, k, tree_module.RADIX_BITS, prechunk)
    check_equal(got, jax.lax.top_k(rows, k))


@pytest.mark.parametrize("bits,prechunk,variadic", [(1, 1, True), (3, 2, True), (5, 3, False),
                                                    (8, 1, False), (4, 4, False)])
def test_radix_top_k_settings_equal_top_k(bits: int, prechunk: int, variadic: bool) -> None:
    # Passes that do not divide 32 bits (3, 5), one bit a pass (32 passes), 255 thresholds a
    # pass, and the broadcast count: all must give top_k exactly.
    rows = jnp.asarray(hard_rows(bits, 531, 40))
    got = jax.jit(radix_top_k, static_argnums=(1, 2, 3, 4))(rows, 40, bits, prechunk, variadic)
    check_equal(got, jax.lax.top_k(rows, 40))


def test_radix_top_k_narrow_floats_and_k_zero() -> None:
    rows = jnp.asarray(hard_rows(3, 300, 5)).astype(jnp.bfloat16)
    check_equal(radix_top_k(rows, 5), jax.lax.top_k(rows, 5))
    val, idx = radix_top_k(rows, 0)
    assert val.shape == (10, 0) and idx.shape == (10, 0)


def test_radix_top_k_arguments() -> None:
    rows = jnp.zeros((2, 10), jnp.float32)
    with pytest.raises(ValueError, match="k must be"):
        radix_top_k(rows, 11)
    with pytest.raises(ValueError, match="bits"):
        radix_top_k(rows, 2, bits=0)
    with pytest.raises(ValueError, match="bits"):
        radix_top_k(rows, 2, bits=9)
    with pytest.raises(ValueError, match="prechunk"):
        radix_top_k(rows, 2, prechunk=0)


@pytest.mark.parametrize("prechunk", [1, 4])
def test_radix_top_k_lowers_for_gpu_without_a_sort(prechunk: int) -> None:
    # DDTree(256) at Qwen3's vocabulary: it lowers for CUDA, with no sort or top_k inside.
    rows = jax.ShapeDtypeStruct((15, 151936), jnp.float32)
    fn = jax.jit(lambda r: radix_top_k(r, 256, tree_module.RADIX_BITS, prechunk))
    text = fn.trace(rows).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.sort" not in text and "top_k" not in text and "TopK" not in text
    assert "reduce_window" not in text  # no jnp.cumsum over a long row


def test_tree_with_radix_is_the_same() -> None:
    # DDTree(256) over a 1500-token vocabulary and 15 depths, ties across chunks in one
    # sequence: the radix top-k (with and without a preselection level) changes nothing.
    rng = np.random.default_rng(21)
    logits = 4.0 * rng.standard_normal((2, 15, 1500))
    logits[1, :, ::5] = logits[1, :, :1]
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lp, roots = jnp.asarray(lp.astype(np.float32)), jnp.array([3, 4], jnp.int32)
    plain = build_tree(lp, roots, 256, preselect=0)
    for preselect in (-1, -4):
        radix = build_tree(lp, roots, 256, preselect=preselect)
        for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(radix)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_radix_preselect_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert preselect_fanout(-1, 256, "cpu") == -1 and preselect_fanout(-4, 16, "gpu") == -4
    monkeypatch.setattr(tree_module, "KERNEL_TOP_K_BY_DEFAULT", False)  # the kernel comes first
    assert preselect_fanout(None, 256, "gpu") == 4  # the XLA preselection until RADIX_BY_DEFAULT
    monkeypatch.setattr(tree_module, "RADIX_BY_DEFAULT", True)
    assert preselect_fanout(None, 256, "gpu") == -tree_module.RADIX_PRECHUNK
    assert preselect_fanout(None, 1024, "gpu") == -tree_module.RADIX_PRECHUNK
    assert preselect_fanout(None, 256, "cpu") == 0
    jaxpr = str(jax.make_jaxpr(lambda x: build_tree(x, jnp.zeros((1,), jnp.int32), 16, preselect=-1))(
        jax.ShapeDtypeStruct((1, 3, 5000), jnp.float32)))
    assert jaxpr.count("top_k[") == 0 and jaxpr.count(" sort[") == 0
