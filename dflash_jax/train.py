"""Training DFlash drafters (the DFlash recipe, arXiv 2602.06036) with optax and orbax.

One training example is a target-generated sequence (prompt + response, `train_data`). Per
sequence the step draws `num_blocks` random anchors p inside the response and builds, for
each, the block `[token_p, MASK x (bs-1)]` at positions p .. p+bs-1: exactly what the
drafter sees at inference when the bonus token sits at position p. The block's context is
the target's tap features at positions < p. All blocks of a sequence are packed into ONE
drafter pass:

  queries  all blocks' rows                                   [batch, N*bs]
  keys     the context K/V of the whole sequence (taps -> fc -> hidden_norm -> k/v proj),
           seen by block n only at positions < anchor n,      [batch, seq_len]
           plus the query's own block's keys                   [batch, bs] per block
  mask     `packed_block_mask`: [batch, N*bs, seq_len + bs]

so blocks never see each other, and within a block attention is bidirectional (full layers)
or follows the drafter's causal/sliding-window rules (`DraftConfig.layer_causal/window`), on
absolute positions, exactly as `drafter.draft`. The layer math is `drafter.layer_forward`,
the context K/V `drafter.context_kv`, the logits `drafter.draft_logits`: the trained drafter
runs unchanged in inference (tested: one packed block == `drafter.draft`).

Loss: cross-entropy on block rows k = 1..bs-1 against the response tokens at p+k, weighted
by exp(-(k-1)/gamma) (gamma 7 for bs 16), rows past the end of the response masked. The
target's embedding and LM head are frozen (they are not in the trained pytree: only
`DraftParams` is). Master weights are float32; the loss casts them to `compute_dtype`
(bfloat16 on GPU). Target taps are computed on the fly, see `train_data`'s docstring, by a
dense target (Qwen3, Llama) or a Qwen3.5 / Qwen3.6 hybrid alike (`target_taps`), or written
once to disk (`write_taps`, `dflash-jax make-taps`) and read back with each batch
(`TappedSequences`, `train --taps`): bytes on disk per token against the target's forward per
step (`bench/train_step.py` measures both).

MTP heads (`train` with an `mtp.MTPConfig` for dcfg, `dflash-jax train --drafter-kind mtp`): the
same data, optimizer, schedule, validation, checkpoints and record; only the loss differs
(`mtp_scores`). For every position t of a response the head takes [embed(token t+1), the target's
last state at t] and predicts token t+2, its one attention layer causal over the whole sequence:
at inference the head's cache holds exactly such entries (made from the target's states) and its
first chained step is the row at the last committed position, so one causal pass over a sequence
is the first draft step at every position at once (tested against `mtp.step`). With
`TrainConfig.mtp_steps` k > 1 the head also learns chained steps 2..k (step j from step j-1's
own state and the data's token, teacher-forced), each pass seeing what the inference chain sees
(`chained_visibility`). "Blocks" in the metrics are positions: acc_by_pos has k entries and
tau_estimate = 1 + the leading correct steps, the expected tokens a round of a k-step chain
commits. The export is `convert.mtp.export_mtp` (out_dir/mtp/), what
`bench --mtp-head` loads.

Data and tensor parallelism (`train(..., dp=N, tp=T)`, `dflash-jax train --dp N --tp T`): one
SPMD program over a ("dp", "tp") = (N, T) mesh, each "tp" group of T devices inside one process
(host). Each step's global batch of `batch_size` rows is split over "dp" on its leading axis;
the frozen target is split over "tp" with the decoding side's tensor-parallel layout (heads, MLP
and vocabulary; `place_target`), so a target too large for one device fits a host; the float32
masters and the AdamW state are replicated. Each dp group computes the gradient and metric sums
of its rows (the target's tp collectives inside, placed by XLA) and the groups' sums are added
in a fixed order (`data_parallel_sums`). The anchors are drawn from the same key over the global
[batch, seq_len] shape (threefry bits do not depend on the sharding), so dp = N, tp = T trains
the same drafter as one device up to float32 summation order.
Checkpoints hold whole (replicated) arrays: a run may be resumed with another dp or tp.

Multi-process (`dflash_jax.distributed`, BUILD.md's multi-host recipe): the mesh spans every
device of every process, each process loads only its rows of each batch (`load_batch`), and
process 0 alone writes the log, the run record, plots and the export; all of them take part in
orbax's checkpoint saves and restores. The fixed summation order makes a run over the same
devices bitwise equal whether they sit in one process or several, and a checkpoint resumes
with another process count.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import distributed as dist
from dflash_jax import drafter as dr
from dflash_jax import mtp
from dflash_jax import sharding as sh
from dflash_jax.config import ModelConfig, default_tap_layers
from dflash_jax.files import atomic_write_text, bounded, check_writable
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import ModelParams, checkpoint_specs, forward, model_specs, rms_norm
from dflash_jax.params import cast_floating, is_spec
from dflash_jax.qwen3_5 import HybridCache, Qwen35Config, Qwen35Params
from dflash_jax.qwen3_5 import check_tp as qwen35_check_tp
from dflash_jax.qwen3_5 import forward as qwen35_forward
from dflash_jax.qwen3_5 import model_specs as qwen35_model_specs
from dflash_jax.rope import rope_tables
from dflash_jax.speculative import HYBRID, target_family, taps_pre_norm

# A frozen target is dense (Qwen3, Llama) or a Qwen3.5 / Qwen3.6 hybrid; only `target_taps` tells them apart.
TargetConfig = ModelConfig | Qwen35Config
TargetParams = ModelParams | Qwen35Params
# What a run trains: a DFlash drafter, or an MTP head (the module docstring's "MTP heads").
DrafterConfig = dr.DraftConfig | mtp.MTPConfig
DrafterParams = dr.DraftParams | mtp.MTPParams  # the weights of the kind its DrafterConfig names
from dflash_jax.train_data import SequenceSet, TapStore, batch_indices, split_by_prompt

# Token texts tried, in order, for the drafter's MASK token (the target's embedding of it is used).
MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<empty_output>", "<filename>")


# ----------------------------------------------------------------------------- configuration

def default_gamma(block_size: int) -> float:
    """The loss-decay constant: 7 for block size 16 (the paper), scaled linearly otherwise."""
    return 7.0 * block_size / 16


LABELS = ("response", "target", "target-soft")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training settings (hashable: a jit static argument, saved beside checkpoints)."""

    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 512
    num_blocks: int = 32  # anchors (blocks) per sequence, packed into one pass
    gamma: float | None = None  # loss decay; None = default_gamma(block_size)
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 1e-4  # optax.adamw's default
    b1: float = 0.9
    b2: float = 0.999
    compute_dtype: str = "bfloat16"
    seed: int = 0  # data order and anchors
    remat: bool = False  # recompute each drafter layer in the backward pass (less memory)
    attn_impl: str = "auto"  # the target forward that computes the taps
    # What block row k (at position p+k) learns to predict: "response", the data's token at p+k
    # (the recipe); "target", the target's own greedy token after positions <= p+k-1, from the
    # same forward that makes the taps. Greedy decoding accepts a draft token iff it equals
    # that greedy token, and for responses sampled at T = 1 the two differ. "target-soft": the
    # target's whole next-token distribution there, loss KL(target || drafter) (distillation;
    # costs the target's logits at every position).
    labels: str = "response"
    # An MTP head's chained steps learned at each position (1: its first step only, as served
    # checkpoints' heads are often trained; k: also steps 2..k from its own states).
    mtp_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "num_blocks", "mtp_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.labels not in LABELS:
            raise ValueError(f"labels (--labels) must be one of {LABELS}, got {self.labels!r}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        jnp.dtype(self.compute_dtype)  # raises on an unknown dtype name

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_fraction * self.steps))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up over `warmup_fraction` of the steps to `learning_rate`, then cosine to 0."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
        decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=0.0)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the cosine schedule."""
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay))


def drafter_config_for(target: TargetConfig, *, num_layers: int = 3, block_size: int = 16,
                       mask_token_id: int, target_layer_ids: tuple[int, ...] | None = None,
                       **overrides: Any) -> dr.DraftConfig:
    """A drafter shaped like the target's layers (hidden, heads, head_dim, MLP, RoPE).

    One tap per drafter layer by default (`default_tap_layers`), as z-lab's drafters.
    """
    taps = target_layer_ids or default_tap_layers(target.num_layers, num_layers)
    fields: dict[str, Any] = dict(
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, vocab_size=target.vocab_size, mask_token_id=mask_token_id,
        target_layer_ids=tuple(taps), num_target_layers=target.num_layers, block_size=block_size,
        rms_norm_eps=target.rms_norm_eps, rope=target.rope,
        max_position_embeddings=target.max_position_embeddings)
    fields.update(overrides)
    dcfg = dr.DraftConfig(**fields)
    dr.validate_pair(dcfg, target)
    return dcfg


def drafter_from_init(path: str | Path, target: TargetConfig, *, num_layers: int | None = None,
                      block_size: int | None = None, mask_token_id: int | None = None
                      ) -> tuple[dr.DraftConfig, dr.DraftParams]:
    """A trained drafter to start a run from (`train --init`): its config and float32 weights.

    The shape comes from the drafter's config.json; a shape flag given as well must agree with it,
    and the drafter must fit the target (`validate_pair`). Raises ValueError naming the flag or field.
    """
    from convert.dflash_drafter import load_drafter
    from convert.shipped import DFLASH, resolve_shipped

    dcfg, dparams = load_drafter(resolve_shipped(path, DFLASH, "--init"), dtype=jnp.float32, training=True)
    for flag, given, have in (("--layers", num_layers, dcfg.num_layers), ("--block-size", block_size, dcfg.block_size),
                              ("--mask-token-id", mask_token_id, dcfg.mask_token_id)):
        if given is not None and given != have:
            raise ValueError(f"{flag} {given} disagrees with the --init drafter {path} ({have}); "
                             f"leave it out to train the drafter's own shape")
    try:
        dr.validate_pair(dcfg, target)
    except ValueError as err:
        raise ValueError(f"--init drafter {path} does not fit the target: {err}") from err
    return dcfg, dparams


def init_record(path: str | Path) -> dict[str, str]:
    """What train_run.json records of an `--init` drafter: the name given, its directory, and the
    sha256 of its weights (a shipped name such as "smollm2" points at whatever is shipped now)."""
    import hashlib

    from convert.dflash_drafter import WEIGHTS_FILE
    from convert.shipped import DFLASH, resolve_shipped

    directory = resolve_shipped(path, DFLASH, "--init")
    digest = hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()
    return {"drafter": str(path), "path": str(directory.absolute()), "weights_sha256": digest}


def choose_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """A token id for MASK: a dedicated mask token if the tokenizer has one, else a special token
    that chat never produces, else the last id of the vocabulary."""
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        for text in MASK_TOKEN_CANDIDATES:
            if text in vocab and vocab[text] < vocab_size:
                return int(vocab[text])
    return vocab_size - 1


# ----------------------------------------------------------------------------- the packed pass

def target_taps(target: TargetParams, cfg: TargetConfig, tokens: jax.Array, tap_layers: tuple[int, ...],
                attn_impl: str = "auto", *, labels: str = "response", last_pre_norm: bool = False
                ) -> tuple[jax.Array, jax.Array | None]:
    """The target's tap features of every position, and what `labels` needs from the target.

    tokens [batch, T] -> (taps [batch, T, taps*embed], source), where source is None for
    "response"; for "target", greedy [batch, T] int32, greedy[t] the target's argmax after
    positions <= t; for "target-soft", the logits [batch, T, vocab] behind that argmax. One
    causal target forward, dense or hybrid (`speculative.target_family` picks by the config;
    `attn_impl` is the attention's implementation for either);
    the LM head runs only for target labels. Constant for the drafter (stop_gradient).
    last_pre_norm: the last layer's tap before the final norm (an MTP head's "pre_norm").
    """
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    compute_logits = labels != "response"
    if target_family(cfg) is HYBRID:
        cache = HybridCache.create(cfg, batch, seq, target.embed.dtype)
        out = qwen35_forward(target, cfg, tokens, positions, cache, tap_layers=tuple(tap_layers),
                             compute_logits=compute_logits, attn_impl=attn_impl, last_tap_pre_norm=last_pre_norm)
    else:
        cache = KVCache.create(cfg.num_layers, batch, seq, cfg.num_kv_heads, cfg.head_dim, target.embed.dtype)
        out = forward(target, cfg, tokens, positions, cache, None, tap_layers=tuple(tap_layers),
                      compute_logits=compute_logits, attn_impl=attn_impl, last_tap_pre_norm=last_pre_norm)
    source = None
    if labels == "target":
        source = jnp.argmax(out.logits, -1).astype(jnp.int32)
    elif labels == "target-soft":
        source = jax.lax.stop_gradient(out.logits.astype(target.embed.dtype))
    return jax.lax.stop_gradient(out.taps), source


def sample_anchors(key: jax.Array, prompt_lens: jax.Array, total_lens: jax.Array, seq_len: int,
                   num_blocks: int) -> tuple[jax.Array, jax.Array]:
    """Random anchors inside each response, without replacement -> (anchors [B, N], valid [B, N]).

    An anchor p is a response position with a next token: prompt_len <= p <= total_len - 2.
    Valid anchors come first, ascending; when a response has fewer than N such positions the
    rest are invalid (placed at the first response position, excluded from the loss).
    """
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None]
    allowed = (pos >= prompt_lens[:, None]) & (pos <= total_lens[:, None] - 2)
    scores = jnp.where(allowed, jax.random.uniform(key, allowed.shape), -1.0)
    top, idx = jax.lax.top_k(scores, num_blocks)
    valid = top >= 0.0
    fallback = jnp.clip(prompt_lens, 0, seq_len - 1)[:, None]
    anchors = jnp.where(valid, idx.astype(jnp.int32), fallback)
    order = jnp.argsort(jnp.where(valid, anchors, seq_len + anchors), axis=1)
    return jnp.take_along_axis(anchors, order, 1), jnp.take_along_axis(valid, order, 1)


def packed_block_mask(anchors: jax.Array, seq_len: int, block_size: int, *, causal: bool = False,
                      window: int | None = None) -> jax.Array:
    """Visibility of the packed pass: [batch, N*bs, seq_len + bs] bool.

    Row n*bs + j is block n's row j (absolute position anchors[n] + j). Column t < seq_len is
    the context key at position t: visible iff t < anchors[n] (and, in a sliding layer,
    within `window` of the query's position). Column seq_len + i is key i of the row's OWN
    block: visible always (bidirectional), iff i <= j when `causal`, and within `window`.
    Other blocks are never visible. These are `drafter.draft`'s rules for one block whose
    committed context is positions < anchor.
    """
    batch, n = anchors.shape
    j = jnp.arange(block_size, dtype=jnp.int32)
    q_pos = anchors[:, :, None] + j  # [B, N, bs]
    t = jnp.arange(seq_len, dtype=jnp.int32)
    ctx = t[None, None, None, :] < anchors[:, :, None, None]  # [B, N, 1, T]
    ctx = jnp.broadcast_to(ctx, (batch, n, block_size, seq_len))
    if window is not None:
        # Context keys precede every query of the block, so only the backward window matters.
        ctx = ctx & (q_pos[..., None] - t < window)
    own = jnp.ones((block_size, block_size), bool)
    if causal:
        own = own & (j[None, :] <= j[:, None])
    if window is not None:
        own = own & (jnp.abs(j[:, None] - j[None, :]) < window)
    own = jnp.broadcast_to(own, (batch, n, block_size, block_size))
    return jnp.concatenate([ctx, own], axis=-1).reshape(batch, n * block_size, seq_len + block_size)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array,
                     visible: jax.Array, block_size: int) -> jax.Array:
    """Masked softmax attention of packed block rows (float32 scores and softmax).

    q: [B, N*bs, q_heads, hd]; k, v: the rows' own keys/values [B, N*bs, kv_heads, hd];
    k_ctx, v_ctx: context [B, T, kv_heads, hd]; visible: `packed_block_mask` [B, N*bs, T + bs].
    Block keys are contracted per block ([bs, bs]), not against every block's keys.
    """
    batch, rows, q_heads, hd = q.shape
    kv_heads, seq = k.shape[2], k_ctx.shape[1]
    group, n = q_heads // kv_heads, rows // block_size
    f32 = jnp.float32
    qg = q.reshape(batch, rows, kv_heads, group, hd)
    s_ctx = jnp.einsum("bqkgd,btkd->bkgqt", qg, k_ctx.astype(q.dtype), preferred_element_type=f32)
    qb = q.reshape(batch, n, block_size, kv_heads, group, hd)
    kb = k.reshape(batch, n, block_size, kv_heads, hd)
    s_own = jnp.einsum("bnjkgd,bnikd->bkgnji", qb, kb, preferred_element_type=f32)
    s_own = s_own.reshape(batch, kv_heads, group, rows, block_size)
    scores = jnp.concatenate([s_ctx, s_own], axis=-1) * hd ** -0.5
    seen = visible[:, None, None]
    scores = jnp.where(seen, scores, -jnp.inf)
    # Every row sees at least its own root key, so the max is finite.
    weights = jnp.where(seen, jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), 0.0)
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(q.dtype)
    out = jnp.einsum("bkgqt,btkd->bqkgd", weights[..., :seq], v_ctx.astype(q.dtype),
                     preferred_element_type=f32)
    w_own = weights[..., seq:].reshape(batch, kv_heads, group, n, block_size, block_size)
    vb = v.reshape(batch, n, block_size, kv_heads, hd)
    out = out + jnp.einsum("bkgnji,bnikd->bnjkgd", w_own, vb,
                           preferred_element_type=f32).reshape(batch, rows, kv_heads, group, hd)
    return out.reshape(batch, rows, q_heads, hd).astype(q.dtype)


def block_tokens(tokens: jax.Array, anchors: jax.Array, dcfg: dr.DraftConfig) -> jax.Array:
    """[B, N, bs] = [token at the anchor, MASK x (bs-1)] per block."""
    roots = jnp.take_along_axis(tokens, anchors, 1)
    return jnp.concatenate([roots[..., None], jnp.full(roots.shape + (dcfg.block_size - 1,),
                                                       dcfg.mask_token_id, tokens.dtype)], -1)


def packed_forward(dparams: dr.DraftParams, dcfg: dr.DraftConfig, target: TargetParams, taps: jax.Array,
                   tokens: jax.Array, anchors: jax.Array, *, remat: bool = False) -> jax.Array:
    """The drafter over all blocks of every sequence in one pass -> final-normed hidden [B, N, bs, embed].

    taps: [B, T, taps*embed] target features; tokens: [B, T]; anchors: [B, N] (block n sits at
    positions anchors[n] .. anchors[n]+bs-1 and sees context positions < anchors[n]).
    """
    batch, seq = tokens.shape
    n, bs = anchors.shape[1], dcfg.block_size
    ks, vs = dr.context_kv(dparams, dcfg, taps,
                           jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)))
    x = dr.embed_block(target, dcfg, block_tokens(tokens, anchors, dcfg)).reshape(batch, n * bs, -1)
    positions = (anchors[:, :, None] + jnp.arange(bs, dtype=jnp.int32)).reshape(batch, n * bs)
    cos, sin = rope_tables(positions, dcfg.rope, dcfg.head_dim)
    masks: dict[tuple[bool, int | None], jax.Array] = {}
    for i, lp in enumerate(dparams.layers):
        rule = (dcfg.layer_causal(i), dcfg.layer_window(i))
        if rule not in masks:
            masks[rule] = packed_block_mask(anchors, seq, bs, causal=rule[0], window=rule[1])

        def layer(lp, x, cos, sin, k_ctx, v_ctx, mask):
            attend = lambda q, k, v: packed_attention(q, k, v, k_ctx, v_ctx, mask, bs)  # noqa: E731
            return dr.layer_forward(lp, dcfg, x, cos, sin, attend)

        x = (jax.checkpoint(layer) if remat else layer)(lp, x, cos, sin, ks[i], vs[i], masks[rule])
    hidden = rms_norm(x, dparams.final_norm, dcfg.rms_norm_eps)
    return hidden.reshape(batch, n, bs, -1)


def block_targets(tokens: jax.Array, anchors: jax.Array, valid: jax.Array, total_lens: jax.Array,
                  block_size: int, greedy: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Targets of block rows 1..bs-1 and their mask [B, N, bs-1].

    Row k of the block at anchor p: the response token at p+k, or with `greedy` [B, T] (the
    target's argmax after each position) greedy[p+k-1]. Rows at or past the response's end
    are masked either way.
    """
    seq = tokens.shape[1]
    pos = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)
    source, at = (tokens, pos) if greedy is None else (greedy, pos - 1)
    targets = jnp.take_along_axis(source, jnp.clip(at, 0, seq - 1).reshape(tokens.shape[0], -1), 1)
    mask = valid[:, :, None] & (pos < total_lens[:, None, None])
    return targets.reshape(pos.shape), mask


