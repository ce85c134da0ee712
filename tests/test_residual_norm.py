"""The split-K sum + residual + RMS norm kernel (`pallas_kernels/residual_norm.py`) and the model's
fused residual path.

On CPU: the kernel in interpret mode against its jnp reference (the model's own norm), its input
checks, its lowering for cuda, the split-K product against one product, the rule for how many
slices the model asks for, and a forward on the fused residual path against the usual one. On an
H100/H200: the compiled kernel against the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import model as model_lib
from dflash_jax.kv_cache import KVCache
from pallas_kernels.residual_norm import residual_norm, residual_norm_reference
from tests.test_qkv_epilogue import tiny_config

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")

# (rows, embed, splits, rows per program, dtype): a power-of-two row, a padded one (96, 576),
# row counts that do not fill the last program, one split, three.
CASES = [
    (16, 256, 2, 1, jnp.bfloat16),
    (5, 96, 3, 1, jnp.float32),
    (7, 576, 1, 4, jnp.bfloat16),
    (9, 128, 2, 2, jnp.float16),
]


def make_case(seed: int, rows: int, embed: int, splits: int, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, embed)) * 3, dtype)
    parts = jnp.asarray(rng.standard_normal((splits, rows, embed)), jnp.float32)
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(embed), dtype)
    return x, parts, weight


def ulps(a: jax.Array, b: jax.Array) -> float:
    """The largest difference in units of b's dtype at b's magnitude (at least 1)."""
    eps = float(jnp.finfo(b.dtype).eps)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a64 - b64) / (eps * np.maximum(np.abs(b64), 1.0))))


@pytest.mark.parametrize("rows,embed,splits,block,dtype", CASES)
def test_kernel_matches_reference(rows, embed, splits, block, dtype):
    x, parts, weight = make_case(rows * embed, rows, embed, splits, dtype)
    got = residual_norm(x, parts, weight, eps=1e-6, rows=block, interpret=True)
    want = residual_norm_reference(x, parts, weight, eps=1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    # The new residual is the same sums rounded the same way; the norm may differ in its last bit
    # (rsqrt and the row sum's order).
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert ulps(got[1], want[1]) <= 1.0


@pytest.mark.parametrize("rows,extra_parts,block", [(13, 3, 1), (7, 1, 4), (9, 0, 2), (5, 2, 1)])
def test_partials_over_more_rows_are_read_as_far_as_x(rows, extra_parts, block):
    """Partials over more rows than x (a product over padded rows) are read only as far as x's."""
    x, parts, weight = make_case(rows, rows, 128, 2, jnp.bfloat16)
    junk = jnp.full((2, extra_parts, 128), 3.0, jnp.float32)  # must not be read
    long_parts = jnp.concatenate([parts, junk], axis=1)
    got = residual_norm(x, long_parts, weight, eps=1e-6, rows=block, interpret=True)
    want = residual_norm_reference(x, long_parts, weight, eps=1e-6)
    plain = residual_norm_reference(x, parts, weight, eps=1e-6)
    assert got[0].shape == got[1].shape == want[1].shape == (rows, 128)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(plain[0], np.float32))
    np.testing.assert_array_equal(np.asarray(want[1], np.float32), np.asarray(plain[1], np.float32))
    assert ulps(got[1], plain[1]) <= 1.0


def test_partials_over_fewer_rows_are_named():
    x, parts, weight = make_case(0, 8, 128, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="parts must be \\[splits, rows >= 8"):
        residual_norm(x, parts[:, :6], weight, eps=1e-6, interpret=True)


