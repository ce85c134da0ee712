"""The few pure-JAX operations the kernels' references are made of: an RMS norm, a rotary
embedding, and per-sequence row writes and reads of a cache.

The model package has its own copies (`model.rms_norm`, `rope.apply_rope`,
`kv_cache.write_rows` / `gather_rows`). Kernels import nothing from it: a kernel takes arrays
and static sizes, and its reference is written with these; a test
(`tests/test_reference_ops.py`) keeps the two copies equal, so that a kernel checked against
its reference is checked against the model's own arithmetic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., n] normalised over its last axis in float32, times weight [n]; x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, halves rotated: x [batch, seq, heads, head_dim], cos/sin [batch, seq,
    head_dim]; computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def write_rows(buffer: jax.Array, rows: jax.Array, starts: jax.Array) -> jax.Array:
    """buffer [batch, max_len, ...] with rows[b] [W, ...] written at starts[b] .. starts[b] + W - 1
    (in buffer's dtype; starts + W <= max_len)."""
    def one(buf: jax.Array, row: jax.Array, start: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), start, axis=0)

    return jax.vmap(one)(buffer, rows, starts)


def gather_rows(buffer: jax.Array, index: jax.Array) -> jax.Array:
    """buffer [batch, n, ...], index [batch, m] -> [batch, m, ...]: row index[b, i] of sequence b."""
    return jax.vmap(lambda b, i: b[i])(buffer, index)