def block_rows(per_position: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """[B, T, ...] values at positions p+k-1 for block rows k = 1..bs-1 -> [B, N, bs-1, ...].

    Row k of the block at anchor p predicts the token at p+k, so the target's prediction for it
    sits at position p+k-1 (as `block_targets` takes greedy[p+k-1]).
    """
    b, seq = per_position.shape[:2]
    at = jnp.clip(anchors[:, :, None] + jnp.arange(block_size - 1, dtype=jnp.int32), 0, seq - 1)
    flat = at.reshape(b, -1).reshape((b, -1) + (1,) * (per_position.ndim - 2))
    rows = jnp.take_along_axis(per_position, flat, axis=1)
    return rows.reshape(at.shape + per_position.shape[2:])


def soft_label_kl(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """KL(target || drafter) per row, in float32: [..., vocab] x 2 -> [...].

    Its gradient is that of the cross-entropy against the target's distribution; the target's
    entropy is subtracted so that a drafter matching the target scores 0.
    """
    log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32), -1)
    log_p = jax.nn.log_softmax(target_logits.astype(jnp.float32), -1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """exp(-(k-1)/gamma) for block rows k = 1..bs-1: early rows matter most (they gate acceptance)."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def block_scores(dparams: DrafterParams, target: TargetParams, taps: jax.Array, batch: dict[str, jax.Array],
                 key: jax.Array | None, *, dcfg: DrafterConfig, tc: TrainConfig,
                 source: jax.Array | None = None, anchors: tuple[jax.Array, jax.Array] | None = None
                 ) -> dict[str, jax.Array]:
    """Per block row: cross-entropy, loss weight, mask and correctness, per block: valid and chain run.

    dparams: a DFlash drafter's DraftParams (dcfg a DraftConfig) or an MTP head's MTPParams (dcfg
    an MTPConfig: `mtp_scores`, which takes neither `key` nor `anchors`), float32 masters, cast
    here. A DFlash drafter's anchors are drawn with `key`, or given as `anchors` = (anchors,
    valid) [B, N] (`sample_anchors` over the global batch). `source`: what
    `target_taps` gives for tc.labels (greedy tokens [B, T], or logits [B, T, vocab] for
    "target-soft"). Keys: ce (for "target-soft", KL(target || drafter)), w (position weight x
    mask), m (mask, float), correct [B, N, bs-1] (against the target's greedy token for target
    labels); valid, run [B, N] (run = leading correct rows of the block: the greedy chain's
    accepted draft tokens).
    """
    if isinstance(dcfg, mtp.MTPConfig):
        return mtp_scores(dparams, target, taps, batch, mcfg=dcfg, tc=tc, source=source)
    tokens, prompt_lens, total_lens = batch["tokens"], batch["prompt_lens"], batch["total_lens"]
    bs = dcfg.block_size
    params = cast_floating(dparams, jnp.dtype(tc.compute_dtype))
    anchors, valid = anchors or sample_anchors(key, prompt_lens, total_lens, tokens.shape[1], tc.num_blocks)
    hidden = packed_forward(params, dcfg, target, taps, tokens, anchors, remat=tc.remat)
    b, n = anchors.shape
    logits = dr.draft_logits(params, dcfg, target, hidden.reshape(b * n, bs, -1)).reshape(b, n, bs - 1, -1)
    soft = tc.labels == "target-soft"
    greedy = jnp.argmax(source, -1).astype(jnp.int32) if soft else source
    targets, mask = block_targets(tokens, anchors, valid, total_lens, bs, greedy)
    if soft:
        ce = soft_label_kl(logits, block_rows(source, anchors, bs))
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    m = mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == targets) & mask
    return {"ce": ce, "w": position_weights(bs, tc.gamma or default_gamma(bs)) * m, "m": m, "correct": correct,
            "valid": valid, "run": jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)}


def chained_visibility(steps: int, seq: int) -> jax.Array:
    """Which rows a pass over `steps` chained steps at every position sees: [steps*seq, steps*seq]
    bool, rows step-major (row (i-1)*seq + t is step i at position t).

    Step 1 at t sees step 1 at s <= t (the head's cache at inference: entries made from the
    target's states, and its own); step i > 1 at t sees the same, and steps 2..i at t (the
    chain's own scratch entries, made from the head's states), as `mtp.draft_chain` does."""
    idx = jnp.arange(steps * seq)
    step, pos = idx // seq, idx % seq
    cache = (step[None, :] == 0) & (pos[None, :] <= pos[:, None])
    chain = (step[None, :] > 0) & (step[None, :] <= step[:, None]) & (pos[None, :] == pos[:, None])
    return cache | chain


def mtp_packed_logits(mparams: mtp.MTPParams, mcfg: mtp.MTPConfig, target: TargetParams, taps: jax.Array,
                      tokens: jax.Array, steps: int = 1) -> jax.Array:
    """The head's first `steps` chained draft steps at every position at once -> float32 logits
    [B, T, steps, vocab].

    Step 1 at row t takes token t+1 (tokens [B, T]; rows wrap around at the end and are for no
    loss) and the target's state taps[:, t] [B, T, embed], at position t, attending to rows <= t:
    `mtp.step` over an empty cache of T slots, in mparams' dtype, with the reference attention
    (differentiable). Step i > 1 takes token t+i (the data's: teacher forcing, since a chain's
    later steps count only after its earlier ones were right) and step i-1's output state at t, at
    position t+i-1. Step i needs step i-1's states, so pass i runs steps 1..i again
    (`chained_visibility`): steps (steps + 1) / 2 times the rows of one step.
    """
    b, seq = tokens.shape
    dtype = jax.tree.leaves(mparams)[0].dtype
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    starts = jnp.zeros((b,), jnp.int32)
    states, per_step = [taps.astype(dtype)], []
    for i in range(1, steps + 1):
        rows = i * seq
        kv = jnp.zeros((b, rows, mcfg.target.num_kv_heads, mcfg.target.head_dim), dtype)
        toks = jnp.concatenate([jnp.roll(tokens, -j, 1) for j in range(1, i + 1)], axis=1)
        positions = jnp.concatenate([pos + j - 1 for j in range(1, i + 1)], axis=1)
        visible = None if i == 1 else jnp.broadcast_to(chained_visibility(i, seq), (b, rows, rows))
        nxt, out, _, _ = mtp.step(mparams, mcfg, target, toks, jnp.concatenate(states, axis=1), positions, kv, kv,
                                  starts, attn_impl="reference", visible=visible)
        states.append(nxt[:, -seq:])
        per_step.append(mtp.logits(target, mcfg.target, out[:, -seq:]))
    return jnp.stack(per_step, axis=2)


def mtp_scores(mparams: mtp.MTPParams, target: TargetParams, taps: jax.Array, batch: dict[str, jax.Array], *,
               mcfg: mtp.MTPConfig, tc: TrainConfig, source: jax.Array | None = None) -> dict[str, jax.Array]:
    """`block_scores` for an MTP head: every position t is a "block" of tc.mtp_steps rows, the
    head's chained steps there (`mtp_packed_logits`).

    taps [B, T, embed]: the target's last state (before or after its final norm, as
    mcfg.hidden_source). Step i at t predicts token t+i+1: the response's, or with target labels
    the target's greedy token / distribution after positions <= t+i. Blocks start at the last
    prompt position (the first draft step of a generation); a step counts while its token is
    inside the response. Step i's loss weight is exp(-(i-1)/gamma), gamma as a DFlash block of
    mtp_steps + 1 (`default_gamma`), so the first step, which gates the others, matters most.
    Returns the keys of `block_scores`, with a row axis of tc.mtp_steps.
    """
    tokens, prompt_lens, total_lens = batch["tokens"], batch["prompt_lens"], batch["total_lens"]
    k = tc.mtp_steps
    params = cast_floating(mparams, jnp.dtype(tc.compute_dtype))
    logits = mtp_packed_logits(params, mcfg, target, taps, tokens, k)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    ahead = jnp.arange(1, k + 1, dtype=jnp.int32)  # step i's target is at t + i + 1
    starts = positions >= prompt_lens[:, None] - 1
    mask = starts[..., None] & (positions[..., None] + ahead + 1 < total_lens[:, None, None])  # [B, T, k]
    if tc.labels == "target-soft":
        dist = jnp.stack([jnp.roll(source, -i, 1) for i in range(1, k + 1)], axis=2)  # after positions <= t+i
        targets = jnp.argmax(dist, -1).astype(jnp.int32)
        ce = soft_label_kl(logits, dist)
    else:
        shift = 1 if tc.labels == "response" else 0  # the data's token t+i+1, or the target's after t+i
        base = tokens if tc.labels == "response" else source
        targets = jnp.stack([jnp.roll(base, -(i + shift), 1) for i in range(1, k + 1)], axis=2)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    m = mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == targets) & mask
    valid = mask[..., 0]
    return {"ce": ce, "w": position_weights(k + 1, tc.gamma or default_gamma(k + 1)) * m, "m": m,
            "correct": correct, "valid": valid, "run": jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)}


def loss_fn(dparams: DrafterParams, target: TargetParams, taps: jax.Array, batch: dict[str, jax.Array],
            key: jax.Array | None, *, dcfg: DrafterConfig, tc: TrainConfig,
            source: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """Weighted block cross-entropy (or KL) and metrics of a DFlash drafter (DraftParams, its anchors
    drawn with `key`) or an MTP head (MTPParams, every position; `key` unused), as `block_scores`.
    dparams are float32 masters, cast here."""
    metrics = metrics_of(score_sums(block_scores(dparams, target, taps, batch, key, dcfg=dcfg, tc=tc, source=source)))
    return metrics["loss"], metrics


def score_sums(s: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The sums over a batch's blocks behind every metric (`block_scores` -> scalars and [bs-1] vectors).

    Sums, not means: the sums of the shards of a batch are the batch's sums.
    """
    return {"loss_sum": jnp.sum(s["ce"] * s["w"]), "weight_sum": jnp.sum(s["w"]),
            "ce_sum": jnp.sum(s["ce"] * s["m"]), "mask_sum": jnp.sum(s["m"]),
            "correct_by_pos": jnp.sum(s["correct"], (0, 1)).astype(jnp.float32),
            "tokens_by_pos": jnp.sum(s["m"], (0, 1)),
            "run_sum": jnp.sum(jnp.where(s["valid"], s["run"], 0)), "blocks": jnp.sum(s["valid"])}


