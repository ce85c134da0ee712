"""Qwen3 and Llama decoder-only target models as pure functions.

One `forward` serves prefill, autoregressive decode (W=1), DFlash chain verification and
DDTree tree verification: it takes W new tokens per sequence, writes their K/V at slots
`lengths .. lengths+W-1` of the cache, and attends to the committed prefix plus the new
tokens under an optional [batch, W, W] visibility mask.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig
from dflash_jax.kv_cache import KVCache, gather_rows, write_rows
from dflash_jax.params import (EMBED, HEAD_DIM, KV_HEADS, MLP, Q_HEADS, VOCAB, ParamLayout, Part, Spec, init_layout,
                               slot)
from dflash_jax.rope import apply_rope, rope_tables
from dflash_jax.sharding import (BATCH, attention, check_model, constrain, constrain_cache, embed_lookup,
                                 kv_heads_sharded, mesh_sizes, row_groups, row_parallel_chunks, specs_shardings)
from pallas_kernels import qkv_epilogue as epilogue
from pallas_kernels import residual_norm as residual
from pallas_kernels.tree_attention import rows_schedule, tree_attention_rows

dataclass = dataclasses.dataclass


# ----------------------------------------------------------------------------- parameters

@jax.tree_util.register_dataclass
@dataclass
class AttentionParams:
    """One attention block's weights, in one of four layouts (the unused fields None).

    As checkpoints store them (`checkpoint_specs`; the drafter trains in it): q, k, v and biases.
    The target's decoding layout (`model_specs`): qkv and qkv_bias (q, k, v apart where kv heads
    are replicated over tp). The drafter's (`drafter.draft_specs`): qkv for the block, its
    context's k and v in `drafter.DraftParams.context_kv`, every layer's stacked; where kv heads
    are replicated over tp, q apart and kv (its keys and values come from two row sets, the
    context's and the block's; its queries from one).
    """
    q: Any = None  # [embed, q_heads, head_dim]
    k: Any = None  # [embed, kv_heads, head_dim]
    v: Any = None  # [embed, kv_heads, head_dim]
    o: Any = None  # [q_heads, head_dim, embed]
    q_norm: Any = None  # [head_dim] (qwen3)
    k_norm: Any = None  # [head_dim] (qwen3)
    q_bias: Any = None  # [q_heads, head_dim] (attention_bias)
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None  # [embed]
    # [embed, kv_heads, group + 2, head_dim]: per kv head, its `group` q heads, then k, then v.
    qkv: Any = None
    qkv_bias: Any = None  # [kv_heads, group + 2, head_dim]
    kv: Any = None  # [embed, kv_heads, 2, head_dim]: k, then v
    kv_bias: Any = None  # [kv_heads, 2, head_dim]


@jax.tree_util.register_dataclass
@dataclass
class MLPParams:
    """gate and up as checkpoints store them, or fused into gate_up (the decoding layout)."""
    gate: Any = None  # [embed, mlp]
    up: Any = None  # [embed, mlp]
    down: Any = None  # [mlp, embed]
    gate_up: Any = None  # [embed, 2, mlp]: gate, then up


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


def checkpoint_specs(cfg: ModelConfig) -> ModelParams:
    """The target's weights as checkpoints store them (one per HF tensor): the converters' sources."""
    e, v = cfg.hidden_size, cfg.vocab_size
    layer = lambda: LayerParams(attn_norm=Spec((e,), (EMBED,), init="ones"), attn=attention_specs(cfg),  # noqa: E731
                                mlp_norm=Spec((e,), (EMBED,), init="ones"), mlp=mlp_specs(cfg))
    return ModelParams(
        embed=Spec((v, e), (VOCAB, EMBED), fan_in=1),
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        final_norm=Spec((e,), (EMBED,), init="ones"),
        lm_head=None if cfg.tie_word_embeddings else Spec((e, v), (EMBED, VOCAB), fan_in=e),
    )


def qkv_spec(cfg: ModelConfig, prefix: str) -> tuple[Spec, Spec | None]:
    """The fused `qkv` [embed, kv_heads, group + 2, head_dim] (and its bias) made of the
    sources `{prefix}q`, `k`, `v` (and their biases): per kv head its `group` q heads, then k,
    then v. Sharded by kv head, so each tensor-parallel shard holds its q heads with their k
    and v. Shared with the drafter's block pass."""
    e, kvh, hd, g = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
    rows = {"q": (0, g), "k": g, "v": g + 1}
    qkv = Spec((e, kvh, g + 2, hd), (EMBED, KV_HEADS, None, HEAD_DIM),
               parts=tuple(Part(prefix + n, slot(4, {2: r})) for n, r in rows.items()))
    bias = None
    if cfg.attention_bias:
        bias = Spec((kvh, g + 2, hd), (KV_HEADS, None, HEAD_DIM),
                    parts=tuple(Part(f"{prefix}{n}_bias", slot(3, {1: r})) for n, r in rows.items()))
    return qkv, bias


