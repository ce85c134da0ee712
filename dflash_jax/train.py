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
(bfloat16 on GPU). Target taps are computed on the fly, see `train_data`'s docstring.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import drafter as dr
from dflash_jax.config import ModelConfig, default_tap_layers
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import ModelParams, forward, rms_norm
from dflash_jax.params import cast_floating
from dflash_jax.rope import rope_tables
from dflash_jax.train_data import SequenceSet, batch_indices

# Token texts tried, in order, for the drafter's MASK token (the target's embedding of it is used).
MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<empty_output>", "<filename>")


# ----------------------------------------------------------------------------- configuration

def default_gamma(block_size: int) -> float:
    """The loss-decay constant: 7 for block size 16 (the paper), scaled linearly otherwise."""
    return 7.0 * block_size / 16


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

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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


def drafter_config_for(target: ModelConfig, *, num_layers: int = 3, block_size: int = 16,
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

def target_taps(target: ModelParams, cfg: ModelConfig, tokens: jax.Array, tap_layers: tuple[int, ...],
                attn_impl: str = "auto") -> jax.Array:
    """The target's tap features of every position: tokens [batch, T] -> [batch, T, taps*embed].

    One causal target forward (no logits); constant for the drafter (stop_gradient).
    """
    batch, seq = tokens.shape
    cache = KVCache.create(cfg.num_layers, batch, seq, cfg.num_kv_heads, cfg.head_dim, target.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    out = forward(target, cfg, tokens, positions, cache, None, tap_layers=tuple(tap_layers),
                  compute_logits=False, attn_impl=attn_impl)
    return jax.lax.stop_gradient(out.taps)


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


def packed_forward(dparams: dr.DraftParams, dcfg: dr.DraftConfig, target: ModelParams, taps: jax.Array,
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
                  block_size: int) -> tuple[jax.Array, jax.Array]:
    """Targets of block rows 1..bs-1 (the response tokens at anchor+k) and their mask [B, N, bs-1]."""
    seq = tokens.shape[1]
    pos = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)
    targets = jnp.take_along_axis(tokens, jnp.clip(pos, 0, seq - 1).reshape(tokens.shape[0], -1), 1)
    mask = valid[:, :, None] & (pos < total_lens[:, None, None])
    return targets.reshape(pos.shape), mask


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """exp(-(k-1)/gamma) for block rows k = 1..bs-1: early rows matter most (they gate acceptance)."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def loss_fn(dparams: dr.DraftParams, target: ModelParams, taps: jax.Array, batch: dict[str, jax.Array],
            key: jax.Array, *, dcfg: dr.DraftConfig, tc: TrainConfig) -> tuple[jax.Array, dict[str, Any]]:
    """Weighted block cross-entropy and metrics. dparams are float32 masters, cast here."""
    tokens, prompt_lens, total_lens = batch["tokens"], batch["prompt_lens"], batch["total_lens"]
    bs = dcfg.block_size
    params = cast_floating(dparams, jnp.dtype(tc.compute_dtype))
    anchors, valid = sample_anchors(key, prompt_lens, total_lens, tokens.shape[1], tc.num_blocks)
    hidden = packed_forward(params, dcfg, target, taps, tokens, anchors, remat=tc.remat)
    b, n = anchors.shape
    logits = dr.draft_logits(params, dcfg, target, hidden.reshape(b * n, bs, -1)).reshape(b, n, bs - 1, -1)
    targets, mask = block_targets(tokens, anchors, valid, total_lens, bs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    m = mask.astype(jnp.float32)
    w = position_weights(bs, tc.gamma or default_gamma(bs)) * m
    loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
    correct = (jnp.argmax(logits, -1) == targets) & mask
    per_pos = jnp.maximum(jnp.sum(m, (0, 1)), 1.0)
    # Mean accepted length of greedy chain drafting on these blocks: 1 + leading correct rows.
    run = jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)
    n_valid = jnp.maximum(jnp.sum(valid), 1)
    metrics = {
        "loss": loss,
        "ce": jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0),
        "acc_by_pos": jnp.sum(correct, (0, 1)) / per_pos,
        "tokens_by_pos": jnp.sum(m, (0, 1)),
        "tau_estimate": 1.0 + jnp.sum(jnp.where(valid, run, 0)) / n_valid,
        "blocks": jnp.sum(valid),
    }
    return loss, metrics


# ----------------------------------------------------------------------------- the step

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any  # DraftParams, float32 master weights
    opt_state: Any
    step: jax.Array  # int32 scalar: steps done
    rng: jax.Array  # uint32[2] raw key; step s uses fold_in(rng, s)


def init_state(dparams: dr.DraftParams, tc: TrainConfig) -> TrainState:
    params = cast_floating(dparams, jnp.float32)
    return TrainState(params=params, opt_state=make_optimizer(tc).init(params),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(tc.seed))


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "tc"))
def train_step(state: TrainState, target: ModelParams, batch: dict[str, jax.Array], *, cfg: ModelConfig,
               dcfg: dr.DraftConfig, tc: TrainConfig) -> tuple[TrainState, dict[str, Any]]:
    """One optimiser step: target taps (on the fly) -> packed drafter pass -> loss -> AdamW.

    target: the frozen target, already in compute dtype; batch: tokens [B, T] int32,
    prompt_lens / total_lens [B] int32. Pure: the result depends only on the arguments.
    """
    taps = target_taps(target, cfg, batch["tokens"], dcfg.target_layer_ids, tc.attn_impl)
    key = jax.random.fold_in(state.rng, state.step)
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, dcfg=dcfg, tc=tc), has_aux=True)
    (_, metrics), grads = grad_fn(state.params, target, taps, batch, key)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = _tree_norm(grads)
    metrics["lr"] = learning_rate_schedule(tc)(state.step)
    return TrainState(params, opt_state, state.step + 1, state.rng), metrics


# optax >= 0.2.5 has optax.tree.norm and deprecates optax.global_norm.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


# ----------------------------------------------------------------------------- the loop

RUN_FILE = "train_run.json"
LOG_FILE = "log.jsonl"


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    out_dir: Path
    export_dir: Path | None
    history: list[dict[str, Any]]


def _run_record(tc: TrainConfig, dcfg: dr.DraftConfig, extra: dict[str, Any]) -> dict[str, Any]:
    return {"train_config": tc.to_dict(), "drafter_config": dr.draft_config_to_dict(dcfg), **extra}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def _read_log(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


def _host_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = v.tolist() if v.ndim else float(v)
    return out


def train(target: ModelParams, cfg: ModelConfig, dcfg: dr.DraftConfig, data: SequenceSet, tc: TrainConfig,
          out_dir: str | Path, *, init_params: dr.DraftParams | None = None, resume: bool = False,
          save_every: int = 500, keep: int = 3, log_every: int = 10, stop_at: int | None = None,
          time_limit: float | None = None, export: bool = True, export_dtype: str = "float32",
          plots: bool = True, progress: bool = True,
          extra_record: dict[str, Any] | None = None) -> TrainResult:
    """Trains a drafter; checkpoints, logs, plots and the z-lab export go under `out_dir`.

    out_dir/checkpoints/  orbax CheckpointManager (async saves every `save_every` steps + last)
    out_dir/log.jsonl     one JSON record per `log_every` steps
    out_dir/plots/        loss.png, accuracy_by_position.png
    out_dir/drafter/      config.json + model.safetensors (z-lab layout), when training finished
    out_dir/train_run.json  the configs, checked on --resume
    `resume` continues from the latest checkpoint with the same data order and anchors, so the
    result equals an uninterrupted run. `stop_at` ends the run early at that step (as an
    interruption would), saving a checkpoint. Ctrl-C also saves before exiting.
    `time_limit` (seconds of this call) ends the run at the first step past it, saves, and still
    exports: a time-boxed run's drafter is its product, and `resume` can finish the schedule later.
    """
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir).absolute()
    ckpt_dir, log_path, run_path = out_dir / "checkpoints", out_dir / LOG_FILE, out_dir / RUN_FILE
    record = _run_record(tc, dcfg, extra_record or {})
    if data.seq_len != tc.seq_len:
        raise ValueError(f"training rows have seq_len {data.seq_len}, TrainConfig.seq_len is {tc.seq_len}")
    if resume:
        if not run_path.is_file():
            raise FileNotFoundError(f"{out_dir}: nothing to resume ({RUN_FILE} is missing)")
        saved = json.loads(run_path.read_text())
        for part in ("train_config", "drafter_config"):
            if saved[part] != record[part]:
                diff = sorted(k for k in set(saved[part]) | set(record[part])
                              if saved[part].get(k) != record[part].get(k))
                raise ValueError(f"{run_path}: --resume with a different {part} (fields {diff}); "
                                 f"a resumed run must use the settings it was started with")
    else:
        if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise ValueError(f"{out_dir}: holds checkpoints of an earlier run; pass resume=True "
                             f"(--resume) or use a fresh directory")
        out_dir.mkdir(parents=True, exist_ok=True)
        run_path.write_text(json.dumps(record, indent=2) + "\n")

    target = cast_floating(target, jnp.dtype(tc.compute_dtype))
    if init_params is None:
        init_params = dr.init_draft_params(dcfg, jax.random.key(tc.seed + 1))
    state = init_state(init_params, tc)
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                           enable_async_checkpointing=True)
    history: list[dict[str, Any]] = []
    with ocp.CheckpointManager(ckpt_dir, options=options) as mngr:
        start = 0
        if resume and mngr.latest_step() is not None:
            start = mngr.latest_step()
            restored = mngr.restore(start, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(state))))
            state = restored["state"]
            if int(state.step) != start:
                raise ValueError(f"{ckpt_dir}: checkpoint {start} holds step {int(state.step)}")
        # Restored arrays are committed to a device; commit a fresh state too, so that a fresh and
        # a resumed run hit the same compiled train_step.
        state = jax.device_put(state, jax.devices()[0])
        history = _read_log(log_path, upto=start)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("".join(json.dumps(r) + "\n" for r in history))  # drop steps after the checkpoint
        end = tc.steps if stop_at is None else min(stop_at, tc.steps)

        def save(step: int, force: bool = False) -> None:
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=force)

        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not progress, unit="step")
        t_last, step, logged = time.perf_counter(), start, start
        t_start, timed_out = t_last, False
        try:
            with log_path.open("a") as log:
                for step in range(start, end):
                    idx = batch_indices(len(data), tc.batch_size, step, tc.seed)
                    batch = {k: jnp.asarray(v) for k, v in data.batch(idx).items()}
                    state, metrics = train_step(state, target, batch, cfg=cfg, dcfg=dcfg, tc=tc)
                    done = step + 1
                    if done < end and time_limit is not None and time.perf_counter() - t_start > time_limit:
                        end, timed_out = done, True
                        print(f"train: time limit {time_limit:.0f} s reached at step {done} of {tc.steps}",
                              file=sys.stderr)
                    if done % log_every == 0 or done == end:
                        row = {"step": done, **_host_metrics(metrics)}
                        now = time.perf_counter()
                        # Wall time per step since the last record (the first includes compilation).
                        row["seconds_per_step"] = (now - t_last) / (done - logged)
                        t_last, logged = now, done
                        log.write(json.dumps(row) + "\n")
                        log.flush()
                        history.append(row)
                        bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau_estimate']:.2f}")
                    bar.update(1)
                    if timed_out:
                        break
                    if done < end:
                        save(done)  # the manager saves only every save_every steps
                step = end
        except KeyboardInterrupt:
            save(int(state.step), force=True)
            mngr.wait_until_finished()
            bar.close()
            raise
        bar.close()
        if mngr.latest_step() != end:
            save(end, force=True)
        mngr.wait_until_finished()
    if plots:
        plot_history(history, out_dir / "plots", block_size=dcfg.block_size)
    export_dir = None
    if export and (end == tc.steps or timed_out):
        from convert.dflash_drafter import export_drafter

        export_dir = export_drafter(dcfg, cast_floating(state.params, jnp.dtype(export_dtype)), out_dir / "drafter")
    return TrainResult(state=state, out_dir=out_dir, export_dir=export_dir, history=history)


def time_step_parts(target: ModelParams, cfg: ModelConfig, dcfg: dr.DraftConfig, data: SequenceSet,
                    tc: TrainConfig, dparams: dr.DraftParams | None = None, repeats: int = 10) -> dict[str, float]:
    """Median seconds of the taps forward alone and of a whole train_step (compile excluded).

    The measurement behind "taps on the fly or cached": caching would save at most `taps_s`
    per step. Run it on the training device with the real shapes.
    """
    target = cast_floating(target, jnp.dtype(tc.compute_dtype))
    state = init_state(dparams if dparams is not None else dr.init_draft_params(dcfg, jax.random.key(0)), tc)
    batch = {k: jnp.asarray(v) for k, v in data.batch(batch_indices(len(data), tc.batch_size, 0, tc.seed)).items()}
    taps_fn = jax.jit(target_taps, static_argnums=(1, 3, 4))
    out: dict[str, float] = {}
    for name, fn in (("taps_s", lambda: taps_fn(target, cfg, batch["tokens"], dcfg.target_layer_ids, tc.attn_impl)),
                     ("step_s", lambda: train_step(state, target, batch, cfg=cfg, dcfg=dcfg, tc=tc))):
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

def plot_history(history: list[dict[str, Any]], out_dir: str | Path, block_size: int) -> list[Path]:
    """loss.png (loss and the chain-acceptance estimate by step) and accuracy_by_position.png."""
    if not history:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in history], label="weighted loss")
    ax.plot(steps, [r["ce"] for r in history], label="mean cross-entropy", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["tau_estimate"] for r in history], color="tab:green", label="tau estimate")
    ax2.set_ylabel("tau estimate (greedy chain, training blocks)")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], loc="upper right")
    ax.set_title("DFlash drafter training")
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
    ax.set_xlabel("block position k")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1)
    ax.set_xticks(k)
    ax.legend()
    ax.set_title("Accuracy by block position")
    fig.tight_layout()
    acc_png = out_dir / "accuracy_by_position.png"
    fig.savefig(acc_png, dpi=120)
    plt.close(fig)
    return [loss_png, acc_png]
