"""Qwen3 and Llama decoder-only target models as pure functions.

One `forward` serves prefill, autoregressive decode (W=1), DFlash chain verification and
DDTree tree verification: it takes W new tokens per sequence, writes their K/V at slots
`lengths .. lengths+W-1` of the cache, and attends to the committed prefix plus the new
tokens under an optional [batch, W, W] visibility mask.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig
from dflash_jax.kv_cache import KVCache, gather_rows, write_rows
from dflash_jax.params import EMBED, HEAD_DIM, KV_HEADS, MLP, Q_HEADS, VOCAB, Spec, init_from_specs
from dflash_jax.rope import apply_rope, rope_tables
from dflash_jax.sharding import (BATCH, attention, constrain, constrain_cache, embed_lookup, row_groups,
                                 row_parallel_chunks)

dataclass = dataclasses.dataclass


# ----------------------------------------------------------------------------- parameters

@jax.tree_util.register_dataclass
@dataclass
class AttentionParams:
    q: Any  # [embed, q_heads, head_dim]
    k: Any  # [embed, kv_heads, head_dim]
    v: Any  # [embed, kv_heads, head_dim]
    o: Any  # [q_heads, head_dim, embed]
    q_norm: Any = None  # [head_dim] (qwen3)
    k_norm: Any = None  # [head_dim] (qwen3)
    q_bias: Any = None  # [q_heads, head_dim] (attention_bias)
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None  # [embed]


@jax.tree_util.register_dataclass
@dataclass
class MLPParams:
    gate: Any  # [embed, mlp]
    up: Any  # [embed, mlp]
    down: Any  # [mlp, embed]


@jax.tree_util.register_dataclass
@dataclass
class LayerParams:
    attn_norm: Any  # [embed]
    attn: AttentionParams
    mlp_norm: Any  # [embed]
    mlp: MLPParams


@jax.tree_util.register_dataclass
@dataclass
class ModelParams:
    embed: Any  # [vocab, embed]
    layers: tuple  # tuple[LayerParams, ...]
    final_norm: Any  # [embed]
    lm_head: Any = None  # [embed, vocab]; None when tied to `embed`


def attention_specs(cfg: ModelConfig, hidden: int | None = None) -> AttentionParams:
    """Declares one attention block's weights (shared with the drafter, which reuses this block)."""
    e = hidden or cfg.hidden_size
    qh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.attention_bias
    return AttentionParams(
        q=Spec((e, qh, hd), (EMBED, Q_HEADS, HEAD_DIM), fan_in=e),
        k=Spec((e, kvh, hd), (EMBED, KV_HEADS, HEAD_DIM), fan_in=e),
        v=Spec((e, kvh, hd), (EMBED, KV_HEADS, HEAD_DIM), fan_in=e),
        o=Spec((qh, hd, e), (Q_HEADS, HEAD_DIM, EMBED), fan_in=qh * hd),
        q_norm=Spec((hd,), (HEAD_DIM,), init="ones") if cfg.qk_norm else None,
        k_norm=Spec((hd,), (HEAD_DIM,), init="ones") if cfg.qk_norm else None,
        q_bias=Spec((qh, hd), (Q_HEADS, HEAD_DIM), init="zeros") if bias else None,
        k_bias=Spec((kvh, hd), (KV_HEADS, HEAD_DIM), init="zeros") if bias else None,
        v_bias=Spec((kvh, hd), (KV_HEADS, HEAD_DIM), init="zeros") if bias else None,
        o_bias=Spec((e,), (EMBED,), init="zeros") if bias else None,
    )


def mlp_specs(cfg: ModelConfig) -> MLPParams:
    e, m = cfg.hidden_size, cfg.intermediate_size
    return MLPParams(gate=Spec((e, m), (EMBED, MLP), fan_in=e), up=Spec((e, m), (EMBED, MLP), fan_in=e),
                     down=Spec((m, e), (MLP, EMBED), fan_in=m))


def layer_specs(cfg: ModelConfig) -> LayerParams:
    e = cfg.hidden_size
    return LayerParams(attn_norm=Spec((e,), (EMBED,), init="ones"), attn=attention_specs(cfg),
                       mlp_norm=Spec((e,), (EMBED,), init="ones"), mlp=mlp_specs(cfg))