def metrics_of(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """loss = sum(ce x w) / sum(w); ce per masked row; accuracy per block row; tau estimate =
    1 + leading correct rows per valid block (the mean accepted length of greedy chain drafting)."""
    return {"loss": sums["loss_sum"] / jnp.maximum(sums["weight_sum"], 1e-6),
            "ce": sums["ce_sum"] / jnp.maximum(sums["mask_sum"], 1.0),
            "acc_by_pos": sums["correct_by_pos"] / jnp.maximum(sums["tokens_by_pos"], 1.0),
            "tokens_by_pos": sums["tokens_by_pos"],
            "tau_estimate": 1.0 + sums["run_sum"] / jnp.maximum(sums["blocks"], 1),
            "blocks": sums["blocks"]}


def data_parallel_sums(fn: Any, replicated: tuple[Any, ...], split: tuple[Any, ...]) -> Any:
    """fn(*replicated, *split) -> a tree of sums over the batch rows it was given, summed over "dp".

    Under a data-parallel mesh each dp group runs `fn` on its own rows (`split`, leading axis over
    "dp"; `replicated` whole over "dp"), and the per-group sums are added in one fixed order
    (`distributed.ordered_sum`) rather than by XLA's all-reduce, whose order depends on the
    collectives' implementation: a run over 4 devices then gives the same bits in one process or
    in several. Only "dp" is manual: inside `fn` the "tp" axis stays XLA's, so a target split
    over "tp" keeps its layout and its collectives. Without a mesh: fn(*replicated, *split).
    """
    mesh = sh.active_mesh()
    dp, _ = sh.mesh_sizes(mesh)
    if mesh is None or dp == 1:
        return fn(*replicated, *split)
    P = jax.sharding.PartitionSpec

    def local(*args: Any) -> Any:
        return dist.ordered_sum(fn(*args), sh.DP, dp)

    specs = tuple(jax.tree.map(lambda _: P(), r) for r in replicated) + tuple(
        jax.tree.map(lambda x: P(sh.DP, *(None,) * (x.ndim - 1)), t) for t in split)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), axis_names=frozenset({sh.DP}),
                         check_vma=False)(*replicated, *split)


