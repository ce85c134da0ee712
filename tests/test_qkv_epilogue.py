"""The fused qkv epilogue kernel (`pallas_kernels/qkv_epilogue.py`) and the model path using it.

On CPU: the kernel in interpret mode against its jnp reference (the model's own norm, RoPE and
cache write), its input checks, its lowering for cuda, and the model's wiring of the fused
path (epilogue + attention on rows) against the model's usual path. On an H100/H200: the
compiled kernel against the reference, and a whole forward on the fused path against the
reference attention.
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
from dflash_jax.bench.tree_attention_bench import random_tree_visibility
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.kv_cache import KVCache
from dflash_jax.params import init_from_specs
from dflash_jax.rope import rope_tables
from pallas_kernels import tree_attention_reference
from pallas_kernels.qkv_epilogue import (applies, applies_kv, kv_epilogue, kv_epilogue_reference, qkv_epilogue,
                                         qkv_epilogue_reference, token_block)

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")

ON_HOPPER = hopper.available()


def padded(width: int, group: int, multiple: int | None = None) -> int:
    step = multiple or token_block(group) * group
    return -(-width * group // step) * step


def make_case(seed, batch, width, kv_heads, group, head_dim, max_len, dtype, norm):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((batch, width, kv_heads, group + 2, head_dim)) * 3, dtype)
    q_norm = jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) if norm else None
    k_norm = jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) if norm else None
    starts = jnp.asarray(rng.integers(0, max_len - width + 1, batch), jnp.int32)
    positions = starts[:, None] + jnp.asarray(rng.integers(0, 16, (batch, width)))  # tree depths
    cos, sin = rope_tables(positions, RopeConfig(theta=1e6), head_dim)
    k_cache = jnp.asarray(rng.standard_normal((batch, max_len, kv_heads, head_dim)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((batch, max_len, kv_heads, head_dim)), dtype)
    return qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, starts


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    # bf16: one rounding step of a value near the largest (the norms' sums run in another order).
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


# (batch, width, kv_heads, group, head_dim, max_len, norm)
CASES = [
    (1, 272, 2, 4, 128, 300, True),   # a budget-256 tree, qwen3 norms
    (2, 40, 3, 1, 64, 97, False),     # MHA, no norms (llama), width not a multiple of 16
    (3, 5, 1, 8, 64, 64, True),       # group 8: 16 tokens x 8 heads per program
    (2, 33, 2, 16, 32, 80, True),     # group 16: 8 tokens per program
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,norm", CASES)
def test_epilogue_matches_the_model_path(batch, width, kv_heads, group, head_dim, max_len, norm, dtype):
    args = make_case(width, batch, width, kv_heads, group, head_dim, max_len, dtype, norm)
    rows = padded(width, group, 128)
    got = qkv_epilogue(*args, eps=1e-6, padded_rows=rows, interpret=True)
    want = qkv_epilogue_reference(*args, eps=1e-6, padded_rows=rows)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    q_rows, k_cache, v_cache = got
    # Padding rows are zeros, and cache slots outside L .. L+W-1 are untouched.
    assert np.all(np.asarray(q_rows[:, :, width * group:]) == 0)
    k_before, v_before, starts = np.asarray(args[5]), np.asarray(args[6]), np.asarray(args[7])
    for b, start in enumerate(starts):
        outside = np.r_[0:start, start + width:max_len]
        np.testing.assert_array_equal(np.asarray(k_cache[b, outside]), k_before[b, outside])
        np.testing.assert_array_equal(np.asarray(v_cache[b, outside]), v_before[b, outside])


def test_epilogue_checks_its_inputs():
    args = list(make_case(0, 1, 20, 2, 4, 64, 64, jnp.float32, True))
    with pytest.raises(ValueError, match="padded_rows=72"):
        qkv_epilogue(*args, eps=1e-6, padded_rows=72, interpret=True)
    bad = list(args)
    bad[5] = bad[5][:, :, :1]  # one kv head in the cache, two in qkv
    with pytest.raises(ValueError, match="k_cache"):
        qkv_epilogue(*bad, eps=1e-6, padded_rows=128, interpret=True)
    bad = list(args)
    bad[2] = None  # q_norm without k_norm
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        qkv_epilogue(*bad, eps=1e-6, padded_rows=128, interpret=True)
    bad = list(args)
    bad[3] = bad[3][:, :10]
    with pytest.raises(ValueError, match="cos"):
        qkv_epilogue(*bad, eps=1e-6, padded_rows=128, interpret=True)
    qkv3 = jnp.zeros((1, 20, 2, 3 + 2, 64))  # group 3
    with pytest.raises(ValueError, match="powers of two"):
        qkv_epilogue(qkv3, *args[1:], eps=1e-6, padded_rows=128, interpret=True)
    with pytest.raises(ValueError, match="tokens=6"):
        qkv_epilogue(*args, eps=1e-6, padded_rows=96, tokens=6, interpret=True)
    assert applies(4, 128) and applies(1, 64) and not applies(3, 128) and not applies(4, 96)


def test_epilogue_lowers_for_cuda():
    """The kernel traces and lowers for cuda without a GPU, with both caches updated in place."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    cache = s((1, 5120, 8, 128), bf16)
    args = (s((1, 272, 8, 6, 128), bf16), s((128,), bf16), s((128,), bf16), s((1, 272, 128), jnp.float32),
            s((1, 272, 128), jnp.float32), cache, cache, s((1,), jnp.int32))
    fn = jax.jit(functools.partial(qkv_epilogue, eps=1e-6, padded_rows=1152), donate_argnums=(5, 6))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "qkv_epilogue" in text
    assert text.count("tf.aliasing_output") == 2


