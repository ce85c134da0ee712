"""The kernels' pure-JAX building blocks (`pallas_kernels/reference_ops.py`) equal the model's own
functions, bit for bit, so that a kernel checked against its reference is checked against the
model's arithmetic (pallas_kernels imports nothing from dflash_jax, so the two are separate code)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kv_cache, model, rope
from dflash_jax.config import RopeConfig
from pallas_kernels import reference_ops as ops


def same(a: jax.Array, b: jax.Array) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_is_the_models(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 64)) * 4, dtype)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(64), dtype)
    for eps in (1e-6, 1e-5):
        same(ops.rms_norm(x, w, eps), model.rms_norm(x, w, eps))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_is_the_models(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 7, 4, 32)), dtype)
    positions = jnp.asarray(rng.integers(0, 5000, (2, 7)), jnp.int32)
    cos, sin = rope.rope_tables(positions, RopeConfig(theta=1e6), 32)
    same(ops.apply_rope(x, cos, sin), rope.apply_rope(x, cos, sin))


def test_row_writes_and_reads_are_the_caches():
    rng = np.random.default_rng(2)
    buf = jnp.asarray(rng.standard_normal((3, 20, 2, 8)), jnp.bfloat16)
    rows = jnp.asarray(rng.standard_normal((3, 5, 2, 8)), jnp.float32)
    starts = jnp.asarray([0, 7, 15], jnp.int32)
    same(ops.write_rows(buf, rows, starts), kv_cache.write_rows(buf, rows, starts))
    index = jnp.asarray(rng.integers(0, 20, (3, 6)), jnp.int32)
    same(ops.gather_rows(buf, index), kv_cache.gather_rows(buf, index))