# ----------------------------------------------------------------------------- the step

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any  # DrafterParams (a DFlash drafter's or an MTP head's), float32 master weights
    opt_state: Any
    step: jax.Array  # int32 scalar: steps done
    rng: jax.Array  # uint32[2] raw key; step s draws its anchors with fold_in(rng, s) (an MTP head draws none)


def init_state(dparams: DrafterParams, tc: TrainConfig) -> TrainState:
    params = cast_floating(dparams, jnp.float32)
    return TrainState(params=params, opt_state=make_optimizer(tc).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(tc.seed))


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "tc"))
def train_step(state: TrainState, target: TargetParams, batch: dict[str, jax.Array], *, cfg: TargetConfig,
               dcfg: DrafterConfig, tc: TrainConfig) -> tuple[TrainState, dict[str, Any]]:
    """One optimiser step: target taps -> packed drafter pass -> loss -> AdamW.

    target: the frozen target, already in compute dtype (only its embedding and LM head are used
    when the taps are given); batch: tokens [B, T] int32, prompt_lens / total_lens [B] int32, and
    optionally taps [B, T, taps*embed] read back from disk (`TapStore`; "response" labels only),
    else the target computes them here. Pure: the result depends only on the arguments.
    """
    # Drawn over the global batch (threefry bits do not depend on the sharding), then split with it.
    # An MTP head scores every position and has no anchors: nothing is drawn for it.
    anchors = None if isinstance(dcfg, mtp.MTPConfig) else sample_anchors(
        jax.random.fold_in(state.rng, state.step), batch["prompt_lens"], batch["total_lens"],
        batch["tokens"].shape[1], tc.num_blocks)

    def sums_and_grads(params: Any, target: TargetParams, batch: dict[str, jax.Array], anchors: Any = None) -> Any:
        if "taps" in batch:
            taps, source = batch["taps"].astype(target.embed.dtype), None
        else:
            taps, source = target_taps(target, cfg, batch["tokens"], dcfg.target_layer_ids, tc.attn_impl,
                                       labels=tc.labels, last_pre_norm=taps_pre_norm(dcfg))

        def numerator(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            sums = score_sums(block_scores(p, target, taps, batch, None, dcfg=dcfg, tc=tc, source=source,
                                           anchors=anchors))
            return sums["loss_sum"], sums

        (_, sums), grads = jax.value_and_grad(numerator, has_aux=True)(params)
        return sums, grads

    if "taps" in batch and tc.labels != "response":
        raise ValueError(f"taps read from disk serve --labels response only; --labels {tc.labels} needs the "
                         f"target's logits, computed in the step")
    sums, grads = data_parallel_sums(sums_and_grads, (state.params, target),
                                     (batch,) if anchors is None else (batch, anchors))
    # The loss is sum(ce x w) / sum(w) over the whole batch and the weights hold no parameter.
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["weight_sum"], 1e-6), grads)
    metrics = metrics_of(sums)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = _tree_norm(grads)
    metrics["lr"] = learning_rate_schedule(tc)(state.step)
    # Under a data-parallel mesh the new state and the metrics stay whole on every device (a no-op
    # without one): every process then reads its metrics from a local copy.
    return sh.replicate((TrainState(params, opt_state, state.step + 1, state.rng), metrics))


# optax >= 0.2.5 has optax.tree.norm and deprecates optax.global_norm.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


# ----------------------------------------------------------------------------- data parallelism

def check_data_parallel(dp: int, batch_size: int, tp: int = 1) -> None:
    """Raises one ValueError naming the flags unless dp x tp devices exist, each tp group fits in
    one process, and dp splits `batch_size` evenly.

    A multi-process run must use every device of every process (each process holds a share of
    the batch): dp x tp = jax.device_count().
    """
    if dp < 1:
        raise ValueError(f"dp (--dp) must be >= 1, got {dp}")
    if tp < 1:
        raise ValueError(f"tp (--tp) must be >= 1, got {tp}")
    local = jax.local_device_count()
    if local % tp:
        raise ValueError(f"tp (--tp) = {tp} does not divide this process's {local} {jax.default_backend()} "
                         f"device(s): a tp group stays inside one process (host); pass a --tp that divides {local}")
    devices = jax.device_count()
    if dist.multi_process() and dp * tp != devices:
        raise ValueError(f"dp (--dp) = {dp} x tp (--tp) = {tp}: a run of {jax.process_count()} processes trains "
                         f"over all their {devices} devices; pass --dp {devices // tp} or leave it out")
    if dp * tp > devices:
        raise ValueError(f"dp (--dp) = {dp}" + (f" x tp (--tp) = {tp}" if tp > 1 else "") + f" needs {dp * tp} "
                         f"devices, but only {devices} {jax.default_backend()} device(s) are available; pass "
                         f"--dp {max(devices // tp, 1)} or fewer")
    if batch_size % dp:
        raise ValueError(f"batch_size (--batch) = {batch_size} is not divisible by dp (--dp) = {dp}: "
                         f"each dp group takes batch / dp sequences of every step")


def check_target_tp(cfg: TargetConfig, tp: int) -> None:
    """Raises one ValueError (a `sharding.ShardingError`) naming --tp and the target's numbers
    when its heads, MLP or GDN heads cannot be split over `tp` devices."""
    try:
        if target_family(cfg) is HYBRID:
            qwen35_check_tp(cfg, tp)
        else:
            sh.check_model(cfg, tp)
    except sh.ShardingError as err:
        raise sh.ShardingError(f"tp (--tp) = {tp} does not fit the target: {err}") from None


def data_parallel_mesh(dp: int, batch_size: int, tp: int = 1) -> jax.sharding.Mesh | None:
    """The (dp, tp) mesh of a run, after `check_data_parallel`; None at dp = tp = 1.

    The devices are ordered by process (`distributed.process_devices`), so each tp group of
    consecutive devices sits in one process and dp spans the processes. None keeps a one-device
    run exactly as it was (no mesh, device 0): its numerics and its compiled step do not change.
    """
    check_data_parallel(dp, batch_size, tp)
    return None if dp * tp == 1 else sh.make_mesh(dp, tp, dist.process_devices())


