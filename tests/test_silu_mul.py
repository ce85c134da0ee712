"""The gated-activation kernel after XLA's gate_up product (`pallas_kernels/silu_mul.py`) and the
model's path through it.

On CPU: the kernel in interpret mode against its jnp reference, which is checked against the
model's own `mlp_activation`; its block rule and input checks; its lowering for cuda; a forward
on the fused residual path with activation "kernel" against "xla" (an unknown activation is
named: tests/test_residual_norm.py). On an H100/H200: the compiled kernel against the reference.
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
from pallas_kernels.silu_mul import applies, block_cols, silu_mul, silu_mul_reference
from tests.test_qkv_epilogue import tiny_config

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")


def make_both(seed: int, rows: int, mlp: int, dtype) -> jax.Array:
    """A fused gate_up product [rows, 2, mlp], values wide enough to reach SiLU's tails."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((rows, 2, mlp)) * 4, dtype)


@pytest.mark.parametrize("rows,mlp,cols,dtype", [(5, 384, None, jnp.float32), (17, 256, 128, jnp.bfloat16),
                                                 (1, 8192, None, jnp.bfloat16), (3, 640, None, jnp.float16)])
def test_kernel_matches_reference(rows, mlp, cols, dtype):
    both = make_both(rows + mlp, rows, mlp, dtype)
    got = silu_mul(both, cols=cols, interpret=True)
    assert got.shape == (rows, mlp) and got.dtype == both.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(silu_mul_reference(both), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_model_path(dtype):
    """The reference is `mlp_activation` on the same fused product: its values, its rounding."""
    cfg = tiny_config(intermediate_size=256)
    mlp_params = model_lib.init_params(cfg, jax.random.key(3), dtype, fused=True).layers[0].mlp
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 7, cfg.hidden_size)), dtype)
    both = jnp.einsum("bse,etm->bstm", x, mlp_params.gate_up, preferred_element_type=dtype)
    want = model_lib.mlp_activation(mlp_params, x)
    got = silu_mul_reference(both.reshape(14, 2, -1)).reshape(want.shape)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_block_rule():
    assert block_cols(12288) == 4096 and block_cols(1536) == 512 and block_cols(640) == 128
    assert block_cols(96) == 0 and not applies(96) and not applies(200) and applies(256)


@pytest.mark.parametrize("shape,cols,match", [((4, 3, 256), None, r"\[rows, 2, mlp\]"),
                                              ((4, 2, 96), None, "mlp=96"),
                                              ((4, 2, 256), 96, "cols=96"),
                                              ((4, 2, 256), 512, "cols=512")])
def test_bad_input_is_named(shape, cols, match):
    with pytest.raises(ValueError, match=match):
        silu_mul(jnp.zeros(shape, jnp.bfloat16), cols=cols, interpret=True)


def test_lowers_for_cuda():
    spec = jax.ShapeDtypeStruct((257, 2, 12288), jnp.bfloat16)
    text = jax.jit(silu_mul).trace(spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_with_the_kernel_on_the_fused_residual_path(dtype, monkeypatch):
    """The fused residual path forced on CPU (the junctions and the activation in interpret
    mode): activation "kernel" gives the "xla" path's logits, hidden states and caches."""
    cfg = tiny_config(num_layers=3, intermediate_size=256)
    batch, width, max_len = 2, 12, 48
    params = model_lib.init_params(cfg, jax.random.key(7), dtype, fused=True)
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    lengths = jnp.asarray([3, 20], jnp.int32)
    positions = lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    cache = dataclasses.replace(KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype),
                                lengths=lengths)
    launches = []
    real = silu_mul

    def counted(*a, **kw):
        launches.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(model_lib.activation_kernel, "silu_mul", counted)
    monkeypatch.setattr(model_lib, "residual_splits", lambda *a, **kw: 2)
    run = functools.partial(model_lib.forward, params, cfg, tokens, positions, cache, return_hidden=True,
                            attn_impl="reference")
    want = run(activation="xla")
    assert not launches
    got = run(activation="kernel")
    assert len(launches) == cfg.num_layers
    for name in ("logits", "hidden"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), err_msg=name)
    for a, b in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not hopper.available(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows,mlp", [(257, 12288), (528, 12288), (64, 25600), (16, 1536)])
def test_gpu_kernel_matches_reference(rows, mlp):
    both = make_both(rows * mlp, rows, mlp, jnp.bfloat16)
    got = jax.jit(silu_mul)(both)
    want = silu_mul_reference(both)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    ulp = np.asarray(jnp.finfo(jnp.bfloat16).eps) * np.maximum(np.abs(np.asarray(want, np.float32)), 2.0 ** -126)
    # The same float32 formula; the two compilers' exp may differ in the last float32 bit, which
    # moves the bf16 rounding of a value on a boundary by one unit.
    assert np.all(diff <= ulp), float((diff / ulp).max())