def test_reference_is_the_model_path():
    """x + round(x_in @ w) and rms_norm of it, as `_after_attention` computes them, equal the
    reference fed with the split-K partials of the same product (float32)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    x_in = jnp.asarray(rng.standard_normal((6, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 64)) / 10, jnp.float32)
    norm = jnp.asarray(1 + 0.3 * rng.standard_normal(64), jnp.float32)
    parts = model_lib.split_k_product(x_in, w, 2)
    assert parts.shape == (2, 6, 64)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(x_in @ w), rtol=1e-5, atol=1e-5)
    x_new, h = residual_norm_reference(x, parts, norm, eps=1e-6)
    np.testing.assert_allclose(np.asarray(x_new), np.asarray(x + x_in @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(model_lib.rms_norm(x + x_in @ w, norm, 1e-6)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(parts=jnp.zeros((2, 4, 32), jnp.float32)), "parts must be"),
    (dict(parts=jnp.zeros((2, 5, 32), jnp.bfloat16)), "float32"),
    (dict(weight=jnp.zeros((31,), jnp.float32)), "weight must be"),
    (dict(x=jnp.zeros((5, 32, 1), jnp.float32)), "x must be"),
    (dict(rows=3), "rows=3"),
])
def test_bad_input_is_named(bad, match):
    args = dict(x=jnp.zeros((5, 32), jnp.float32), parts=jnp.zeros((2, 5, 32), jnp.float32),
                weight=jnp.zeros((32,), jnp.float32))
    rows = bad.pop("rows", 1)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        residual_norm(**args, eps=1e-6, rows=rows, interpret=True)


def test_lowers_for_cuda():
    x, parts, weight = (jax.ShapeDtypeStruct(s, d) for s, d in
                        (((272, 4096), jnp.bfloat16), ((2, 272, 4096), jnp.float32), ((4096,), jnp.bfloat16)))
    text = jax.jit(functools.partial(residual_norm, eps=1e-6)).trace(x, parts, weight).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "residual_norm" in text


def test_splits_rule():
    """Two K slices where the [rows, embed] output has at most 66 tiles of 136 x 128 (as XLA's
    autotuner chose at 272 rows of Qwen3-8B); the path off above that, off the fused path, or
    with an o bias."""
    cfg = tiny_config(hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128)
    params = model_lib.init_params(tiny_config(), jax.random.key(0), jnp.float32)  # only o_bias is read
    sched = object()
    assert model_lib.residual_splits(params, cfg, 272, sched) == 2
    assert model_lib.residual_splits(params, cfg, 528, sched) == 0
    assert model_lib.residual_splits(params, cfg, 272, None) == 0
    biased = model_lib.init_params(tiny_config(model_type="llama", qk_norm=False, attention_bias=True),
                                   jax.random.key(0), jnp.float32)
    if biased.layers[0].attn.o_bias is not None:
        assert model_lib.residual_splits(biased, cfg, 272, sched) == 0


@pytest.mark.parametrize("taps", [(), (0, 2)])
def test_forward_on_the_fused_residual_path(taps, monkeypatch):
    """The fused residual path forced on CPU (the kernel in interpret mode) against the usual
    path: logits, taps, final hidden states and caches, with the split-K slices at 2."""
    cfg = tiny_config(num_layers=3)
    batch, width, max_len = 2, 12, 48
    params = model_lib.init_params(cfg, jax.random.key(7), jnp.float32)
    leaves, tree = jax.tree.flatten(params)  # every weight scaled apart, the norms away from ones and each other
    keys = jax.random.split(jax.random.key(8), len(leaves))
    params = jax.tree.unflatten(tree, [x * jax.random.uniform(k, x.shape, x.dtype, 0.5, 2.0)
                                       for x, k in zip(leaves, keys)])
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    lengths = jnp.asarray([3, 20], jnp.int32)
    positions = lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    cache = dataclasses.replace(KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim),
                                lengths=lengths)
    calls = []
    real = model_lib._after_attention_fused
    monkeypatch.setattr(model_lib, "_after_attention_fused", lambda *a: calls.append(1) or real(*a))
    run = functools.partial(model_lib.forward, params, cfg, tokens, positions, cache, tap_layers=taps,
                            return_hidden=True, attn_impl="reference")
    usual = run()
    assert not calls
    monkeypatch.setattr(model_lib, "residual_splits", lambda *a, **kw: 2)
    fused = run()
    assert len(calls) == cfg.num_layers
    scale = lambda a: 1e-5 * float(np.abs(np.asarray(a)).max())  # noqa: E731
    for name in ("logits", "hidden") + (("taps",) if taps else ()):
        got, want = getattr(fused, name), getattr(usual, name)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=scale(want), err_msg=name)
    for a, b in zip(fused.cache.k + fused.cache.v, usual.cache.k + usual.cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=scale(b))


@pytest.mark.skipif(not hopper.available(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows,embed,splits", [(272, 4096, 2), (528, 4096, 1), (80, 5120, 2), (257, 4096, 2)])
def test_gpu_kernel_matches_reference(rows, embed, splits):
    x, parts, weight = make_case(rows + embed, rows, embed, splits, jnp.bfloat16)
    got = jax.jit(functools.partial(residual_norm, eps=1e-6))(x, parts, weight)
    want = jax.jit(functools.partial(residual_norm_reference, eps=1e-6))(x, parts, weight)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert ulps(got[1], want[1]) <= 1.0
