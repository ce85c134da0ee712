"""The target model's key/value cache: fixed `max_len`, one length per sequence."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.sharding import constrain_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value buffers plus the committed length of each sequence.

    k, v: tuple over layers of [batch, max_len, kv_heads, head_dim]
    lengths: [batch] int32, committed tokens per sequence (slots >= length are scratch)

    One array per layer rather than one [layers, ...] array: each layer's buffer is then
    updated in place and handed to the attention kernel without a slice copy.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype: Any = jnp.float32) -> "KVCache":
        shape = (batch, max_len, kv_heads, head_dim)
        # Under a mesh: batch over dp, KV heads over tp (dflash_jax.sharding); else plain zeros.
        return cls(k=tuple(constrain_cache(jnp.zeros(shape, dtype)) for _ in range(num_layers)),
                   v=tuple(constrain_cache(jnp.zeros(shape, dtype)) for _ in range(num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(buffer: jax.Array, rows: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes rows[b] into buffer[b, starts[b]:starts[b]+W].

    buffer: [batch, max_len, ...]; rows: [batch, W, ...]; starts: [batch] int32.
    Callers guarantee starts + W <= max_len (dynamic_update_slice would clamp silently).
    """
    def one(buf: jax.Array, row: jax.Array, start: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), start, axis=0)

    return jax.vmap(one)(buffer, rows, starts)


def gather_rows(buffer: jax.Array, index: jax.Array) -> jax.Array:
    """buffer: [batch, n, ...]; index: [batch, m] -> [batch, m, ...]."""
    return jax.vmap(lambda b, i: b[i])(buffer, index)
