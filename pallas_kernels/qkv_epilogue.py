"""The epilogue of the fused qkv projection in one launch (Pallas, Triton backend).

After the `qkv` GEMM of a layer, XLA ran eight small kernels per layer on a 272-token tree
(BENCHMARKS.md): slices of q and k, the per-head RMS norms, RoPE, the move
of q into the Hopper kernel's row layout, its zero padding, and two cache writes, about 21 us
of kernels per layer. This kernel does all of it per (sequence, kv head, block of tokens):

* q: RMS norm (qwen3), RoPE, written as rows [batch, kv_heads, tokens_padded, group, head_dim],
  which is the Hopper kernel's [batch, kv_heads, rows, head_dim] (row = token * group + head in
  the group) with zero padding rows;
* k: RMS norm, RoPE, written into the layer's K cache at slots L .. L+W-1, in place;
* v: written into the V cache at the same slots, in place.

The rounding follows the jnp path (`model.rms_norm`, `rope.apply_rope`): the norm in float32,
rounded to the activation dtype, RoPE in float32, rounded again.

`kv_epilogue` is the same kernel without q (group 0): the drafter's context rows, whose keys and
values come from its `kv` product alone (`drafter.append_context`): the k norm, RoPE and both
cache writes in one launch instead of about six XLA kernels a drafter layer. It reads one layer
of a product made for all layers at once (`drafter.stacked_context_kv`) in place.

`qkv_epilogue_reference` and `kv_epilogue_reference` are the same contracts in jnp, from the
model's own functions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two
from pallas_kernels.reference_ops import apply_rope, rms_norm, write_rows

# Rows (tokens x group) per program: one 128-row block of the Hopper kernel or less. 8 tokens
# and 4 warps took 4.0 / 5.6 us of kernel time at W 272 / 528 on an H200, against 5.0 / 6.9 us
# for 16 tokens (BENCHMARKS.md).
_MAX_ROWS = 128
_MAX_TOKENS = 8
NUM_WARPS = 4


def token_block(group: int) -> int:
    """Tokens per program: 8, or fewer so that tokens x group stays within 128 rows (8 without q,
    group 0)."""
    return min(_MAX_TOKENS, _MAX_ROWS // max(group, 1))


def applies(group: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape: Triton blocks need power-of-two extents."""
    return is_power_of_two(group) and group <= _MAX_ROWS and applies_kv(head_dim)


def _kernel(starts_ref, qkv_ref, cos_ref, sin_ref, q_norm_ref, k_norm_ref, k_in_ref, v_in_ref,
            *out_refs, width: int, group: int, tokens: int, eps: float, norm: bool):
    """One program: one sequence, one kv head, `tokens` tokens.

    Refs (batch and kv head squeezed): starts_ref [1] int32; qkv_ref [width, group + 2, head_dim];
    cos_ref, sin_ref [width, head_dim] f32; q_norm_ref, k_norm_ref [1, head_dim];
    out_refs: q_ref [tokens, group, head_dim] (this block's rows; absent when group is 0), then
    k_ref, v_ref [max_len, 1, head_dim] (the caches, aliased with k_in_ref / v_in_ref, which are
    not read).
    """
    del k_in_ref, v_in_ref
    q_ref, k_ref, v_ref = out_refs if group else (None, *out_refs)
    t0 = pl.program_id(2) * tokens
    head_dim = qkv_ref.shape[-1]
    half = head_dim // 2
    ok = (t0 + jnp.arange(tokens, dtype=jnp.int32)) < width  # padding tokens load as 0
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    rows = pl.ds(t0, tokens)
    dtype = qkv_ref.dtype

    def load(ref, heads, cols):
        return plgpu.load(ref.at[rows, heads, cols], mask=ok[:, None, None], other=0).astype(jnp.float32)

    cos_lo, cos_hi, sin_lo, sin_hi = (
        plgpu.load(ref.at[rows, cols], mask=ok[:, None], other=0)[:, None, :]
        for ref in (cos_ref, sin_ref) for cols in (lo, hi))

    def norm_rope(heads, weight_ref):
        """[tokens, n, head_dim] halves after the RMS norm and RoPE, rounded as the jnp path."""
        x_lo, x_hi = load(qkv_ref, heads, lo), load(qkv_ref, heads, hi)
        if norm:
            mean_sq = (jnp.sum(x_lo * x_lo, axis=-1) + jnp.sum(x_hi * x_hi, axis=-1)) / head_dim
            inv = jax.lax.rsqrt(mean_sq + eps)[..., None]
            w_lo = weight_ref[:, lo].astype(jnp.float32)[None]
            w_hi = weight_ref[:, hi].astype(jnp.float32)[None]
            x_lo = (w_lo * (x_lo * inv)).astype(dtype).astype(jnp.float32)
            x_hi = (w_hi * (x_hi * inv)).astype(dtype).astype(jnp.float32)
        return x_lo * cos_lo - x_hi * sin_lo, x_hi * cos_hi + x_lo * sin_hi

    if group:
        q_lo, q_hi = norm_rope(pl.ds(0, group), q_norm_ref)
        plgpu.store(q_ref.at[:, :, lo], q_lo.astype(dtype))
        plgpu.store(q_ref.at[:, :, hi], q_hi.astype(dtype))

    # The cache rows of this block; stores past the tree are masked off.
    slots = pl.ds(starts_ref[0] + t0, tokens)
    k_lo, k_hi = norm_rope(pl.ds(group, 1), k_norm_ref)
    plgpu.store(k_ref.at[slots, :, lo], k_lo.astype(k_ref.dtype), mask=ok[:, None, None])
    plgpu.store(k_ref.at[slots, :, hi], k_hi.astype(k_ref.dtype), mask=ok[:, None, None])
    v = plgpu.load(qkv_ref.at[rows, pl.ds(group + 1, 1), :], mask=ok[:, None, None], other=0)
    plgpu.store(v_ref.at[slots, :, :], v.astype(v_ref.dtype), mask=ok[:, None, None])