def model_specs(cfg: ModelConfig) -> ModelParams:
    e, v = cfg.hidden_size, cfg.vocab_size
    return ModelParams(
        embed=Spec((v, e), (VOCAB, EMBED), fan_in=1),
        layers=tuple(layer_specs(cfg) for _ in range(cfg.num_layers)),
        final_norm=Spec((e,), (EMBED,), init="ones"),
        lm_head=None if cfg.tie_word_embeddings else Spec((e, v), (EMBED, VOCAB), fan_in=e),
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> ModelParams:
    """Random weights (for tests and benchmarks)."""
    return init_from_specs(model_specs(cfg), key, dtype)


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalises the last axis in float32; returns x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def _dot(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum with float32 accumulation, result in the activation dtype."""
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _row_parallel_dot(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum whose result is in the activation dtype from the start.

    Under tp the contracted axis is split, and XLA all-reduces the dot's own result: asking for
    float32 there (as `_dot` does) would all-reduce float32 partial sums, twice the bytes of bf16.
    The GPU GEMMs still accumulate in float32; only the partial sums are rounded before the sum.
    Under `sharding.all_reduce_max_bytes` a large result is computed and all-reduced in row
    chunks (the sequence axis): [batch, seq, ...] x [..., out] -> [batch, seq, out].
    """
    chunks = row_parallel_chunks(x.shape[1], x.shape[0], w.shape[-1] * x.dtype.itemsize)
    if len(chunks) == 1:
        return jnp.einsum(eq, x, w, preferred_element_type=x.dtype)
    parts, start = [], 0
    for n in chunks:
        part = jnp.einsum(eq, jax.lax.slice_in_dim(x, start, start + n, axis=1), w, preferred_element_type=x.dtype)
        parts.append(constrain(part, (BATCH, None, None)))  # each chunk's own all-reduce
        start += n
    return jnp.concatenate(parts, axis=1)


def project_qkv(p: AttentionParams, cfg: ModelConfig, x: jax.Array, kv_input: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [batch, seq, embed] -> q [batch, seq, q_heads, head_dim], k/v [batch, kv_seq, kv_heads, head_dim].

    Per-head q/k norms (qwen3) are applied here, before RoPE. `kv_input` lets the drafter
    project keys/values from other rows than the queries.
    """
    kv_src = x if kv_input is None else kv_input
    q = _dot("bse,ehd->bshd", x, p.q)
    k = _dot("bse,ehd->bshd", kv_src, p.k)
    v = _dot("bse,ehd->bshd", kv_src, p.v)
    if p.q_bias is not None:
        q, k, v = q + p.q_bias.astype(q.dtype), k + p.k_bias.astype(k.dtype), v + p.v_bias.astype(v.dtype)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    # Tensor parallel: heads split over tp (no-ops without a mesh; see dflash_jax.sharding).
    kv_axes = (BATCH, None, KV_HEADS, None)
    return constrain(q, (BATCH, None, Q_HEADS, None)), constrain(k, kv_axes), constrain(v, kv_axes)


def output_projection(p: AttentionParams, attn: jax.Array) -> jax.Array:
    """attn: [batch, seq, q_heads, head_dim] -> [batch, seq, embed]."""
    out = _row_parallel_dot("bshd,hde->bse", attn, p.o)  # row-parallel under tp: one all-reduce
    out = constrain(out, (BATCH, None, None))
    return out + p.o_bias.astype(out.dtype) if p.o_bias is not None else out


def mlp(p: MLPParams, x: jax.Array) -> jax.Array:
    gate = jnp.einsum("bse,em->bsm", x, p.gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("bse,em->bsm", x, p.up, preferred_element_type=jnp.float32)
    act = constrain((jax.nn.silu(gate) * up).astype(x.dtype), (BATCH, None, MLP))
    # Row-parallel under tp: one all-reduce.
    return constrain(_row_parallel_dot("bsm,me->bse", act, p.down), (BATCH, None, None))


def lm_head_weight(params: ModelParams) -> jax.Array:
    """[embed, vocab]; the transposed embedding when tied."""
    return params.embed.T if params.lm_head is None else params.lm_head


def logits_from_hidden(params: ModelParams, hidden: jax.Array) -> jax.Array:
    """hidden: [..., embed] (already final-normed) -> float32 logits [..., vocab]."""
    logits = jnp.einsum("...e,ev->...v", hidden, lm_head_weight(params).astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    # Vocab-parallel under tp: logits stay split over the vocabulary.
    return constrain(logits, (BATCH,) * (logits.ndim > 1) + (None,) * max(logits.ndim - 2, 0) + (VOCAB,))


def embed_tokens(params: ModelParams, tokens: jax.Array) -> jax.Array:
    return embed_lookup(params.embed, tokens)  # vocab-parallel under tp


# ----------------------------------------------------------------------------- forward

def _after_attention(lp: LayerParams, cfg: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """x + o_proj(attn), then + MLP; x: [batch, W, embed], attn: [batch, W, q_heads, head_dim].

    Under `sharding.overlap_row_groups` the rows run as independent groups, each with its own
    two all-reduces, so that one group's all-reduce may overlap the next group's products.
    """
    parts = []
    for start, stop in row_groups(x.shape[1]):
        xg, ag = (x, attn) if (start, stop) == (0, x.shape[1]) else (x[:, start:stop], attn[:, start:stop])
        xg = xg + output_projection(lp.attn, ag)
        parts.append(xg + mlp(lp.mlp, rms_norm(xg, lp.mlp_norm, cfg.rms_norm_eps)))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


@jax.tree_util.register_dataclass
@dataclass
class ForwardOutput:
    logits: Any  # [batch, rows, vocab] float32, or None
    taps: Any  # [batch, W, len(tap_layers) * embed], or None
    cache: KVCache  # new K/V written; `lengths` unchanged (the caller commits)
    hidden: Any = None  # [batch, W, embed] final-normed hidden states (only if requested)


def forward(params: ModelParams, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, visible: jax.Array | None = None, *, tap_layers: tuple[int, ...] = (),
            logit_rows: jax.Array | None = None, compute_logits: bool = True,
            return_hidden: bool = False, attn_impl: str = "auto") -> ForwardOutput:
    """Runs W new tokens per sequence through the target.

    tokens, positions: [batch, W] int32. The new K/V go to cache slots
    `cache.lengths[b] .. cache.lengths[b] + W - 1`; query t sees every committed slot and
    new slot s where visible[b, t, s] (default: s <= t, i.e. causal).
    tap_layers: decoder layer ids whose outputs are returned (HF `hidden_states[id + 1]`, which
        for the last layer is the final-normed output).
    logit_rows: optional [batch, R] row indices; logits are computed only for those rows.
    """
    bad = [t for t in tap_layers if not 0 <= t < cfg.num_layers]
    if bad:
        raise ValueError(f"tap_layers {bad} out of range for a {cfg.num_layers}-layer target")
    x = embed_tokens(params, tokens)
    cos, sin = rope_tables(positions, cfg.rope, cfg.head_dim)
    starts = cache.lengths
    new_k, new_v, taps = [], [], {}
    for i, lp in enumerate(params.layers):
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q, k, v = project_qkv(lp.attn, cfg, h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_buf = constrain_cache(write_rows(cache.k[i], k, starts))
        v_buf = constrain_cache(write_rows(cache.v[i], v, starts))
        attn = attention(q, k_buf, v_buf, starts, visible, impl=attn_impl)  # shard_map under a mesh
        x = _after_attention(lp, cfg, x, attn)
        new_k.append(k_buf)
        new_v.append(v_buf)
        if i in tap_layers:
            taps[i] = x
    hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    # HF's hidden_states[-1] is the final-normed output; keep that meaning for the last layer.
    taps[cfg.num_layers - 1] = hidden
    tap_out = jnp.concatenate([taps[t] for t in tap_layers], -1) if tap_layers else None
    logits = None
    if compute_logits:
        rows = hidden if logit_rows is None else gather_rows(hidden, logit_rows)
        logits = logits_from_hidden(params, rows)
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths)
    return ForwardOutput(logits=logits, taps=tap_out, cache=new_cache,
                         hidden=hidden if return_hidden else None)


# `forward` as one compiled program (configs and flags static); the decoders jit whole loops instead.
forward_jit = jax.jit(forward, static_argnames=("cfg", "tap_layers", "compute_logits", "return_hidden", "attn_impl"))
