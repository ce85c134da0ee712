"""The multi-token-prediction (MTP) drafter as pure functions: Qwen3.5 / Qwen3.6's own head, or
one of the same form for a dense target.

The head (HF names `mtp.*` in Qwen3.5 / Qwen3-Next checkpoints):
  x   = fc(concat[pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(hidden_t)])   (embedding first)
  x   = one decoder layer (x) at position t, with its own one-layer KV cache
  out = norm(x);  logits = the target's LM head (out) -> the distribution of token t+2.
It shares the target's embedding and LM head. For a hybrid target the layer is a gated
full-attention layer like the target's own attention layers and every norm is zero-centred
(1 + w); for a dense target it is a layer of the target's kind (plain w * x norms).

Which hidden state (`MTPConfig.hidden_source`):
- "post_norm": hidden_t is the target's last hidden state after its final norm (the input of
  its LM head). vLLM runs Qwen3-Next / Qwen3.5 MTP heads (qwen3_next_mtp.py) on the hidden states
  the target model's forward returns, and that forward (Qwen3NextModel) ends in the final norm;
  its chained steps feed the head's own returned state, which is after `mtp.norm`. So
  Qwen3.5 / Qwen3.6 checkpoints get "post_norm": it is how the heads are served, and a head
  served so is what published acceptance figures measure.
- "pre_norm": the residual stream before the final norm, which mlx-lm's Qwen3.5 MTP port feeds
  its head (and how descriptions of MTP training, DeepSeek-V3's among them, read); chained steps
  feed the head's layer output before `mtp.norm`. With it the targets' prefill and verify return
  the last layer's state before the final norm (`last_tap_pre_norm`, asked for by
  `speculative.taps_pre_norm`).
Public sources disagree, hence the setting; the τ of a checkpoint's head under each is a GPU
measurement still to make.

Chained drafting of k tokens (`draft_chain`): step 1 is position L - 1 with the target's hidden
state there (kept in `MTPCache.hidden`) and the root (token L); step j > 1 is position L + j - 2
with step j-1's own output state and its drafted token. Step j's logits are the distribution of
the token at depth j. The draft's K/V land in scratch slots.

The cache after a round (`commit`): an entry t is made from the TARGET's hidden state at t and
token t + 1, as vLLM's proposer does (it runs the head over the accepted tokens with the verify's
hidden states), so the draft's own entries (made from the head's states) are never kept. vLLM
folds that pass into the next round's first draft step; here it is the commit's own pass, so that
a round leaves the cache complete. After the target accepts m drafted tokens, `commit` recomputes the
m + 1 entries at positions L - 1 .. L + m - 1 from the target's hidden states (the carried one at
L - 1, then the verify's states of the path nodes 0..m-1) and the path's tokens (root, d_1..d_m),
over a fixed bs rows (rows past m + 1 land in scratch slots), and carries the hidden state of the
last accepted node for the next round. Invariant: `MTPCache.lengths` = target length - 1.

Trees (`SpecSettings(method="mtp", budget > 0)`): step j's distribution conditions on one path
only, the top-1 (greedy) chain: the per-depth marginals along that chain, which
`tree.build_tree` turns into the best-`budget` tree. This is how MTP trees are built in practice;
the verify and the walk are DDTree's, so the output stays lossless whatever the tree.

Tensor parallelism: the head is laid out by the target's rule table (`mtp_specs`' logical axes;
`init_mtp_params(mesh=)`, `convert.mtp.load_mtp(mesh=)`), its cache like the target's KV cache,
and its attention runs per (dp, tp) shard (`sharding.attention`), so one SPMD program drafts,
verifies and commits under a mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax import model as dense
from dflash_jax import qwen3_5
from dflash_jax.config import ModelConfig
from dflash_jax.kv_cache import gather_rows, write_rows
from dflash_jax.params import EMBED, MLP, Spec, init_from_specs
from dflash_jax.qwen3_5 import Qwen35Config
from dflash_jax.rope import apply_rope, rope_tables
from dflash_jax.sampling import SamplingParams, sample_from_probs, sampling_probs
from dflash_jax.sharding import (BATCH, ShardingError, attention, check_model, constrain, constrain_cache, mesh_sizes,
                                 specs_shardings)

HIDDEN_SOURCES = ("pre_norm", "post_norm")


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """The MTP head's settings (static).

    target: the target's config (the head's layer is of its kind, its sizes are the target's).
    hidden_source: "post_norm" (Qwen3.5 / Qwen3.6: the target's state after its final norm) or
        "pre_norm" (before it); see the module docstring.
    """

    target: ModelConfig | Qwen35Config
    hidden_source: str = "post_norm"

    def __post_init__(self) -> None:
        is_hybrid(self.target)
        if self.hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_source must be one of {HIDDEN_SOURCES}, got {self.hidden_source!r}")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layer whose output the verify returns for the head: the last one."""
        return (self.target.num_layers - 1,)

    @property
    def max_position_embeddings(self) -> int:
        return self.target.max_position_embeddings


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPParams:
    """norm_embed, norm_hidden, final_norm: [embed] (zero-centred for a hybrid target).
    fc: [2, embed, embed]: input half (0: the embedding, 1: the hidden state), in, out.
    layer: a hybrid target's (qwen3_5.LayerCommon, qwen3_5.AttnMixer), one layer's as the target's own,
        or a dense target's model.LayerParams in checkpoint layout (q, k, v, gate, up apart).
    """

    norm_embed: Any
    norm_hidden: Any
    fc: Any
    layer: Any
    final_norm: Any


def is_hybrid(target_cfg: ModelConfig | Qwen35Config) -> bool:
    if isinstance(target_cfg, Qwen35Config):
        return True
    if isinstance(target_cfg, ModelConfig):
        return False
    raise ValueError(f"target_cfg must be a ModelConfig or a Qwen35Config, got {type(target_cfg).__name__}")


def mtp_specs(target_cfg: ModelConfig | Qwen35Config) -> MTPParams:
    """Every weight of the head for this target, with its shape and logical axes.

    The axes are the target layers' own, so under tensor parallelism (`sharding.TENSOR_PARALLEL`)
    the head's attention and MLP split like a target layer (q heads, kv heads and the MLP over
    tp; kv heads replicated where tp is a multiple of them), and fc and the norms, which map the
    residual stream (axis `embed`, which the rules leave whole) to itself, are replicated like
    the target's norms."""
    e = target_cfg.hidden_size
    if is_hybrid(target_cfg):
        norm = "zeros"  # zero-centred: (1 + w)
        full = qwen3_5.model_specs(dataclasses.replace(target_cfg, layer_types=("full_attention",)))
        layer = (full.layers[0], full.attn[0])
    else:
        norm = "ones"
        m = target_cfg.intermediate_size
        layer = dense.LayerParams(
            attn_norm=Spec((e,), (EMBED,), init="ones"), attn=dense.attention_specs(target_cfg),
            mlp_norm=Spec((e,), (EMBED,), init="ones"),
            mlp=dense.MLPParams(gate=Spec((e, m), (EMBED, MLP), fan_in=e), up=Spec((e, m), (EMBED, MLP), fan_in=e),
                                down=Spec((m, e), (MLP, EMBED), fan_in=m)))
    return MTPParams(norm_embed=Spec((e,), (EMBED,), init=norm), norm_hidden=Spec((e,), (EMBED,), init=norm),
                     fc=Spec((2, e, e), (None, None, EMBED), fan_in=2 * e), layer=layer,
                     final_norm=Spec((e,), (EMBED,), init=norm))


def check_tp(target_cfg: ModelConfig | Qwen35Config, tp: int) -> None:
    """Raises a ShardingError naming the numbers when the head of this target cannot be split over
    `tp` devices (q heads and the MLP must divide by tp; kv heads must divide by tp or divide tp)."""
    try:
        check_model(target_cfg, tp)
    except ShardingError as err:
        raise ShardingError(f"the MTP head at tp={tp}: {err}") from None


def mtp_shardings(target_cfg: ModelConfig | Qwen35Config, mesh: Any) -> MTPParams:
    """NamedShardings of the head's weights on a ("dp", "tp") mesh: `mtp_specs` through the rule table."""
    check_tp(target_cfg, mesh_sizes(mesh)[1])
    return specs_shardings(mtp_specs(target_cfg), mesh)


def init_mtp_params(target_cfg: ModelConfig | Qwen35Config, key: jax.Array, dtype: Any = jnp.float32, *,
                    mesh: Any = None) -> MTPParams:
    """A random head (tests, benchmarks, and training from scratch; real ones come from `convert.mtp`),
    drawn straight into its tensor-parallel shards when a ("dp", "tp") `mesh` is given (same values)."""
    shardings = None if mesh is None else mtp_shardings(target_cfg, mesh)
    return init_from_specs(mtp_specs(target_cfg), key, dtype, shardings=shardings)


def head_from_target(target: Any, target_cfg: ModelConfig | Qwen35Config, key: jax.Array,
                     dtype: Any = jnp.float32) -> MTPParams:
    """A head to train from: its decoder layer a copy of the target's last layer (a common start
    for MTP heads: that layer already maps the last states towards the LM head), fc random and
    the norms at identity. A dense target's fused qkv / gate_up are split into the checkpoint
    layout the head keeps; a hybrid target's last layer must be a full-attention layer."""
    mp = init_mtp_params(target_cfg, key, dtype)
    if is_hybrid(target_cfg):
        if target_cfg.layer_types[-1] != "full_attention":
            raise ValueError(f"init from the target's last layer: layer {target_cfg.num_layers - 1} is "
                             f"{target_cfg.layer_types[-1]!r}, the head's layer is full attention; init it randomly "
                             f"(train --mtp-init random)")
        layer = (target.layers[-1], target.attn[-1])
    else:
        last = target.layers[-1]
        attn, mlp = last.attn, last.mlp
        if attn.qkv is not None:  # [embed, kv_heads, group + 2, head_dim]: per kv head its q heads, k, v
            e, kvh, rows, hd = attn.qkv.shape
            group = rows - 2
            q = attn.qkv[:, :, :group].reshape(e, kvh * group, hd)
            attn = dataclasses.replace(attn, q=q, k=attn.qkv[:, :, group], v=attn.qkv[:, :, group + 1], qkv=None)
            if attn.qkv_bias is not None:  # [kv_heads, group + 2, head_dim], the same rows
                b = attn.qkv_bias
                attn = dataclasses.replace(attn, q_bias=b[:, :group].reshape(kvh * group, hd), k_bias=b[:, group],
                                           v_bias=b[:, group + 1], qkv_bias=None)
        if attn.kv is not None:
            attn = dataclasses.replace(attn, k=attn.kv[:, :, 0], v=attn.kv[:, :, 1], kv=None)
            if attn.kv_bias is not None:
                attn = dataclasses.replace(attn, k_bias=attn.kv_bias[:, 0], v_bias=attn.kv_bias[:, 1], kv_bias=None)
        if mlp.gate_up is not None:
            mlp = dataclasses.replace(mlp, gate=mlp.gate_up[:, 0], up=mlp.gate_up[:, 1], gate_up=None)
        layer = dataclasses.replace(last, attn=attn, mlp=mlp)
    layer = jax.tree.map(lambda want, have: jnp.asarray(have, dtype).reshape(want.shape), mp.layer, layer)
    return dataclasses.replace(mp, layer=layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPCache:
    """k, v: [batch, max_len, kv_heads, head_dim], the head's own layer; slots >= lengths are scratch.
    lengths: [batch] entries committed (= the target's committed length - 1).
    hidden: [batch, embed], the target's hidden state at position `lengths` (pairs with the root).
    Under a mesh k and v are laid out like the target's KV cache (kv heads over tp, sequences
    over dp) and hidden like its residual stream (sequences over dp, replicated over tp).
    """

    k: Any
    v: Any
    lengths: Any
    hidden: Any

    @classmethod
    def create(cls, target_cfg: ModelConfig | Qwen35Config, batch: int, max_len: int, dtype: Any = jnp.float32
               ) -> "MTPCache":
        shape = (batch, max_len, target_cfg.num_kv_heads, target_cfg.head_dim)
        return cls(k=constrain_cache(jnp.zeros(shape, dtype)), v=constrain_cache(jnp.zeros(shape, dtype)),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   hidden=constrain(jnp.zeros((batch, target_cfg.hidden_size), dtype), (BATCH, None)))


# ----------------------------------------------------------------------------- forward

def _norm(target_cfg: ModelConfig | Qwen35Config, x: jax.Array, w: jax.Array) -> jax.Array:
    if is_hybrid(target_cfg):
        return qwen3_5.zero_centred_rms_norm(x, w, target_cfg.rms_norm_eps)
    return dense.rms_norm(x, w, target_cfg.rms_norm_eps)


def _layer(mp: MTPParams, target_cfg: ModelConfig | Qwen35Config, x: jax.Array, positions: jax.Array,
           k_buf: jax.Array, v_buf: jax.Array, starts: jax.Array, attn_impl: str,
           visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The head's decoder layer over x [B, T, embed] at positions [B, T], over its cache (slots <
    starts) and the T new rows (causal, or as visible [B, T, T]); the T new K/V go to slots
    starts .. starts + T - 1. Returns (x, k_buf, v_buf)."""
    if is_hybrid(target_cfg):
        common, attn = mp.layer
        eps = target_cfg.rms_norm_eps
        cos, sin = rope_tables(positions, target_cfg.rope, target_cfg.rotary_dim)
        h = qwen3_5.zero_centred_rms_norm(x, common.input_norm, eps)
        out, k_buf, v_buf = qwen3_5.attention_mixer(attn, target_cfg, h, cos, sin, k_buf, v_buf, starts, visible,
                                                    attn_impl=attn_impl)
        k_buf, v_buf = constrain_cache(k_buf), constrain_cache(v_buf)
        x = x + out
        return x + qwen3_5.mlp(common, qwen3_5.zero_centred_rms_norm(x, common.post_norm, eps)), k_buf, v_buf
    lp = mp.layer
    cos, sin = rope_tables(positions, target_cfg.rope, target_cfg.head_dim)
    q, k, v = dense.project_qkv(lp.attn, target_cfg, dense.rms_norm(x, lp.attn_norm, target_cfg.rms_norm_eps))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_buf, v_buf = constrain_cache(write_rows(k_buf, k, starts)), constrain_cache(write_rows(v_buf, v, starts))
    attn = attention(q, k_buf, v_buf, starts, visible, impl=attn_impl)  # per (dp, tp) shard under a mesh
    x = x + dense.output_projection(lp.attn, attn)
    return x + dense.mlp(lp.mlp, dense.rms_norm(x, lp.mlp_norm, target_cfg.rms_norm_eps)), k_buf, v_buf


def step(mp: MTPParams, mcfg: MTPConfig, target: Any, tokens: jax.Array,
         hidden: jax.Array, positions: jax.Array, k_buf: jax.Array, v_buf: jax.Array, starts: jax.Array,
         attn_impl: str = "auto", visible: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The head over T rows: tokens [B, T] (token t + 1), hidden [B, T, embed] (state at t),
    positions [B, T] (t); the rows see the cache and each other causally, or as visible [B, T, T]
    (training's chained steps). Returns (the state a next step takes [B, T, embed], the normed
    output the LM head takes [B, T, embed], k_buf, v_buf). Training passes attn_impl "reference"
    (the attention kernels have no backward pass)."""
    target_cfg = mcfg.target
    emb = _norm(target_cfg, dense.embed_tokens(target, tokens), mp.norm_embed)
    hid = _norm(target_cfg, hidden.astype(emb.dtype), mp.norm_hidden)
    x = (jnp.einsum("bte,ef->btf", emb, mp.fc[0], preferred_element_type=jnp.float32)
         + jnp.einsum("bte,ef->btf", hid, mp.fc[1], preferred_element_type=jnp.float32)).astype(emb.dtype)
    x, k_buf, v_buf = _layer(mp, target_cfg, x, positions, k_buf, v_buf, starts, attn_impl, visible)
    out = _norm(target_cfg, x, mp.final_norm)
    return (out if mcfg.hidden_source == "post_norm" else x), out, k_buf, v_buf


def logits(target: Any, target_cfg: ModelConfig | Qwen35Config, out: jax.Array) -> jax.Array:
    """The target's LM head over the head's normed output [..., embed] -> float32 [..., vocab]."""
    if is_hybrid(target_cfg):
        return qwen3_5.logits_from_hidden(target, out)
    return dense.logits_from_hidden(target, out)


def prefill(mp: MTPParams, mcfg: MTPConfig, target: Any, cache: MTPCache,
            prompts: jax.Array, prompt_lens: jax.Array, hidden: jax.Array, first: jax.Array) -> MTPCache:
    """Seeds the cache from the prompt: entries 0 .. P - 2 (state t of the target's prefill with
    token t + 1), lengths P - 1, and the carried state at P - 1 (paired with `first`, the root).

    prompts [B, W] right-padded; prompt_lens [B]; hidden [B, W, embed] the target's states;
    first [B] the first generated token."""
    batch, width = prompts.shape
    nxt = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], 1)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    starts = jnp.zeros((batch,), jnp.int32)
    _, _, k, v = step(mp, mcfg, target, nxt, hidden, positions, cache.k, cache.v, starts)
    last = (prompt_lens - 1).astype(jnp.int32)
    return MTPCache(k=k, v=v, lengths=last, hidden=gather_rows(hidden, last[:, None])[:, 0])