def qkv_epilogue(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, cos: jax.Array,
                 sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, *, eps: float,
                 padded_rows: int, tokens: int | None = None, num_warps: int = NUM_WARPS,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused qkv product's epilogue in one launch.

    Args:
      qkv: [batch, width, kv_heads, group + 2, head_dim], the product (bias added): per kv head
        its `group` q heads, then k, then v.
      q_norm, k_norm: [head_dim] RMS-norm weights, or both None (no qk norm).
      cos, sin: [batch, width, head_dim] f32 (`rope.rope_tables` at the tokens' positions).
      k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; donated (updated in place).
      starts: [batch] int32 L; callers guarantee L + width <= max_len.
      padded_rows: rows per kv head of the output, a multiple of `tokens * group` and at least
        width * group.
      tokens, num_warps: the block (a power of two; default `token_block(group)`) and warps of
        one program.
    Returns:
      (q_rows [batch, kv_heads, padded_rows, head_dim] with zero padding rows,
       k_cache, v_cache with the tree's K/V at slots L .. L+width-1).
    """
    batch, width, kv_heads, slots, head_dim = qkv.shape
    group = slots - 2
    tokens = token_block(group) if tokens is None else tokens
    if not is_power_of_two(tokens):
        raise ValueError(f"qkv_epilogue: tokens={tokens} must be a power of two")
    if not applies(group, head_dim):
        raise ValueError(f"qkv_epilogue: group={group} and head_dim={head_dim} must be powers of two "
                         f"(group <= {_MAX_ROWS}, head_dim >= 32)")
    if padded_rows % (tokens * group) or padded_rows < width * group:
        raise ValueError(f"qkv_epilogue: padded_rows={padded_rows} must be a multiple of "
                         f"{tokens * group} and at least width * group = {width * group}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qkv_epilogue: q_norm and k_norm come together or not at all")
    q_rows, k_out, v_out = _launch("qkv_epilogue", qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, starts,
                                   eps=eps, padded_tokens=padded_rows // group, tokens=tokens,
                                   num_warps=num_warps, interpret=interpret)
    return q_rows.reshape(batch, kv_heads, padded_rows, head_dim), k_out, v_out


def kv_epilogue(kv: jax.Array, k_norm: jax.Array | None, cos: jax.Array, sin: jax.Array,
                k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, *, eps: float,
                layer: int | None = None, num_warps: int = NUM_WARPS, interpret: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """`qkv_epilogue` for keys and values alone: the k norm, RoPE and both cache writes in one launch.

    Args:
      kv: [batch, width, kv_heads, 2, head_dim], a `kv` product (bias added): k, then v; or, with
        `layer`, [batch, width, layers, kv_heads, 2, head_dim], every layer's (the drafter's
        `stacked_context_kv`), of which the launch reads layer `layer` in place.
      k_norm: [head_dim] RMS-norm weight, or None (no k norm).
      cos, sin: [batch, width, head_dim] f32 at the rows' positions.
      k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; donated (updated in place).
      starts: [batch] int32 L; callers guarantee L + width <= max_len.
    Returns:
      (k_cache, v_cache) with the rows' K/V at slots L .. L+width-1.
    """
    head_offset, kv_heads = 0, None
    if layer is not None:
        if kv.ndim != 6 or not 0 <= layer < kv.shape[2]:
            raise ValueError(f"kv_epilogue: with layer={layer}, kv {kv.shape} must be "
                             f"[batch, width, layers, kv_heads, 2, head_dim] with layer < layers")
        b, w, layers, kvh = kv.shape[:4]
        kv = kv.reshape(b, w, layers * kvh, *kv.shape[4:])  # free: the layers' heads side by side
        head_offset, kv_heads = layer * kvh, kvh
    if kv.ndim != 5 or kv.shape[3] != 2 or not applies_kv(kv.shape[4]):
        raise ValueError(f"kv_epilogue: kv {kv.shape} must be [batch, width, kv_heads, 2, head_dim] with "
                         f"head_dim a power of two >= 32")
    width = kv.shape[1]
    tokens = token_block(0)
    return _launch("kv_epilogue", kv, None, k_norm, cos, sin, k_cache, v_cache, starts, eps=eps,
                   padded_tokens=pl.cdiv(width, tokens) * tokens, tokens=tokens, num_warps=num_warps,
                   interpret=interpret, head_offset=head_offset, kv_heads=kv_heads)


def applies_kv(head_dim: int) -> bool:
    """Whether `kv_epilogue` takes this head size (a power-of-two Triton block)."""
    return is_power_of_two(head_dim) and head_dim >= 32


def _launch(name: str, qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, cos: jax.Array,
            sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, *, eps: float,
            padded_tokens: int, tokens: int, num_warps: int, interpret: bool, head_offset: int = 0,
            kv_heads: int | None = None) -> tuple[jax.Array, ...]:
    """The kernel over qkv [batch, width, heads, group + 2, head_dim] (group 0: k and v alone),
    its kv heads head_offset .. head_offset + kv_heads - 1 (default: all of them):
    (q rows [batch, kv_heads, padded_tokens, group, head_dim] if group, then k_cache, v_cache)."""
    batch, width, heads, slots, head_dim = qkv.shape
    kv_heads = heads if kv_heads is None else kv_heads
    group = slots - 2
    if (k_cache.shape != v_cache.shape or k_cache.shape[::2] != (batch, kv_heads) or k_cache.shape[3] != head_dim
            or head_offset + kv_heads > heads):
        raise ValueError(f"{name}: k_cache {k_cache.shape} / v_cache {v_cache.shape} do not fit "
                         f"{qkv.shape} ([batch, max_len, kv_heads, head_dim])")
    if cos.shape != (batch, width, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos {cos.shape} / sin {sin.shape} must be {(batch, width, head_dim)}")
    norm = k_norm is not None
    ones = jnp.ones((head_dim,), qkv.dtype)
    q_w = (q_norm if q_norm is not None else ones).reshape(1, head_dim)
    k_w = (k_norm if norm else ones).reshape(1, head_dim)
    max_len = k_cache.shape[1]
    sq = pl.squeezed if hasattr(pl, "squeezed") else None
    cache_spec = pl.BlockSpec((sq, max_len, 1, head_dim), lambda b, h, i: (b, 0, h, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, i: (b,)),
        pl.BlockSpec((sq, width, sq, slots, head_dim), lambda b, h, i: (b, 0, h + head_offset, 0, 0)),
        pl.BlockSpec((sq, width, head_dim), lambda b, h, i: (b, 0, 0)),
        pl.BlockSpec((sq, width, head_dim), lambda b, h, i: (b, 0, 0)),
        pl.BlockSpec((1, head_dim), lambda b, h, i: (0, 0)),
        pl.BlockSpec((1, head_dim), lambda b, h, i: (0, 0)),
        cache_spec,
        cache_spec,
    ]
    out_specs = [cache_spec, cache_spec]
    out_shape = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    if group:
        out_specs.insert(0, pl.BlockSpec((sq, sq, tokens, group, head_dim), lambda b, h, i: (b, h, i, 0, 0)))
        out_shape.insert(0, jax.ShapeDtypeStruct((batch, kv_heads, padded_tokens, group, head_dim), qkv.dtype))
    first_cache = 1 if group else 0
    kernel = functools.partial(_kernel, width=width, group=group, tokens=tokens, eps=float(eps), norm=norm)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, padded_tokens // tokens),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        out_shape=tuple(out_shape),
        input_output_aliases={6: first_cache, 7: first_cache + 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(starts.astype(jnp.int32), qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), q_w, k_w,
      k_cache, v_cache)


def qkv_epilogue_reference(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                           cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           starts: jax.Array, *, eps: float, padded_rows: int
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`qkv_epilogue` in jnp: the model's norm, RoPE and cache write (`reference_ops`)."""
    from pallas_kernels.tree_attention_hopper import rows_of

    batch, width, kv_heads, slots, head_dim = qkv.shape
    group = slots - 2
    q = qkv[:, :, :, :group].reshape(batch, width, kv_heads * group, head_dim)
    k, v = qkv[:, :, :, group], qkv[:, :, :, group + 1]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return (rows_of(q, kv_heads, padded_rows), write_rows(k_cache, k, starts),
            write_rows(v_cache, v, starts))


def kv_epilogue_reference(kv: jax.Array, k_norm: jax.Array | None, cos: jax.Array, sin: jax.Array,
                          k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, *, eps: float
                          ) -> tuple[jax.Array, jax.Array]:
    """`kv_epilogue` in jnp, as the drafter's context pass computes it (`reference_ops`)."""
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    return write_rows(k_cache, apply_rope(k, cos, sin), starts), write_rows(v_cache, v, starts)