# (batch, width, kv_heads, head_dim, max_len, norm): the drafter's context rows (16 a round, a
# prompt's at prefill).
KV_CASES = [
    (1, 16, 8, 128, 40, True),
    (2, 13, 3, 64, 50, False),   # width not a multiple of the 8-token block; no k norm (llama)
    (3, 70, 2, 32, 90, True),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,width,kv_heads,head_dim,max_len,norm", KV_CASES)
def test_kv_epilogue_matches_the_context_pass(batch, width, kv_heads, head_dim, max_len, norm, dtype):
    """Keys and values alone (group 0): the k norm and RoPE rounded as the jnp path, both caches
    written at L .. L+W-1 and untouched elsewhere."""
    qkv, _, k_norm, cos, sin, k_cache, v_cache, starts = make_case(width + 1, batch, width, kv_heads, 0, head_dim,
                                                                    max_len, dtype, norm)
    got = kv_epilogue(qkv, k_norm, cos, sin, k_cache, v_cache, starts, eps=1e-6, interpret=True)
    want = kv_epilogue_reference(qkv, k_norm, cos, sin, k_cache, v_cache, starts, eps=1e-6)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    for b, start in enumerate(np.asarray(starts)):
        outside = np.r_[0:start, start + width:max_len]
        np.testing.assert_array_equal(np.asarray(got[0][b, outside]), np.asarray(k_cache[b, outside]))
        np.testing.assert_array_equal(np.asarray(got[1][b, outside]), np.asarray(v_cache[b, outside]))
        # v is copied, not normed or rotated.
        np.testing.assert_array_equal(np.asarray(got[1][b, start:start + width]), np.asarray(qkv[b, :, :, 1]))


def test_kv_epilogue_checks_its_inputs():
    qkv, _, k_norm, cos, sin, k_cache, v_cache, starts = make_case(1, 1, 16, 2, 0, 64, 40, jnp.float32, True)
    with pytest.raises(ValueError, match="kv_epilogue: kv"):
        kv_epilogue(jnp.zeros((1, 16, 2, 3, 64)), k_norm, cos, sin, k_cache, v_cache, starts, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="kv_epilogue: k_cache"):
        kv_epilogue(qkv, k_norm, cos, sin, k_cache[:, :, :1], v_cache, starts, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="kv_epilogue: cos"):
        kv_epilogue(qkv, k_norm, cos[:, :3], sin, k_cache, v_cache, starts, eps=1e-6, interpret=True)
    assert applies_kv(128) and applies_kv(32) and not applies_kv(96) and not applies_kv(16)


def test_kv_epilogue_lowers_for_cuda():
    """The kv-only kernel lowers for cuda without a GPU, both caches updated in place, no q out."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    cache = s((1, 5120, 8, 128), bf16)
    args = (s((1, 16, 8, 2, 128), bf16), s((128,), bf16), s((1, 16, 128), jnp.float32),
            s((1, 16, 128), jnp.float32), cache, cache, s((1,), jnp.int32))
    fn = jax.jit(functools.partial(kv_epilogue, eps=1e-6), donate_argnums=(4, 5))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "kv_epilogue" in text
    assert text.count("tf.aliasing_output") == 2


def tiny_config(**kw) -> ModelConfig:
    base = dict(model_type="qwen3", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True, rope=RopeConfig(theta=1e4))
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(model_type="llama", qk_norm=False, attention_bias=True,
                                                             num_kv_heads=8)],
                         ids=["qwen3", "llama_bias_mha"])
def test_model_takes_the_fused_path_where_it_applies(cfg, monkeypatch):
    """On CPU the Hopper kernel cannot run, so the fused path is forced: its epilogue runs in
    interpret mode and the attention on rows is the reference. Logits and caches equal the
    model's usual path; and with separate weights, or W x group under 128 rows, no fused path."""
    batch, width, max_len = 2, 40, 96
    params = model_lib.init_params(cfg, jax.random.key(2), jnp.float32)
    params = jax.tree.map(lambda x: x * 1.5, params)  # norms away from ones
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    lengths = jnp.asarray([7, 30], jnp.int32)
    depths = rng.integers(0, 6, (batch, width))
    positions = lengths[:, None] + jnp.asarray(depths, jnp.int32)
    visible = jnp.asarray(random_tree_visibility(rng, batch, width))
    cache = KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    cache = dataclasses.replace(cache, lengths=lengths)

    def rows_schedule(batch, width, q_heads, kv_heads, head_dim, max_len, dtype, impl="auto"):
        if width * (q_heads // kv_heads) < 32:  # the real threshold is 128 rows; these are tiny shapes
            return None
        return hopper.schedule(batch, kv_heads, width * (q_heads // kv_heads), max_len)

    def attention_on_rows(q_rows, k, v, prefix_lens, visible, *, width, group, sched, scale=None):
        q = hopper.tokens_of(q_rows, width, group)
        return tree_attention_reference(q, k, v, prefix_lens, visible, scale=scale)

    calls = []
    epilogue = importlib.import_module("pallas_kernels.qkv_epilogue")
    real = epilogue.qkv_epilogue
    monkeypatch.setattr(model_lib, "rows_schedule", rows_schedule)
    monkeypatch.setattr(model_lib, "tree_attention_rows", attention_on_rows)
    monkeypatch.setattr(epilogue, "qkv_epilogue",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw, interpret=True))

    run = functools.partial(model_lib.forward, params, cfg, tokens, positions, visible=visible, attn_impl="reference")
    fused = run(cache)
    assert len(calls) == cfg.num_layers
    monkeypatch.setattr(model_lib, "rows_schedule", lambda *a, **kw: None)
    usual = run(cache)
    np.testing.assert_allclose(np.asarray(fused.logits), np.asarray(usual.logits), rtol=0,
                               atol=1e-4 * float(np.abs(np.asarray(usual.logits)).max()))
    for a, b in zip(fused.cache.k + fused.cache.v, usual.cache.k + usual.cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(np.abs(np.asarray(b)).max()))

    monkeypatch.setattr(model_lib, "rows_schedule", rows_schedule)
    calls.clear()
    narrow = model_lib.forward(params, cfg, tokens[:, :4], positions[:, :4], cache, visible[:, :4, :4],
                               attn_impl="reference")
    assert not calls and narrow.logits.shape == (batch, 4, cfg.vocab_size)
    separate = init_from_specs(model_lib.checkpoint_specs(cfg), jax.random.key(2))  # q, k, v apart: no qkv
    model_lib.forward(separate, cfg, tokens, positions, cache, visible, attn_impl="reference")
    assert not calls


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,norm", CASES)
def test_gpu_epilogue_matches_reference(batch, width, kv_heads, group, head_dim, max_len, norm):
    args = make_case(width, batch, width, kv_heads, group, head_dim, max_len, jnp.bfloat16, norm)
    rows = padded(width, group, 128)
    got = jax.jit(functools.partial(qkv_epilogue, eps=1e-6, padded_rows=rows))(*args)
    want = qkv_epilogue_reference(*args, eps=1e-6, padded_rows=rows)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.bfloat16)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
# budget 256 at row blocks 16, 8 and 1; DFlash's 16 tokens and DDTree(16)'s 17 (64 and 68 rows)
@pytest.mark.parametrize("width", [272, 264, 257, 16, 17])
def test_gpu_forward_on_the_fused_path_matches_reference(width):
    """A bf16 forward of a tree: epilogue + Hopper kernel against the reference attention."""
    cfg = tiny_config(hidden_size=256, num_heads=16, num_kv_heads=4, head_dim=128, num_layers=3)
    batch, max_len = 2, 1024
    params = model_lib.init_params(cfg, jax.random.key(4), jnp.bfloat16)
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    lengths = jnp.asarray([300, 611], jnp.int32)
    positions = lengths[:, None] + jnp.asarray(rng.integers(0, 16, (batch, width)), jnp.int32)
    visible = jnp.asarray(random_tree_visibility(rng, batch, width))
    cache = KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16)
    cache = dataclasses.replace(cache, k=tuple(k + 0.5 for k in cache.k), lengths=lengths)
    assert model_lib.epilogue_schedule(params, cfg, batch, width, cache, jnp.bfloat16, "pallas") is not None
    outs = {impl: model_lib.forward_jit(params, cfg, tokens, positions, cache, visible, attn_impl=impl)
            for impl in ("pallas", "reference")}
    got, want = (np.asarray(outs[i].logits, np.float64) for i in ("pallas", "reference"))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    # Layer 0's K/V come from the embeddings alone: the epilogue's own rounding. Later layers'
    # inherit the attention's bf16 differences, like the logits.
    for got_kv, want_kv in ((outs["pallas"].cache.k, outs["reference"].cache.k),
                            (outs["pallas"].cache.v, outs["reference"].cache.v)):
        assert_close(got_kv[0], want_kv[0], jnp.bfloat16)
        for a, b in zip(got_kv[1:], want_kv[1:]):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()