def target_specs(target: TargetParams, cfg: TargetConfig, tp: int = 1) -> Any:
    """The Spec tree whose layout `target` has: the hybrid's `model_specs`, or for a dense
    target the decoding layout at tp = 1 or at `tp` (`load_model(mesh=)`'s) or the checkpoint
    one, whichever matches leaf for leaf (paths and shapes). Raises a ValueError otherwise."""
    if target_family(cfg) is HYBRID:
        candidates = [qwen35_model_specs(cfg)]
    else:
        candidates = [model_specs(cfg, 1), model_specs(cfg, tp), checkpoint_specs(cfg)]
    got = jax.tree_util.tree_flatten_with_path(target)[0]
    for specs in candidates:
        flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
        if [p for p, _ in flat] == [p for p, _ in got] and all(
                tuple(s.shape) == tuple(x.shape) for (_, s), (_, x) in zip(flat, got)):
            return specs
    raise ValueError(f"the target's params ({len(got)} arrays) match none of {type(cfg).__name__}'s layouts "
                     f"(decoding or checkpoint); load it with convert.load_model")


def place_target(target: TargetParams, cfg: TargetConfig, mesh: jax.sharding.Mesh | None) -> TargetParams:
    """The frozen target on `mesh`, every weight split over "tp" as its declared logical axes say
    (`sharding.specs_shardings`: heads, MLP and vocabulary; norms whole) and whole over "dp".
    Without a mesh: committed to device 0."""
    if mesh is None:
        return jax.device_put(target, jax.devices()[0])
    return dist.put_sharded(target, sh.specs_shardings(target_specs(target, cfg, sh.mesh_sizes(mesh)[1]), mesh))


def place_replicated(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """Commits every array of `tree` whole to each device of `mesh` (to device 0 when None).

    The state, the best-so-far and the frozen target live this way; committing a fresh state
    as well as a restored one means both hit the same compiled train_step.
    """
    if mesh is None:
        return jax.device_put(tree, jax.devices()[0])
    return dist.put_replicated(tree, mesh)


def place_batch(batch: dict[str, Any], mesh: jax.sharding.Mesh | None) -> dict[str, jax.Array]:
    """A step's batch (arrays [B, ...]) split over "dp" on the leading axis: B / dp rows per device.

    Without a mesh: plain uncommitted device arrays, as a one-device run always used.
    """
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    host = {k: np.asarray(v) for k, v in batch.items()}
    count = len(next(iter(host.values())))
    return dist.put_rows(lambda rows: {k: v[rows] for k, v in host.items()}, count, mesh,
                         lambda shape: sh.batch_sharding(mesh, shape), {k: v.shape for k, v in host.items()})


def load_batch(data: SequenceSet | TappedSequences, indices: np.ndarray, mesh: jax.sharding.Mesh | None
               ) -> dict[str, jax.Array]:
    """`place_batch(data.batch(indices), mesh)`, except that each process reads only the rows its
    devices hold: the global batch is the same rows whatever the number of processes."""
    if mesh is None:
        return place_batch(data.batch(indices), mesh)
    # The global shapes come from one row of the token arrays; a row of stored taps is not read
    # for them (its shape is the store's; for a 27B target at 2K tokens a row is 100 MB).
    tapped = isinstance(data, TappedSequences)
    shapes = {k: (len(indices),) + v.shape[1:] for k, v in (data.seqs if tapped else data).batch(indices[:1]).items()}
    if tapped:
        shapes["taps"] = (len(indices), data.store.seq_len, data.store.features)
    return dist.put_rows(lambda rows: data.batch(indices[rows]), len(indices), mesh,
                         lambda shape: sh.batch_sharding(mesh, shape), shapes)


# ----------------------------------------------------------------------------- taps from disk

@dataclasses.dataclass
class TappedSequences:
    """Training rows whose batches carry their taps, read from a `TapStore` written by `write_taps`:
    `train` on it never runs the target's forward (only its embedding and LM head)."""

    seqs: SequenceSet
    store: TapStore

    def __post_init__(self) -> None:
        if (self.store.rows, self.store.seq_len) != (len(self.seqs), self.seqs.seq_len):
            raise ValueError(f"taps (--taps) {self.store.path}: {self.store.rows} rows of {self.store.seq_len} "
                             f"tokens, the training data has {len(self.seqs)} rows of {self.seqs.seq_len}; "
                             f"write them again with make-taps for this data and --seq-len")

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def seq_len(self) -> int:
        return self.seqs.seq_len

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.seqs.prompt_ids

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {**self.seqs.batch(indices), "taps": self.store.read(indices)}


def check_taps(store: TapStore, dcfg: DrafterConfig, tc: TrainConfig, cfg: TargetConfig | None = None) -> None:
    """Raises one ValueError naming --taps unless the stored taps are the ones this run's drafter reads
    (with the target's `cfg`, also their width: taps of another target's layers of the same ids)."""
    if taps_pre_norm(dcfg):
        raise ValueError(f"taps (--taps) {store.path}: make-taps writes the last layer after the final norm; an MTP "
                         f"head with hidden_source pre_norm takes it before, computed in the step (drop --taps)")
    if isinstance(dcfg, mtp.MTPConfig) and tuple(store.tap_layers) != dcfg.target_layer_ids:
        last = dcfg.target_layer_ids[0]
        raise ValueError(f"taps (--taps) {store.path} hold target layers {list(store.tap_layers)}; an MTP head trains "
                         f"on the target's last layer: write them with make-taps --tap-layers {last}")
    if tuple(store.tap_layers) != tuple(dcfg.target_layer_ids):
        raise ValueError(f"taps (--taps) {store.path} hold target layers {list(store.tap_layers)}, the drafter taps "
                         f"{list(dcfg.target_layer_ids)}")
    want = None if cfg is None else len(dcfg.target_layer_ids) * cfg.hidden_size
    if want is not None and store.features != want:
        raise ValueError(f"taps (--taps) {store.path} hold {store.features} features a token, this target's "
                         f"{len(dcfg.target_layer_ids)} taps of {cfg.hidden_size} are {want}: written for another "
                         f"target; write them again with make-taps --target for this one")
    if tc.labels != "response":
        raise ValueError(f"taps (--taps) serve --labels response only; --labels {tc.labels} needs the target's "
                         f"logits, computed in the step")


def write_taps(target: TargetParams, cfg: TargetConfig, seqs: SequenceSet, tap_layers: tuple[int, ...],
               directory: str | Path, *, batch_size: int, dtype: str, progress: bool = True) -> TapStore:
    """The target's taps of every row of `seqs`, written once to a `TapStore` in `directory`.

    In a multi-process run process p computes batches p, p + N, ... on its own first device and
    writes their rows into the one file (process 0 creates it first): `directory` must be shared.
    Process 0 marks the store complete once every process has written its rows.
    """
    from tqdm.auto import tqdm

    features = len(tap_layers) * cfg.hidden_size
    if dist.is_main():
        TapStore.create(directory, len(seqs), seqs.seq_len, features, dtype, tap_layers)
    dist.barrier("make-taps: file created")
    store = TapStore.open(directory)
    target = cast_floating(target, jnp.dtype(dtype))
    taps_fn = jax.jit(target_taps, static_argnums=(1, 3))
    starts = list(range(0, len(seqs), batch_size))
    mine = starts[jax.process_index()::jax.process_count()]
    for start in tqdm(mine, desc="taps", unit="batch", disable=not (progress and dist.is_main())):
        idx = np.arange(start, min(start + batch_size, len(seqs)))
        padded = np.concatenate([idx, np.full(batch_size - len(idx), idx[-1])])  # one compiled shape
        taps, _ = taps_fn(target, cfg, jnp.asarray(seqs.batch(padded)["tokens"]), tuple(tap_layers))
        store.write(start, np.asarray(taps)[:len(idx)])
    dist.barrier("make-taps: every row written")
    if dist.is_main():  # only now may `train --taps` read them
        store.mark_complete()
    return store


# ----------------------------------------------------------------------------- validation

# Folded into PRNGKey(seed) for the validation anchors (training steps use fold_in(rng, step),
# step < TrainConfig.steps, so the two streams never meet in practice).
_EVAL_STREAM = 0x5EEDEA1


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "tc"))
def eval_step(params: DrafterParams, target: TargetParams, batch: dict[str, jax.Array], key: jax.Array, *,
              cfg: TargetConfig, dcfg: DrafterConfig, tc: TrainConfig) -> dict[str, jax.Array]:
    """Sums over one validation batch, no gradient: the numerators and denominators of `evaluate`.

    The same blocks, loss and chain-acceptance rules as `loss_fn` (`score_sums`); a DFlash
    drafter's anchors come from `key`, drawn over the global batch as in `train_step` (an MTP
    head scores every position and ignores `key`).
    """
    anchors = None if isinstance(dcfg, mtp.MTPConfig) else sample_anchors(
        key, batch["prompt_lens"], batch["total_lens"], batch["tokens"].shape[1], tc.num_blocks)

    def sums(params: Any, target: TargetParams, batch: dict[str, jax.Array], anchors: Any = None
             ) -> dict[str, jax.Array]:
        if "taps" in batch:
            taps, source = batch["taps"].astype(target.embed.dtype), None
        else:
            taps, source = target_taps(target, cfg, batch["tokens"], dcfg.target_layer_ids, tc.attn_impl,
                                       labels=tc.labels, last_pre_norm=taps_pre_norm(dcfg))
        return score_sums(block_scores(params, target, taps, batch, None, dcfg=dcfg, tc=tc, source=source,
                                       anchors=anchors))

    return sh.replicate(data_parallel_sums(sums, (params, target), (batch,) if anchors is None else (batch, anchors)))