def gate_up_spec(cfg: ModelConfig, prefix: str) -> Spec:
    """The fused `gate_up` [embed, 2, mlp] made of the sources `{prefix}gate` and `up`."""
    e, m = cfg.hidden_size, cfg.intermediate_size
    return Spec((e, 2, m), (EMBED, None, MLP), parts=(Part(prefix + "gate", slot(3, {1: 0})),
                                                      Part(prefix + "up", slot(3, {1: 1}))))


def model_specs(cfg: ModelConfig, tp: int = 1) -> ModelParams:
    """The target's decoding layout at tensor parallelism `tp`: gate/up as one `gate_up`, and
    q/k/v as one `qkv` where `can_fuse` (else q, k and v apart, as checkpoints store them).

    Same values as the separate weights, one GEMM where there were three (and two). At
    Qwen3-8B's shape on an H200, XLA ran the k and v projections of a 272-row tree as split-K
    GEMMs whose float32 partials cost more than the products.
    """
    sources = checkpoint_specs(cfg)
    fuse_qkv = can_fuse(cfg, tp)
    layers = []
    for i, sep in enumerate(sources.layers):
        attn = sep.attn
        if fuse_qkv:
            qkv, qkv_bias = qkv_spec(cfg, f"layers.{i}.attn.")
            attn = AttentionParams(o=attn.o, q_norm=attn.q_norm, k_norm=attn.k_norm, o_bias=attn.o_bias, qkv=qkv,
                                   qkv_bias=qkv_bias)
        mlp_ = MLPParams(gate_up=gate_up_spec(cfg, f"layers.{i}.mlp."), down=sep.mlp.down)
        layers.append(dataclasses.replace(sep, attn=attn, mlp=mlp_))
    return dataclasses.replace(sources, layers=tuple(layers))


