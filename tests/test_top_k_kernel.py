"""pallas_kernels.top_k: exactly lax.top_k (values bitwise, indices) in interpret mode on hard
rows, its argument checks, its lowering for cuda without a sort, and DDTree's tree through it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import tree as tree_module
from dflash_jax.tree import kernel_top_k, tree_width, vocab_backend
from pallas_kernels import top_k as tk


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


def kernel(rows: jax.Array, k: int, **kw) -> tuple[jax.Array, jax.Array]:
    return jax.jit(lambda r: tk.top_k(r, k, interpret=True, **kw))(rows)


# Lengths that are multiples of no block, length == k (chunks of one entry), chunks shorter
# than 32 (length // k < 32), k padded to a power of two, and rows long enough for the full
# chunk; ten hard rows each (ties at the cut, one value everywhere -- the candidate list then
# spans many register tiles --, -inf, -0.0 / +0.0, NaN of both signs, adjacent floats).
@pytest.mark.parametrize("k,length", [(1, 1), (1, 37), (7, 613), (16, 16), (16, 4099), (64, 997),
                                      (100, 20000), (256, 256), (256, 1237), (256, 20000),
                                      (512, 512), (512, 2053), (512, 20000)])
def test_kernel_equals_top_k(k: int, length: int) -> None:
    rows = jnp.asarray(hard_rows(k * 7919 + length, length, k))
    check_equal(kernel(rows, k), jax.lax.top_k(rows, k))


def test_kernel_at_the_qwen_vocabulary() -> None:
    # DDTree(256)'s shape for two depths: log-probs, one row with its 256th value repeated
    # across many chunks.
    rng = np.random.default_rng(5)
    logits = 4.0 * rng.standard_normal((2, 151936))
    lp = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    lp[1, 1000::37] = np.sort(lp[1])[-256]
    rows = jnp.asarray(lp)
    check_equal(kernel(rows, 256), jax.lax.top_k(rows, 256))


@pytest.mark.parametrize("chunk,split", [(4, 1), (1, 2), (64, 4)])
def test_kernel_settings_equal_top_k(chunk: int, split: int) -> None:
    # Other chunks (1: every entry its own chunk) and shares of the final ranking.
    rows = jnp.asarray(hard_rows(chunk + split, 3001, 40))
    check_equal(kernel(rows, 40, chunk=chunk, split=split), jax.lax.top_k(rows, 40))


def test_kernel_narrow_floats_and_empty() -> None:
    rows = jnp.asarray(hard_rows(3, 700, 5)).astype(jnp.bfloat16)
    check_equal(kernel(rows, 5), jax.lax.top_k(rows, 5))
    val, idx = tk.top_k(jnp.zeros((3, 10), jnp.float32), 0)
    assert val.shape == (3, 0) and idx.shape == (3, 0) and idx.dtype == jnp.int32


@pytest.mark.parametrize("k,length", [(1, 50), (16, 5000), (256, 20000), (512, 2053)])
def test_reference_equals_top_k(k: int, length: int) -> None:
    rows = jnp.asarray(hard_rows(k + length, length, k))
    check_equal(jax.jit(tk.top_k_reference, static_argnums=1)(rows, k), jax.lax.top_k(rows, k))


def test_plan() -> None:
    p = tk.plan(15, 151936, 256)
    assert (p.chunk, p.n_chunks, p.maxima_block, p.k_block, p.capacity, p.split) == (32, 4748, 8192, 256, 8192, 2)
    assert p.maxima % p.per_program == 0 and p.maxima >= p.n_chunks
    assert tk.plan(15, 151936, 512).split == 4 and tk.plan(60, 151936, 512).split == 2
    assert tk.plan(15, 151936, 16).split == 1
    assert tk.plan(4, 300, 256).chunk == 1 and tk.plan(4, 1000, 100).chunk == 8
    # A long row takes longer chunks to keep the maxima in registers; too large a k does not apply.
    assert tk.plan(1, 1 << 20, 16).maxima_block <= tk.MAX_CHUNKS
    assert tk.plan(1, 10000, tk.MAX_K + 1) is None and not tk.applies(1 << 22, 1024)
    assert tk.applies(151936, 512) and tk.applies(1, 1) and not tk.applies(5, 6)


def test_kernel_arguments() -> None:
    rows = jnp.zeros((2, 10), jnp.float32)
    with pytest.raises(ValueError, match="k must be"):
        tk.top_k(rows, 11)
    with pytest.raises(ValueError, match="k must be"):
        tk.top_k(rows, -1)
    with pytest.raises(ValueError, match="k must be a Python int"):
        tk.top_k(rows, jnp.int32(2))
    with pytest.raises(ValueError, match="rows must be"):
        tk.top_k(rows[0], 2)
    with pytest.raises(ValueError, match="rows must be"):
        tk.top_k(rows[None], 2)
    with pytest.raises(ValueError, match="rows must be float"):
        tk.top_k(rows.astype(jnp.int32), 2)
    with pytest.raises(ValueError, match="chunk"):
        tk.top_k(rows, 2, chunk=0)
    with pytest.raises(ValueError, match="split"):
        tk.top_k(rows, 2, split=3)
    with pytest.raises(ValueError, match="limits"):
        tk.top_k(jnp.zeros((1, 5000), jnp.float32), tk.MAX_K + 1)
    with pytest.raises(ValueError, match="k must be"):
        kernel_top_k(rows, 11)


@pytest.mark.parametrize("k", [16, 256, 512])
def test_kernel_lowers_for_cuda_without_a_sort(k: int) -> None:
    # DDTree's shape at Qwen3's vocabulary: two Triton launches and nothing sorted.
    rows = jax.ShapeDtypeStruct((15, 151936), jnp.float32)
    text = jax.jit(lambda r: tk.top_k(r, k)).trace(rows).lower(lowering_platforms=("cuda",)).as_text()
    assert "top_k_chunk_maxima" in text and "top_k_select" in text
    assert text.count("stablehlo.custom_call") == 2
    assert "stablehlo.sort" not in text and "TopK" not in text and "chlo.top_k" not in text
    # Through the tree's wrapper and the whole tree alike.
    text = jax.jit(lambda r: kernel_top_k(r, k, backend="gpu")).trace(rows).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 2 and "stablehlo.sort" not in text
    # The tree sorts no more than with chunked_top_k, and nothing below budget 512 (at 512 its
    # own selection over all depths, 15 x 512 candidates, is past RANK_TOP_K_MAX and sorts).
    lp = jax.ShapeDtypeStruct((1, 15, 151936), jnp.float32)

    def tree_text(kernel_backend):
        return jax.jit(lambda x: tree_module._build_tree_impl(
            x, jnp.zeros((1,), jnp.int32), budget=k, width=k + 1, kernel_backend=kernel_backend)).trace(
            lp).lower(lowering_platforms=("cuda",)).as_text()

    text, xla = tree_text("gpu"), tree_text(None)
    assert "top_k_select" in text and "top_k_select" not in xla
    assert text.count("stablehlo.sort") <= xla.count("stablehlo.sort")
    assert k == 512 or "stablehlo.sort" not in text


def test_tree_with_the_kernel_is_the_same() -> None:
    # DDTree(256) over a 1500-token vocabulary and 15 depths, ties across chunks in one
    # sequence; and DDTree(64) over 5000 tokens: the kernel's top-k changes nothing.
    rng = np.random.default_rng(21)
    for batch, vocab, budget in ((2, 1500, 256), (2, 5000, 64)):
        logits = 4.0 * rng.standard_normal((batch, 15, vocab))
        logits[1, :, ::5] = logits[1, :, :1]
        lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        lp, roots = jnp.asarray(lp.astype(np.float32)), jnp.array([3, 4], jnp.int32)
        plain, kern = (tree_module._build_tree(lp, roots, budget=budget, width=tree_width(budget),
                                               kernel_backend=backend) for backend in (None, "cpu"))
        for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(kern)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_kernel_is_the_default_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vocab_backend("gpu") == "gpu" and vocab_backend("cpu") is None
    seen = []
    monkeypatch.setattr(tree_module, "_build_tree", lambda *a, kernel_backend, **kw: seen.append(kernel_backend))
    lp, roots = jnp.zeros((1, 3, 40), jnp.float32), jnp.zeros((1,), jnp.int32)
    tree_module.build_tree(lp, roots, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tree_module.build_tree(lp, roots, 8)
    assert seen == [None, "gpu"]
    # The kernel where it applies, else the XLA way (a vocabulary too short for k chunks is
    # still exact: chunks of one entry; past the kernel's limits lax.top_k).
    rows = jnp.asarray(hard_rows(2, 300, 8))
    check_equal(kernel_top_k(rows, 8, backend="cpu"), jax.lax.top_k(rows, 8))
    big = jax.ShapeDtypeStruct((2, 1 << 22), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda r: kernel_top_k(r, 1024, backend="gpu"))(big))
    assert "pallas_call" not in jaxpr


def test_greedy_ddtree_with_the_kernel_is_the_same(tmp_path, monkeypatch) -> None:
    # A whole decode (tiny random target and drafter, vocabulary 40): the same tokens with the
    # tree's vocabulary top-k by the kernels (interpreted here) as by chunked_top_k.
    from dflash_jax.pipeline import pad_prompts
    from dflash_jax.speculative import SpecSettings, generate_speculative
    from tests.spec_models import convert_pair, drafter_model, target_model

    cfg, params, dcfg, dparams = convert_pair(target_model(vocab=40), drafter_model(16, vocab=40), tmp_path)
    arr, lens = pad_prompts([[1, 5, 7], [3, 2, 9, 11, 4]], multiple=32)
    s = SpecSettings(method="ddtree", block_size=16, budget=32, max_new_tokens=12)
    out = []
    for backend in (None, "cpu"):
        monkeypatch.setattr(tree_module, "vocab_backend", lambda backend_=None, b=backend: b)
        jax.clear_caches()  # the jitted generation must trace the tree again
        g = generate_speculative(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens),
                                 jax.random.key(0), settings=s, max_len=128)
        out.append((np.asarray(g.tokens), np.asarray(g.num_tokens)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the compiled kernels)")
@pytest.mark.parametrize("k,length", [(1, 37), (16, 4099), (64, 997), (256, 1237), (256, 20000),
                                      (256, 151936), (512, 2053), (512, 151936)])
def test_gpu_kernel_equals_top_k(k: int, length: int) -> None:
    """The compiled kernels (no interpreter) on the same hard rows: exactly top_k's total order.

    The expected result is lax.top_k over the int32 order keys: on the GPU, lax.top_k over the
    floats themselves ranks -0.0 level with +0.0 at k 16 (its small-k kernel compares with >),
    where the CPU and these kernels put +0.0 first.
    """
    rows = jnp.asarray(hard_rows(k * 7919 + length, length, k))
    _, idx = jax.lax.top_k(tree_module._order_keys(rows), k)
    want = (jnp.take_along_axis(rows, idx, axis=1), idx.astype(jnp.int32))
    check_equal(jax.jit(lambda r: tk.top_k(r, k))(rows), want)