@dataclasses.dataclass
class ValidationSet:
    """Fixed validation batches: the same rows and the same anchors at every evaluation."""

    rows: np.ndarray  # the data rows evaluated, in batch order
    batches: list[dict[str, jax.Array]]  # tc.batch_size rows each (the train step's shape)
    keys: list[jax.Array]  # the anchor key of each batch


def check_sizes(cfg: TargetConfig, dcfg: DrafterConfig, tc: TrainConfig) -> None:
    """Refuses rows longer than the target's positions, and a step whose largest activations
    alone exceed the device's memory (an absurd --batch or --seq-len otherwise fails deep in XLA)."""
    from dflash_jax.generate import memory_available

    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len (--seq-len) {tc.seq_len} exceeds the target's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    item = jnp.dtype(tc.compute_dtype).itemsize
    # The target's hidden states over every row, and the drafter's logits over every block row:
    # a lower bound of what a step holds at once.
    # An MTP head's logit rows: every position, once per chained step learned.
    rows = tc.seq_len * tc.mtp_steps if isinstance(dcfg, mtp.MTPConfig) else tc.num_blocks * dcfg.block_size
    need = (tc.batch_size * tc.seq_len * cfg.hidden_size * (len(dcfg.target_layer_ids) + 2) * item
            + tc.batch_size * rows * cfg.vocab_size * 4)
    have = memory_available()
    if need > have:
        # An MTP head has no blocks (--blocks is refused for it): its logit rows are the sequence's.
        if isinstance(dcfg, mtp.MTPConfig):
            blocks = f" x mtp_steps (--mtp-train-steps) {tc.mtp_steps}" if tc.mtp_steps > 1 else ""
        else:
            blocks = f" x num_blocks (--blocks) {tc.num_blocks}"
        raise ValueError(f"batch_size (--batch) {tc.batch_size} x seq_len (--seq-len) {tc.seq_len}{blocks} needs at "
                         f"least {need / 1e9:.1f} GB of activations a step, more than the device's {have / 1e9:.1f} GB")