def param_layout(cfg: ModelConfig, tp: int = 1) -> ParamLayout:
    """`model_specs(cfg, tp)` over `checkpoint_specs(cfg)`: what the loaders fill."""
    return ParamLayout(model_specs(cfg, tp), checkpoint_specs(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, *, mesh: Any = None) -> ModelParams:
    """Random weights in the decoding layout (tests and benchmarks), drawn straight into their
    tensor-parallel shards when a ("dp", "tp") `mesh` is given."""
    tp = mesh_sizes(mesh)[1] if mesh is not None else 1
    if mesh is not None:
        check_model(cfg, tp)
    layout = param_layout(cfg, tp)
    return init_layout(layout, key, dtype, None if mesh is None else specs_shardings(layout.specs, mesh))


def is_fused(params: ModelParams) -> bool:
    return bool(params.layers) and params.layers[0].attn.qkv is not None


def can_fuse(cfg: ModelConfig, tp: int) -> bool:
    """Whether q/k/v fuse into one `qkv` at tensor parallelism `tp`: kv heads split over tp.

    When kv heads are replicated (tp a multiple of them) the q heads are split but k and v are
    not, so one weight cannot hold both. Raises like `sharding.kv_heads_sharded` when the kv
    heads fit tp neither way.
    """
    return tp == 1 or kv_heads_sharded(cfg.num_kv_heads, tp)




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
    if p.qkv is not None:
        if kv_input is not None:
            raise ValueError("project_qkv: fused qkv weights project keys and values from the query rows; "
                             "kv_input needs separate q/k/v weights")
        q, k, v = _fused_qkv(p, x)
    else:  # q apart; k and v separate or as the drafter's `kv`
        q = _dot("bse,ehd->bshd", x, p.q)
        if p.q_bias is not None:
            q = q + p.q_bias.astype(q.dtype)
        k, v = project_kv(p, x if kv_input is None else kv_input)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    # Tensor parallel: heads split over tp (no-ops without a mesh; see dflash_jax.sharding).
    kv_axes = (BATCH, None, KV_HEADS, None)
    return constrain(q, (BATCH, None, Q_HEADS, None)), constrain(k, kv_axes), constrain(v, kv_axes)


def kv_product(p: AttentionParams, x: jax.Array) -> jax.Array:
    """x [batch, n, embed] through the drafter's `kv` (bias added) -> [batch, n, kv_heads, 2, head_dim]."""
    kv = _dot("bne,ekgd->bnkgd", x, p.kv)
    return kv if p.kv_bias is None else kv + p.kv_bias.astype(kv.dtype)


def project_kv(p: AttentionParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values alone, x [batch, n, embed] -> k, v [batch, n, kv_heads, head_dim] (bias
    added, no norm), from separate k/v weights or the drafter's `kv`: `project_qkv`'s keys, and
    the drafter's context rows."""
    if p.kv is not None:
        kv = kv_product(p, x)
        return kv[:, :, :, 0], kv[:, :, :, 1]
    if p.k is None:
        raise ValueError("project_kv: needs separate k/v weights or a fused `kv`, not the target's `qkv`")
    k, v = _dot("bse,ehd->bshd", x, p.k), _dot("bse,ehd->bshd", x, p.v)
    if p.k_bias is not None:
        k, v = k + p.k_bias.astype(k.dtype), v + p.v_bias.astype(v.dtype)
    return k, v


def _qkv_product(p: AttentionParams, x: jax.Array) -> jax.Array:
    """x [batch, seq, embed] through `qkv` (bias added) -> [batch, seq, kv_heads, group + 2, head_dim].

    The result is in the activation dtype (the GEMM still accumulates in float32), so no
    float32 copy of it is written and read back.
    """
    qkv = jnp.einsum("bse,ekgd->bskgd", x, p.qkv, preferred_element_type=x.dtype)
    return qkv if p.qkv_bias is None else qkv + p.qkv_bias.astype(qkv.dtype)


def _fused_qkv(p: AttentionParams, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [batch, seq, embed] through `qkv` [embed, kv_heads, group + 2, head_dim] -> q, k, v."""
    qkv = _qkv_product(p, x)
    batch, seq, kv_heads, rows, head_dim = qkv.shape
    group = rows - 2
    q = qkv[:, :, :, :group].reshape(batch, seq, kv_heads * group, head_dim)
    return q, qkv[:, :, :, group], qkv[:, :, :, group + 1]


def epilogue_schedule(params: ModelParams, cfg: ModelConfig, batch: int, width: int, cache: KVCache,
                      dtype: Any, attn_impl: str):
    """The Hopper kernel's schedule when this forward runs `attend_fused` in every layer, else None.

    That needs the fused projections, no mesh (under tp each shard attends in a shard_map), a
    cache in the activation dtype, and a shape both kernels take.
    """
    if not is_fused(params) or mesh_sizes() != (1, 1) or cache.k[0].dtype != jnp.dtype(dtype):
        return None
    if not epilogue.applies(cfg.group_size, cfg.head_dim):
        return None
    return rows_schedule(batch, width, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache.max_len, dtype,
                         attn_impl)


def attend_fused(p: AttentionParams, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array, visible: jax.Array | None,
                 sched: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention on the fused path: the qkv product, then one kernel for its norms,
    RoPE and cache writes (`qkv_epilogue`), then the Hopper kernel on q in its row layout.

    Same values as `project_qkv` + `apply_rope` + `write_rows` + `attention`, with 8 fewer
    kernels per layer. x: [batch, W, embed] -> (attn [batch, W, q_heads, head_dim], k_cache, v_cache).
    """
    q_rows, k_cache, v_cache = epilogue.qkv_epilogue(_qkv_product(p, x), p.q_norm, p.k_norm, cos, sin, k_cache,
                                                     v_cache, starts, eps=cfg.rms_norm_eps,
                                                     padded_rows=sched.padded_rows)
    attn = tree_attention_rows(q_rows, k_cache, v_cache, starts, visible, width=x.shape[1],
                               group=cfg.group_size, sched=sched)
    return attn, k_cache, v_cache


def output_projection(p: AttentionParams, attn: jax.Array) -> jax.Array:
    """attn: [batch, seq, q_heads, head_dim] -> [batch, seq, embed]."""
    out = _row_parallel_dot("bshd,hde->bse", attn, p.o)  # row-parallel under tp: one all-reduce
    out = constrain(out, (BATCH, None, None))
    return out + p.o_bias.astype(out.dtype) if p.o_bias is not None else out


def gate_up_product(p: MLPParams, x: jax.Array) -> jax.Array:
    """x [..., embed] -> the fused product [..., 2, mlp] (gate, then up) of `gate_up`. One GEMM
    for both; like HF's bf16 Linear layers, gate and up come out rounded to the activation dtype
    (exact in float32)."""
    return jnp.einsum("...e,etm->...tm", x, p.gate_up, preferred_element_type=x.dtype)


def gated_activation(both: jax.Array, dtype: Any) -> jax.Array:
    """SiLU(gate) * up from a fused product [..., 2, mlp], in float32, rounded once to `dtype`."""
    both = both.astype(jnp.float32)
    return (jax.nn.silu(both[..., 0, :]) * both[..., 1, :]).astype(dtype)


def mlp_activation(p: MLPParams, x: jax.Array) -> jax.Array:
    """x [batch, seq, embed] -> SiLU(gate) * up [batch, seq, mlp] in x's dtype."""
    if p.gate_up is not None:
        act = gated_activation(gate_up_product(p, x), x.dtype)
    else:
        gate = jnp.einsum("bse,em->bsm", x, p.gate, preferred_element_type=jnp.float32)
        up = jnp.einsum("bse,em->bsm", x, p.up, preferred_element_type=jnp.float32)
        act = (jax.nn.silu(gate) * up).astype(x.dtype)
    return constrain(act, (BATCH, None, MLP))


def mlp(p: MLPParams, x: jax.Array) -> jax.Array:
    # Row-parallel under tp: one all-reduce.
    return constrain(_row_parallel_dot("bsm,me->bse", mlp_activation(p, x), p.down), (BATCH, None, None))


def split_k_product(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
    """x [rows, K] @ w [K, N] as `splits` products over slices of K: float32 [splits, rows, N].

    Their sum is x @ w; `residual_norm` adds them up on the way into the residual stream.
    """
    rows, k = x.shape
    xs = x.reshape(rows, splits, k // splits)
    ws = w.reshape(splits, k // splits, w.shape[-1])
    return jnp.einsum("rsk,skn->srn", xs, ws, preferred_element_type=jnp.float32)


def residual_splits(params: ModelParams, cfg: ModelConfig, rows: int, sched: Any,
                    num_sms: int = 132) -> int:
    """How many K slices the o and down products take on the fused residual path; 0 where it
    does not run (it runs beside the Hopper attention kernel, so only where `sched` is set).

    At 272 rows XLA's autotuner split both products in two (their N = 4096 outputs make 64 of
    cuBLAS's 128 x 136 tiles for 132 SMs): the path asks for two slices wherever the output has
    at most half as many such tiles as there are SMs. Elsewhere it stays off: at 528 rows, one
    slice (float32 out) and the kernel took 18.55 ms a DDTree(512) round against XLA's 18.46
    on an H200.
    """
    if sched is None or params.layers[0].attn.o_bias is not None:
        return 0
    if not residual.applies(cfg.hidden_size):
        return 0
    tiles = -(-rows // 136) * -(-cfg.hidden_size // 128)
    k_dims = (cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    return 2 if 2 * tiles <= num_sms and all(k % 2 == 0 for k in k_dims) else 0


def lm_head_weight(params: ModelParams) -> jax.Array:
    """[embed, vocab]; the transposed embedding when tied."""
    return params.embed.T if params.lm_head is None else params.lm_head


def logits_from_hidden(params: ModelParams, hidden: jax.Array) -> jax.Array:
    """hidden: [..., embed] (already final-normed) -> float32 logits [..., vocab].

    The product comes out in the activation dtype (accumulated in float32) and is then cast to
    float32, as transformers' `lm_head` (a Linear in the model's dtype) rounds its logits. In
    bf16 this follows the reference's greedy choices and halves what the product writes and
    the argmax reads (257 x 151936 logits: 78 MB, not 156); float32 models are unchanged. The
    product is asked for in bf16 itself: a float32 one rounded after is a separate XLA kernel.
    """
    logits = jnp.einsum("...e,ev->...v", hidden, lm_head_weight(params).astype(hidden.dtype),
                        preferred_element_type=hidden.dtype).astype(jnp.float32)
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


def _after_attention_fused(lp: LayerParams, cfg: ModelConfig, x: jax.Array, attn: jax.Array,
                           next_norm: jax.Array, splits: int) -> tuple[jax.Array, jax.Array]:
    """`_after_attention` and the next norm (`next_norm`): each projection's split-K sum,
    residual add and norm in one `residual_norm` launch. Same values as the usual path up to the
    order of the float32 sums.
    x: [batch, W, embed] -> (x, normed x), both [batch, W, embed].
    """
    batch, width, embed = x.shape
    rows = batch * width
    interpret = jax.default_backend() != "gpu"  # the path runs on GPUs; tests drive it on CPUs
    junction = functools.partial(residual.residual_norm, eps=cfg.rms_norm_eps, interpret=interpret)
    o_parts = split_k_product(attn.reshape(rows, -1), lp.attn.o.reshape(-1, embed), splits)
    x2, h = junction(x.reshape(rows, embed), o_parts, lp.mlp_norm)
    act = mlp_activation(lp.mlp, h.reshape(batch, width, embed)).reshape(rows, -1)
    x3, h3 = junction(x2, split_k_product(act, lp.mlp.down, splits), next_norm)
    return x3.reshape(batch, width, embed), h3.reshape(batch, width, embed)


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
            return_hidden: bool = False, attn_impl: str = "auto", last_tap_pre_norm: bool = False
            ) -> ForwardOutput:
    """Runs W new tokens per sequence through the target.

    tokens, positions: [batch, W] int32. The new K/V go to cache slots
    `cache.lengths[b] .. cache.lengths[b] + W - 1`; query t sees every committed slot and
    new slot s where visible[b, t, s] (default: s <= t, i.e. causal).
    tap_layers: decoder layer ids whose outputs are returned (HF `hidden_states[id + 1]`, which
        for the last layer is the final-normed output).
    last_tap_pre_norm: the last layer's tap is its output before the final norm instead (an MTP
        head with hidden_source "pre_norm"); static, and free either way.
    logit_rows: optional [batch, R] row indices; logits are computed only for those rows.
    Where the Hopper tree-attention kernel runs (`epilogue_schedule`), each layer takes the
    fused path of `attend_fused`, and where `residual_splits` allows, the o and down products
    end in `residual_norm`: same values, fewer kernels.
    attn_impl: the attention's implementation (`impl.ATTENTION_IMPLS`).
    """
    bad = [t for t in tap_layers if not 0 <= t < cfg.num_layers]
    if bad:
        raise ValueError(f"tap_layers {bad} out of range for a {cfg.num_layers}-layer target")
    x = embed_tokens(params, tokens)
    cos, sin = rope_tables(positions, cfg.rope, cfg.head_dim)
    starts = cache.lengths
    sched = epilogue_schedule(params, cfg, tokens.shape[0], tokens.shape[1], cache, x.dtype, attn_impl)
    splits = residual_splits(params, cfg, tokens.shape[0] * tokens.shape[1], sched)
    new_k, new_v, taps = [], [], {}
    norms = [lp.attn_norm for lp in params.layers[1:]] + [params.final_norm]  # each layer's next norm
    h = rms_norm(x, params.layers[0].attn_norm, cfg.rms_norm_eps)
    for i, lp in enumerate(params.layers):
        if sched is not None:
            attn, k_buf, v_buf = attend_fused(lp.attn, cfg, h, cos, sin, cache.k[i], cache.v[i], starts, visible,
                                              sched)
        else:
            q, k, v = project_qkv(lp.attn, cfg, h)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_buf = constrain_cache(write_rows(cache.k[i], k, starts))
            v_buf = constrain_cache(write_rows(cache.v[i], v, starts))
            attn = attention(q, k_buf, v_buf, starts, visible, impl=attn_impl)  # shard_map under a mesh
        if splits:
            x, h = _after_attention_fused(lp, cfg, x, attn, norms[i], splits)
        else:
            x = _after_attention(lp, cfg, x, attn)
            h = rms_norm(x, norms[i], cfg.rms_norm_eps)
        new_k.append(k_buf)
        new_v.append(v_buf)
        if i in tap_layers:
            taps[i] = x
    hidden = h  # the last layer's output through the final norm
    if not last_tap_pre_norm:  # HF's hidden_states[-1] is the final-normed output: its meaning by default
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
forward_jit = jax.jit(forward, static_argnames=("cfg", "tap_layers", "compute_logits", "return_hidden", "attn_impl",
                                               "last_tap_pre_norm"))