def draft_chain(mp: MTPParams, mcfg: MTPConfig, target: Any, cache: MTPCache, root: jax.Array, steps: int,
                key: jax.Array, sampling: SamplingParams,
                sample_chain: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """k = `steps` chained steps from the root. Each step's token is its argmax (greedy, or a tree's
    top-1 chain) or, with `sample_chain` at T > 0, a sample of its distribution.

    Returns (logits [B, k, vocab] float32, drafted tokens [B, k], the drafted tokens'
    distributions [B, k, vocab] when sampled, else None). The cache is not changed (the
    steps' K/V sit in scratch slots of a copy; `commit` writes the kept entries).
    """
    tokens, hidden, k_buf, v_buf = root, cache.hidden, cache.k, cache.v
    per_step, drafted, probs = [], [], []
    keys = jax.random.split(key, steps)
    for j in range(steps):  # k is small (1-8) and static: an unrolled loop
        pos = (cache.lengths + j)[:, None]
        nxt_hidden, out, k_buf, v_buf = step(mp, mcfg, target, tokens[:, None], hidden[:, None], pos,
                                             k_buf, v_buf, cache.lengths + j)
        lg = logits(target, mcfg.target, out[:, 0])
        if sample_chain:
            p = sampling_probs(lg, sampling)
            tok = sample_from_probs(keys[j], p)
            probs.append(p)
        else:
            tok = jnp.argmax(lg, -1).astype(jnp.int32)
        per_step.append(lg)
        drafted.append(tok)
        tokens, hidden = tok, nxt_hidden[:, 0]
    return (jnp.stack(per_step, 1), jnp.stack(drafted, 1), jnp.stack(probs, 1) if sample_chain else None)


def commit(mp: MTPParams, mcfg: MTPConfig, target: Any, cache: MTPCache,
           path_tokens: jax.Array, path_hidden: jax.Array, m: jax.Array, active: jax.Array) -> MTPCache:
    """The entries of the accepted path from the target's own states (see the module docstring).

    path_tokens [B, bs]: the tokens of the path's nodes (root, d_1, ..); path_hidden [B, bs, embed]:
    the verify's states at those nodes; m [B] accepted drafted tokens; active [B] bool (an
    inactive sequence keeps its cache). Rows m + 1 .. bs - 1 land in scratch slots.
    """
    bs = path_tokens.shape[1]
    hidden = jnp.concatenate([cache.hidden[:, None].astype(path_hidden.dtype), path_hidden[:, :-1]], 1)
    positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    _, _, k, v = step(mp, mcfg, target, path_tokens, hidden, positions, cache.k, cache.v, cache.lengths)
    last = gather_rows(path_hidden, m[:, None])[:, 0].astype(cache.hidden.dtype)
    return MTPCache(k=k, v=v, lengths=cache.lengths + jnp.where(active, m + 1, 0),
                    hidden=jnp.where(active[:, None], last, cache.hidden))