def check_validation(val_fraction: float, eval_every: int | None, val_batches: int, keep_best: bool) -> None:
    """Raises one ValueError naming the flag for validation settings that cannot work.

    The CLI calls it before loading the target; `train` calls it too. (Whether the fraction
    holds out at least one prompt depends on the data: `split_by_prompt` checks that.)
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction (--val-fraction) must be in [0, 1), got {val_fraction}")
    if keep_best and val_fraction == 0:
        raise ValueError("keep_best (--keep-best) needs validation rows: pass val_fraction (--val-fraction) > 0")
    if eval_every is not None and eval_every < 1:
        raise ValueError(f"eval_every (--eval-every) must be >= 1, got {eval_every}")
    if val_batches < 1:
        raise ValueError(f"val_batches (--val-batches) must be >= 1, got {val_batches}")


def validation_set(data: SequenceSet, val_rows: np.ndarray, tc: TrainConfig, max_batches: int) -> ValidationSet:
    """Batches of `val_rows` (at most `max_batches`, a seeded choice of rows when there are more).

    The last batch is filled with copies of a row whose response is cut to nothing
    (total_len = prompt_len): such a row has no anchor, so it adds no block to any metric.
    """
    if max_batches < 1:
        raise ValueError(f"val_batches (--val-batches) must be >= 1, got {max_batches}")
    rows = np.asarray(val_rows)
    cap = max_batches * tc.batch_size
    if len(rows) > cap:
        rows = np.sort(np.random.default_rng([tc.seed, _EVAL_STREAM]).choice(rows, cap, replace=False))
    base = jax.random.fold_in(jax.random.PRNGKey(tc.seed), _EVAL_STREAM)
    batches, keys = [], []
    for j in range(0, len(rows), tc.batch_size):
        idx = rows[j:j + tc.batch_size]
        real = len(idx)
        batch = data.batch(np.concatenate([idx, np.full(tc.batch_size - real, idx[0])]))
        batch["total_lens"][real:] = batch["prompt_lens"][real:]
        batches.append({k: jnp.asarray(v) for k, v in batch.items()})
        keys.append(jax.random.fold_in(base, len(keys)))
    return ValidationSet(rows=rows, batches=batches, keys=keys)


def evaluate(params: DrafterParams, target: TargetParams, vset: ValidationSet, *, cfg: TargetConfig,
             dcfg: DrafterConfig, tc: TrainConfig) -> dict[str, Any]:
    """val_loss, val_acc_by_pos and val_tau_estimate over every block of the validation set.

    The training metrics' formulas (`loss_fn`), summed over all validation blocks rather than
    one batch: loss = sum(ce x w) / sum(w); accuracy at k = correct / rows at k; tau estimate
    = 1 + leading correct rows per valid block. `target` is in compute dtype, as in `train`.
    """
    total: dict[str, np.ndarray] = {}
    for batch, key in zip(vset.batches, vset.keys):
        sums = eval_step(params, target, batch, key, cfg=cfg, dcfg=dcfg, tc=tc)
        for k, v in dist.to_host(sums).items():
            total[k] = total.get(k, 0.0) + np.asarray(v, np.float64)
    return {"val_loss": float(total["loss_sum"] / max(total["weight_sum"], 1e-6)),
            "val_acc_by_pos": (total["correct_by_pos"] / np.maximum(total["tokens_by_pos"], 1.0)).tolist(),
            "val_tau_estimate": float(1.0 + total["run_sum"] / max(total["blocks"], 1.0))}


# ----------------------------------------------------------------------------- the loop

RUN_FILE = "train_run.json"
LOG_FILE = "log.jsonl"


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    out_dir: Path
    export_dir: Path | None
    history: list[dict[str, Any]]
    # keep_best: the step whose parameters were (or, unexported, would be) exported.
    best_step: int | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # train_run.json's "result"


def drafter_config_to_dict(dcfg: DrafterConfig) -> dict[str, Any]:
    """The drafter_config of train_run.json: a DFlash drafter's config.json, or an MTP head's kind
    and hidden source (the rest of its shape is the target's)."""
    if isinstance(dcfg, mtp.MTPConfig):
        return {"kind": "mtp", "hidden_source": dcfg.hidden_source}
    return dr.draft_config_to_dict(dcfg)


def drafter_config_from_dict(d: dict[str, Any], cfg: TargetConfig, source: str) -> DrafterConfig:
    """`drafter_config_to_dict`'s inverse for the target `cfg`; errors name `source`."""
    if d.get("kind") == "mtp":
        try:
            return mtp.MTPConfig(cfg, hidden_source=d["hidden_source"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{source}: drafter_config of an MTP head: {err}") from None
    return dr.draft_config_from_dict(d, source=source)


def fresh_params(dcfg: DrafterConfig, key: jax.Array) -> Any:
    """Random float32 weights of the drafter (`init_params` left out of `train`)."""
    if isinstance(dcfg, mtp.MTPConfig):
        return mtp.init_mtp_params(dcfg.target, key)
    return dr.init_draft_params(dcfg, key, training=True)


def _rows_per_block(dcfg: DrafterConfig, tc: TrainConfig) -> int:
    """Rows of a block (the plots' positions + 1): an MTP head trains tc.mtp_steps steps."""
    return tc.mtp_steps + 1 if isinstance(dcfg, mtp.MTPConfig) else dcfg.block_size


def _run_record(tc: TrainConfig, dcfg: DrafterConfig, extra: dict[str, Any]) -> dict[str, Any]:
    return {"train_config": tc.to_dict(), "drafter_config": drafter_config_to_dict(dcfg), **extra}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def _read_log(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The records of log.jsonl up to step `upto`. A last line cut short (the process was killed
    while writing it) is dropped with a warning; a damaged line before the last is an error."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError:
            if i == len(lines) - 1:
                print(f"train: warning: {path}:{i + 1}: dropping a partial last line ({line[:40]!r}...)",
                      file=sys.stderr)
                break
            raise ValueError(f"{path}:{i + 1}: not a log record ({line[:40]!r}); the log is damaged before its "
                             f"last line") from None
        rows.append(row)
    return [r for r in rows if upto is None or r["step"] <= upto]


def _host_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in dist.to_host(metrics).items():
        v = np.asarray(v)
        out[k] = v.tolist() if v.ndim else float(v)
    return out


def _check_resume(saved: dict[str, Any], record: dict[str, Any], run_path: Path) -> None:
    for part in ("train_config", "drafter_config", "validation"):
        old, new = saved.get(part), record.get(part)
        if part == "train_config" and isinstance(old, dict):
            old = {**TrainConfig().to_dict(), **old}  # a setting added since the run began: its default
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        else:
            diff = [f"{old!r} -> {new!r}"]
        raise ValueError(f"{run_path}: --resume with a different {part} (fields {diff}); "
                         f"a resumed run must use the settings it was started with")


# Longest wait for orbax to finish a checkpoint (see convert.checkpoint.SAVE_TIMEOUT_S).
SAVE_TIMEOUT_S = float(os.environ.get("DFLASH_JAX_SAVE_TIMEOUT_S", 600))


def finished_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the finished checkpoints in `ckpt_dir`, oldest first (an unfinished save is a
    *.orbax-checkpoint-tmp* directory and does not count)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _restore_latest(ckpt_dir: Path, options: Any, state: TrainState, best: dict[str, Any], keep_best: bool
                    ) -> tuple[TrainState, dict[str, Any], int]:
    """-> (state, best, step) of the newest checkpoint that restores.

    One that fails to restore (a truncated array, a missing file) is moved aside to
    `<step>.damaged` with a warning naming it and the one used instead, so that the run's next
    saves do not collide with it. None restoring, or none finished, is an error.
    """
    import orbax.checkpoint as ocp

    steps = finished_steps(ckpt_dir)
    if not steps:
        raise ValueError(f"{ckpt_dir}: no finished checkpoint to resume from (a run killed before its first "
                         f"save leaves none); start the run again without --resume")
    items = {"state": ocp.args.StandardRestore(_abstract(state))}
    if keep_best:
        items["best"] = ocp.args.StandardRestore(_abstract(best))
    damaged: list[tuple[int, str]] = []
    for step in reversed(steps):
        try:
            # A manager for each attempt: one whose restore failed fails every later one too.
            with ocp.CheckpointManager(ckpt_dir, options=options) as mngr:
                restored = mngr.restore(step, args=ocp.args.Composite(**items))
            held = int(dist.to_host(restored["state"].step))
            if held != step:
                raise ValueError(f"it holds step {held}")
        except Exception as err:  # orbax and tensorstore raise many types for a damaged checkpoint
            why = " ".join(str(err).split()).split(" See full TensorStore details")[0]
            damaged.append((step, why[:160]))
            continue
        break
    else:
        raise ValueError(f"{ckpt_dir}: no checkpoint restores (" +
                         "; ".join(f"step {s}: {e}" for s, e in damaged) + ")")
    for bad, why in damaged if dist.is_main() else ():  # one process moves them
        aside = ckpt_dir / f"{bad}.damaged"
        shutil.rmtree(aside, ignore_errors=True)
        (ckpt_dir / str(bad)).rename(aside)
        print(f"train: warning: checkpoint {ckpt_dir / str(bad)} is damaged ({why}); moved to {aside.name}, "
              f"resuming from checkpoint {step} instead", file=sys.stderr)
    return restored["state"], (restored["best"] if keep_best else best), step


def _tau32(tau: float) -> float:
    """A tau as the float32 a checkpoint stores, so that keep-best compares the same after a resume."""
    return float(np.float32(tau))


def train(target: TargetParams, cfg: TargetConfig, dcfg: DrafterConfig, data: SequenceSet | TappedSequences,
          tc: TrainConfig,
          out_dir: str | Path, *, init_params: DrafterParams | None = None, resume: bool = False,
          save_every: int = 500, keep: int = 3, log_every: int = 10, stop_at: int | None = None,
          time_limit: float | None = None, export: bool = True, export_dtype: str = "float32",
          val_fraction: float = 0.0, eval_every: int | None = None, val_batches: int = 32,
          keep_best: bool = False, plots: bool = True, progress: bool = True,
          extra_record: dict[str, Any] | None = None, dp: int = 1, tp: int = 1) -> TrainResult:
    """Trains a drafter; checkpoints, logs, plots and the z-lab export go under `out_dir`.

    out_dir/checkpoints/  orbax CheckpointManager (async saves every `save_every` steps + last)
    out_dir/log.jsonl     one JSON record per `log_every` steps (and per evaluation)
    out_dir/plots/        loss.png, accuracy_by_position.png
    out_dir/drafter/      config.json + model.safetensors (z-lab layout), when training finished
                          (an MTP head: out_dir/mtp/mtp.safetensors, `convert.mtp`'s layout)
    out_dir/train_run.json  the configs, checked on --resume, and the run's "result"
    `resume` continues from the newest checkpoint that restores (a damaged one is moved aside
    with a warning; none finished is an error) with the same data order and anchors, so the
    result equals an uninterrupted run. `stop_at` ends the run early at that step (as an
    interruption would), saving a checkpoint. Ctrl-C also saves before exiting.
    `time_limit` (seconds of this call) ends the run at the first step past it, saves, and still
    exports: a time-boxed run's drafter is its product, and `resume` can finish the schedule later.

    Validation: `val_fraction` of the prompts (all rows of each, `split_by_prompt` seeded with
    tc.seed) never enter a training batch. Every `eval_every` steps (default 10 x log_every),
    at the last step of the schedule and at the step a call ends early, `evaluate` runs on up
    to `val_batches` fixed batches of them and its val_loss, val_acc_by_pos and
    val_tau_estimate go into that step's log record. `keep_best` exports the parameters of the
    evaluation with the highest val_tau_estimate instead of the last ones (the first such step
    on ties). The best of the scheduled evaluations is checkpointed beside the state; the
    evaluation of a call that ends early competes only for that call's export, so a resumed
    run keeps the same best as an uninterrupted one.

    `data` as `TappedSequences` reads each batch's taps from disk instead of running the target.

    `dp` > 1 splits every batch (training and validation) over that many devices, with the
    target, the state and the best-so-far replicated (module docstring). `tc.batch_size` stays
    the global batch and must divide by dp. train_run.json's "dp" is this call's; the
    checkpoints do not depend on it, so `resume` may use another dp (a record without "dp" is
    a dp = 1 run).

    `tp` > 1 splits the frozen target over that many devices inside each process (`place_target`;
    the drafter and its optimizer state stay whole), with dp x tp devices in all; like "dp",
    train_run.json's "tp" is this call's and a resume may change it.
    """
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir).absolute()
    ckpt_dir, log_path, run_path = out_dir / "checkpoints", out_dir / LOG_FILE, out_dir / RUN_FILE
    check_sizes(cfg, dcfg, tc)
    if isinstance(data, TappedSequences):
        check_taps(data.store, dcfg, tc, cfg)
    if data.seq_len != tc.seq_len:
        raise ValueError(f"training rows have seq_len {data.seq_len}, TrainConfig.seq_len is {tc.seq_len}")
    mesh = data_parallel_mesh(dp, tc.batch_size, tp)  # before anything is written
    check_target_tp(cfg, tp)
    eval_every = eval_every if eval_every is not None else 10 * log_every
    check_validation(val_fraction, eval_every, val_batches, keep_best)
    train_rows, val_rows = split_by_prompt(data.prompt_ids, val_fraction, tc.seed)
    validating = len(val_rows) > 0
    vset = validation_set(data, val_rows, tc, val_batches) if validating else None
    if vset is not None and mesh is not None:
        # Validation batches have the training batch's shape: split over dp as well.
        vset = dataclasses.replace(vset, batches=[place_batch(b, mesh) for b in vset.batches],
                                   keys=place_replicated(vset.keys, mesh))
    validation = None if vset is None else {
        "fraction": val_fraction, "eval_every": eval_every, "val_batches": val_batches, "keep_best": keep_best,
        "prompts": int(len(np.unique(data.prompt_ids[val_rows]))), "rows": int(len(val_rows)),
        "rows_evaluated": int(len(vset.rows)), "train_rows": int(len(train_rows))}
    # "dp" and "tp" sit beside the checked parts, not in them: a resume may change them.
    record = _run_record(tc, dcfg, {"validation": validation, "dp": dp, "tp": tp, **(extra_record or {})})
    check_writable(out_dir, "out_dir (--out)")  # orbax, failing to write, would leave the run hanging
    if ckpt_dir.exists():
        check_writable(ckpt_dir, "checkpoint directory")
    if resume:
        if not run_path.is_file():
            raise FileNotFoundError(f"{out_dir}: nothing to resume ({RUN_FILE} is missing)")
        _check_resume(json.loads(run_path.read_text()), record, run_path)
    else:
        if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise ValueError(f"{out_dir}: holds checkpoints of an earlier run; pass resume=True "
                             f"(--resume) or use a fresh directory")
    # Every process has checked the directory before any process writes to it.
    dist.barrier("train: run directory checked")
    main = dist.is_main()  # the one process that writes the log, the record, plots and the export
    if main and not resume:
        atomic_write_text(run_path, json.dumps(record, indent=2) + "\n")

    target = cast_floating(target, jnp.dtype(tc.compute_dtype))
    if mesh is not None:
        target = place_target(target, cfg, mesh)  # frozen: split over tp, a copy per dp group
    if init_params is None:
        init_params = fresh_params(dcfg, jax.random.key(tc.seed + 1))
    state = init_state(init_params, tc)
    # The best scheduled evaluation so far (keep_best): checkpointed with the state. step 0 = none yet.
    best = {"params": state.params, "step": jnp.zeros((), jnp.int32), "tau": jnp.zeros((), jnp.float32)}
    # Placed before a restore: `_abstract` then restores straight into this layout, whatever
    # dp the checkpoint was written with.
    state, best = place_replicated((state, best), mesh)
    # A killed run leaves its unfinished save as a *.orbax-checkpoint-tmp* directory: removed.
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                           enable_async_checkpointing=True, cleanup_tmp_directories=True)
    history: list[dict[str, Any]] = []
    start = 0
    if resume:
        state, best, start = _restore_latest(ckpt_dir, options, state, best, keep_best)
    with ocp.CheckpointManager(ckpt_dir, options=options) as mngr:
        # Restored arrays are committed to a device; commit a fresh state too, so that a fresh and
        # a resumed run hit the same compiled train_step.
        state, best = place_replicated((state, best), mesh)
        best_step, best_tau = int(dist.to_host(best["step"])), float(dist.to_host(best["tau"]))
        history = _read_log(log_path, upto=start)
        if main:  # drop the steps after the checkpoint
            atomic_write_text(log_path, "".join(json.dumps(r) + "\n" for r in history))
        end = tc.steps if stop_at is None else min(stop_at, tc.steps)
        last_eval: tuple[int, float, Any] | None = None  # (step, tau, params) of this call's last evaluation

        def save(step: int, force: bool = False) -> None:
            items = {"state": ocp.args.StandardSave(state)}
            if keep_best:
                items["best"] = ocp.args.StandardSave(best)
            mngr.save(step, args=ocp.args.Composite(**items), force=force)

        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not (progress and main), unit="step")
        t_last, step, logged, eval_s = time.perf_counter(), start, start, 0.0
        t_start, timed_out = t_last, False
        try:
            # The mesh is part of the trace context: train_step and eval_step compile for it.
            with open(log_path if main else os.devnull, "a") as log, sh.use_mesh(mesh):
                for step in range(start, end):
                    idx = train_rows[batch_indices(len(train_rows), tc.batch_size, step, tc.seed)]
                    batch = load_batch(data, idx, mesh)
                    new_state, metrics = train_step(state, target, batch, cfg=cfg, dcfg=dcfg, tc=tc)
                    done = step + 1
                    # Process 0's clock decides for all: every process must stop at the same step.
                    if done < end and time_limit is not None and dist.agree(
                            int(time.perf_counter() - t_start > time_limit)):
                        end, timed_out = done, True
                        print(f"train: time limit {time_limit:.0f} s reached at step {done} of {tc.steps}",
                              file=sys.stderr)
                    scheduled = done % eval_every == 0 or done == tc.steps
                    val = None
                    if vset is not None and (scheduled or done == end):
                        t_eval = time.perf_counter()
                        val = evaluate(new_state.params, target, vset, cfg=cfg, dcfg=dcfg, tc=tc)
                        val["val_seconds"] = time.perf_counter() - t_eval
                        eval_s += val["val_seconds"]
                        tau = _tau32(val["val_tau_estimate"])
                        last_eval = (done, tau, new_state.params if keep_best else None)
                        if keep_best and scheduled and tau > best_tau:
                            best_step, best_tau = done, tau
                            best = {"params": new_state.params, "step": jnp.asarray(done, jnp.int32),
                                    "tau": jnp.asarray(tau, jnp.float32)}
                    # The state advances only once its step's evaluation is done: a Ctrl-C
                    # checkpoint never holds a step whose scheduled evaluation is missing.
                    state = new_state
                    if done % log_every == 0 or done == end or val is not None:
                        row = {"step": done, **_host_metrics(metrics), **(val or {})}
                        now = time.perf_counter()
                        # Wall time per step since the last record (the first includes compilation),
                        # evaluations excluded (val_seconds).
                        row["seconds_per_step"] = (now - t_last - eval_s) / (done - logged)
                        t_last, logged, eval_s = now, done, 0.0
                        log.write(json.dumps(row) + "\n")
                        log.flush()
                        history.append(row)
                        post = {"loss": f"{row['loss']:.3f}", "tau": f"{row['tau_estimate']:.2f}"}
                        if val is not None:
                            post["val_tau"] = f"{val['val_tau_estimate']:.2f}"
                        bar.set_postfix(post)
                    bar.update(1)
                    if timed_out:
                        break
                    if done < end:
                        save(done)  # the manager saves only every save_every steps
                step = end
        except KeyboardInterrupt:
            save(int(dist.to_host(state.step)), force=True)
            bounded(mngr.wait_until_finished, SAVE_TIMEOUT_S, f"saving a checkpoint in {ckpt_dir}")
            bar.close()
            raise
        bar.close()
        if mngr.latest_step() != end:
            save(end, force=True)
        bounded(mngr.wait_until_finished, SAVE_TIMEOUT_S, f"saving a checkpoint in {ckpt_dir}")

    # keep_best: the best scheduled evaluation, or this call's last one if it ended early and did better.
    kept_step, kept_params = None, state.params
    if keep_best:
        if best_step > 0:
            kept_step, kept_params, kept_tau = best_step, best["params"], best_tau
        if (last_eval is not None and last_eval[0] == end and np.isfinite(last_eval[1])
                and (kept_step is None or last_eval[1] > kept_tau)):
            kept_step, kept_params = last_eval[0], last_eval[2]
        if kept_step is None:  # no finite evaluation: fall back to the last parameters
            kept_params = state.params
    if plots and main:
        plot_history(history, out_dir / "plots", block_size=_rows_per_block(dcfg, tc), kept_step=kept_step)
    export_dir = None
    if export and main and (end == tc.steps or timed_out):
        # Written beside, then renamed into place: a crash leaves the previous export or the new one.
        kept = cast_floating(dist.to_host(kept_params), jnp.dtype(export_dtype))
        if isinstance(dcfg, mtp.MTPConfig):
            from convert.mtp import export_mtp

            name = "mtp"
            partial = export_mtp(kept, cfg, out_dir / f".{name}.{os.getpid()}.partial", dcfg.hidden_source).parent
        else:
            from convert.dflash_drafter import export_drafter

            name = "drafter"
            partial = export_drafter(dcfg, kept, out_dir / f".{name}.{os.getpid()}.partial")
        export_dir = out_dir / name
        old = out_dir / f".{name}.{os.getpid()}.old"
        if export_dir.exists():
            export_dir.rename(old)
        partial.rename(export_dir)
        shutil.rmtree(old, ignore_errors=True)
    summary = {**_summary(history, end, tc, export_dir, keep_best, kept_step, validation), "dp": dp, "tp": tp}
    if main:
        atomic_write_text(run_path, json.dumps({**record, "result": summary}, indent=2) + "\n")
    return TrainResult(state=state, out_dir=out_dir, export_dir=export_dir, history=history, best_step=kept_step,
                       summary=summary)


def _summary(history: list[dict[str, Any]], end: int, tc: TrainConfig, export_dir: Path | None, keep_best: bool,
             kept_step: int | None, validation: dict[str, Any] | None) -> dict[str, Any]:
    """The run's outcome: last training record, last and kept evaluations, what was exported."""
    last = history[-1] if history else {}
    out: dict[str, Any] = {"step": end, "finished": end == tc.steps,
                           "export": str(export_dir) if export_dir else None,
                           "loss": last.get("loss"), "tau_estimate": last.get("tau_estimate"),
                           "acc_by_pos": last.get("acc_by_pos")}
    evals = [r for r in history if "val_loss" in r]
    if validation is not None:
        out.update(train_rows=validation["train_rows"], val_rows=validation["rows"])
        if evals:
            out.update(val_step=evals[-1]["step"], val_loss=evals[-1]["val_loss"],
                       val_tau_estimate=evals[-1]["val_tau_estimate"], val_acc_by_pos=evals[-1]["val_acc_by_pos"])
    if keep_best:
        kept = next((r for r in evals if r["step"] == kept_step), None)
        out.update(keep_best=True, best_step=kept_step,
                   best_val_tau_estimate=kept["val_tau_estimate"] if kept else None,
                   exported_step=kept_step if export_dir else None)
    elif export_dir:
        out["exported_step"] = end
    return out


def time_step_parts(target: TargetParams, cfg: TargetConfig, dcfg: DrafterConfig, data: SequenceSet,
                    tc: TrainConfig, dparams: DrafterParams | None = None, repeats: int = 10,
                    dp: int = 1, tp: int = 1) -> dict[str, float]:
    """Median seconds of the taps forward alone and of a whole train_step (compile excluded).

    The measurement behind "taps on the fly or cached": caching would save at most `taps_s`
    per step. Run it on the training device(s) with the real shapes (`dp`, `tp` as `train`'s).
    """
    mesh = data_parallel_mesh(dp, tc.batch_size, tp)
    check_target_tp(cfg, tp)
    target = cast_floating(target, jnp.dtype(tc.compute_dtype))
    state = init_state(dparams if dparams is not None else fresh_params(dcfg, jax.random.key(0)), tc)
    if mesh is not None:
        target, state = place_target(target, cfg, mesh), place_replicated(state, mesh)
    batch = load_batch(data, batch_indices(len(data), tc.batch_size, 0, tc.seed), mesh)
    taps_fn = jax.jit(functools.partial(target_taps, labels=tc.labels, last_pre_norm=taps_pre_norm(dcfg)),
                      static_argnums=(1, 3, 4))
    out: dict[str, float] = {}
    for name, fn in (("taps_s", lambda: taps_fn(target, cfg, batch["tokens"], dcfg.target_layer_ids, tc.attn_impl)),
                     ("step_s", lambda: train_step(state, target, batch, cfg=cfg, dcfg=dcfg, tc=tc))):
        with sh.use_mesh(mesh):
            jax.block_until_ready(fn())  # compile
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    out["taps_share"] = out["taps_s"] / out["step_s"]
    return out


# ----------------------------------------------------------------------------- plots

def plot_history(history: list[dict[str, Any]], out_dir: str | Path, block_size: int,
                 kept_step: int | None = None) -> list[Path]:
    """loss.png (loss and the chain-acceptance estimate by step, training batches and validation)
    and accuracy_by_position.png (training picks, the last validation and the kept one)."""
    if not history:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in history]
    evals = [r for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in history], label="weighted loss")
    ax.plot(steps, [r["ce"] for r in history], label="mean cross-entropy", alpha=0.7)
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], color="tab:red", marker="o",
                markersize=3, label="validation weighted loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["tau_estimate"] for r in history], color="tab:green", label="tau estimate")
    if evals:
        ax2.plot([r["step"] for r in evals], [r["val_tau_estimate"] for r in evals], color="tab:olive",
                 linestyle="--", marker="o", markersize=3, label="tau estimate (validation)")
    if kept_step is not None:
        ax2.axvline(kept_step, color="grey", linestyle=":", label=f"exported (step {kept_step})")
    ax2.set_ylabel("tau estimate (greedy chain)")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], loc="upper right", fontsize="small")
    ax.set_title("Drafter training")
    fig.tight_layout()
    loss_png = out_dir / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    k = np.arange(1, block_size)
    picks = sorted({0, len(history) // 2, len(history) - 1})
    for i in picks:
        r = history[i]
        # Average the accuracy over up to 5 log records around the pick (less noise).
        window = history[max(0, i - 4):i + 1]
        acc = np.mean([w["acc_by_pos"] for w in window], axis=0)
        ax.plot(k, acc, marker="o", label=f"step {r['step']}")
    shown = [evals[-1]] if evals else []
    shown += [r for r in evals if r["step"] == kept_step and r is not evals[-1]]
    for r, color in zip(shown, ("black", "grey")):
        kept = " (exported)" if r["step"] == kept_step else ""
        ax.plot(k, r["val_acc_by_pos"], color=color, linestyle="--", marker="s", markersize=4,
                label=f"validation, step {r['step']}{kept}")
    ax.set_xlabel("block position k")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1)
    ax.set_xticks(k)
    ax.legend(fontsize="small")
    ax.set_title("Accuracy by block position (solid: training batches)" if evals else
                 "Accuracy by block position")
    fig.tight_layout()
    acc_png = out_dir / "accuracy_by_position.png"
    fig.savefig(acc_png, dpi=120)
    plt.close(fig)
    return [loss_png, acc_png]
