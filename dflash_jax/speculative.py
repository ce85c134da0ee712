"""DFlash and DDTree speculative decoding: the round, and the whole generation on device.

One round (DESIGN.md, "The round"):
  1. draft   -- the drafter proposes per-depth distributions for a block [root, MASK x (bs-1)];
  2. tree    -- DFlash: the drafted block as a chain; DDTree: the top-`budget` prefixes;
  3. verify  -- one target pass over the W tree slots with tree attention;
  4. accept  -- walk down the tree following the target (or rejection-sample the chain);
  5. commit  -- compact accepted K/V, extend the drafter context, emit tokens, update `done`.
The generation is a `lax.while_loop` of rounds (`Impl.rounds_per_check` of them between two
looks at `done`); every sequence of the batch has its own length, tree, accepted count and stop
state. `SpecSettings` says what is decoded, `impl.Impl` how (the attention's implementation);
every other kernel runs where it applies.

The target is a dense model (`config.ModelConfig`, dflash_jax.model) or a Qwen3.5 / Qwen3.6
hybrid (`qwen3_5.Qwen35Config`); `target_family` picks, from the config's type, the three things
that differ between them (prefill, verify, commit). The drafter reads only the target's `embed`
and `lm_head`, which both parameter types hold in the same layout.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import drafter as dr
from dflash_jax import mtp
from dflash_jax import qwen3_5
from dflash_jax.accept import chain_rejection, follow_target
from dflash_jax.config import ModelConfig
from dflash_jax.generate import COMMAND_BUFFERS_ALL, COMMAND_BUFFERS_OFF, PAD, Generation, is_stop, prefill
from dflash_jax.impl import Impl
from dflash_jax.kv_cache import KVCache, gather_rows, write_rows
from dflash_jax.model import ModelParams, forward
from dflash_jax.qwen3_5 import HybridCache, Qwen35Config, Qwen35Params, Qwen35Verified
from dflash_jax.sampling import SamplingParams, sample, sample_from_probs, sampling_probs
from dflash_jax.sharding import mesh_sizes
from dflash_jax.tree import Tree, build_tree, chain_tree, tree_width
from pallas_kernels import kv_compact

METHODS = ("dflash", "ddtree", "mtp")


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """What a speculative decoder decodes (static; the implementation is `impl.Impl`).

    method: "dflash" (the drafted block as a chain), "ddtree" (the best-`budget` tree), or "mtp"
        (an MTP head's `mtp_steps` chained steps (`dflash_jax.mtp`): a chain verified like
        DFlash when budget is 0, else the best-`budget` tree of the steps' distributions,
        verified like DDTree).
    block_size: the drafter's block (root + block_size - 1 drafted tokens), >= 2; for "mtp" it
        is mtp_steps + 1 (set from mtp_steps).
    budget: DDTree's (or an MTP tree's) drafted nodes per tree (root excluded), >= 1; unused by
        DFlash; 0 for an MTP chain.
    mtp_steps: the MTP head's chained steps per round, >= 1 for "mtp"; 0 otherwise.
    sampling: greedy at temperature 0, else the target's distribution exactly (lossless).
    max_new_tokens: tokens emitted per sequence at most, >= 1.
    stop_tokens: token ids that end a sequence (the stop token is kept).
    """

    method: str = "dflash"
    block_size: int = 16
    budget: int = 0
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    stop_tokens: tuple[int, ...] = ()
    mtp_steps: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not _is_int(self.mtp_steps) or self.mtp_steps < 0:
            raise ValueError(f"mtp_steps must be an int >= 0, got {self.mtp_steps!r}")
        if self.method == "mtp":
            if self.mtp_steps < 1:
                raise ValueError(f"mtp_steps must be >= 1 for mtp, got {self.mtp_steps}")
            object.__setattr__(self, "block_size", self.mtp_steps + 1)
        elif self.mtp_steps:
            raise ValueError(f"mtp_steps is for method 'mtp', got {self.mtp_steps} with {self.method!r}")
        if not _is_int(self.block_size) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if not _is_int(self.budget) or self.budget < 0:
            raise ValueError(f"budget must be an int >= 0, got {self.budget!r}")
        if self.method == "ddtree" and self.budget < 1:
            raise ValueError(f"budget must be >= 1 for ddtree, got {self.budget}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.stop_tokens, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be a tuple of token ids >= 0, got {self.stop_tokens!r}")

    @property
    def width(self) -> int:
        """Tree slots verified per round."""
        return self.block_size if self.is_chain else tree_width(self.budget)

    @property
    def is_chain(self) -> bool:
        """Whether the draft is verified as one chain (DFlash, an MTP chain), not a tree."""
        return self.method == "dflash" or (self.method == "mtp" and self.budget == 0)

    def cache_slack(self) -> int:
        """Scratch slots past the committed length that a round writes."""
        return max(self.width, self.block_size) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: KVCache | HybridCache  # target cache; lengths = committed tokens (root not included)
    draft_cache: Any  # dr.DraftCache (context for positions < lengths), or mtp.MTPCache for an MTP head
    root: jax.Array  # [batch] last bonus token, at position cache.lengths
    out: jax.Array  # [batch, max_new_tokens]
    count: jax.Array  # [batch] tokens emitted so far (the root included)
    done: jax.Array  # [batch] bool
    accepted: jax.Array  # [batch, max_new_tokens] tokens committed per round
    rounds: jax.Array  # [batch]
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tree: Tree
    draft_probs: Any  # [batch, bs-1, vocab] for a chain (DFlash, MTP) at T > 0, else None
    limit: jax.Array  # [batch] drafted tokens that may still be accepted (max_new_tokens bound)

    @property
    def node_ok(self) -> jax.Array:
        """[batch, W] nodes that may still be accepted."""
        return self.tree.depths <= self.limit[:, None]


def _block_limit(state: SpecState, s: SpecSettings) -> jax.Array:
    """[batch] drafted tokens that may still be emitted: the reference shortens the last block."""
    remaining = s.max_new_tokens - state.count
    return jnp.clip(remaining, 0, s.block_size - 1)


# ----------------------------------------------------------------------------- target families

@dataclasses.dataclass(frozen=True)
class TargetFamily:
    """What the round does differently for one family of targets (see `target_family`).

    prefill(target, cfg, prompts [B, P], prompt_lens [B], max_len, tap_layers, impl, last_pre_norm)
        -> (logits at each prompt's last token [B, vocab], taps [B, P, taps * embed], a new cache
        holding the prompts, lengths = prompt_lens)
    verify(target, cfg, tree, positions [B, W], cache, tap_layers, impl, last_pre_norm)
        -> (logits [B, W, vocab], taps [B, W, taps * embed], verified: the tree's K/V written at
        L..L+W-1, nothing committed)
    last_pre_norm (default False): the last layer's tap is taken before the final norm
    (`taps_pre_norm`).
    commit(verified, start [B], path [B, bs], m [B], active [B] bool, impl)
        -> the cache after the accepted path (lengths start + m + 1; unchanged where not active)
    """

    prefill: Callable[..., tuple[jax.Array, jax.Array, Any]]
    verify: Callable[..., tuple[jax.Array, jax.Array, Any]]
    commit: Callable[..., Any]


def _dense_prefill(target: ModelParams, cfg: ModelConfig, prompts: jax.Array, prompt_lens: jax.Array,
                   max_len: int, tap_layers: tuple[int, ...], impl: Impl, last_pre_norm: bool = False
                   ) -> tuple[jax.Array, jax.Array, KVCache]:
    batch = prompts.shape[0]
    dtype = target.embed.dtype
    cache = KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)
    return prefill(target, cfg, prompts, prompt_lens, cache, tap_layers=tap_layers, attn_impl=impl.attention,
                   last_tap_pre_norm=last_pre_norm)


def _dense_verify(target: ModelParams, cfg: ModelConfig, tree: Tree, positions: jax.Array, cache: KVCache,
                  tap_layers: tuple[int, ...], impl: Impl, last_pre_norm: bool = False
                  ) -> tuple[jax.Array, jax.Array, KVCache]:
    out = forward(target, cfg, tree.tokens, positions, cache, tree.visible,
                  tap_layers=tap_layers, attn_impl=impl.attention, last_tap_pre_norm=last_pre_norm)
    return out.logits, out.taps, out.cache


def _dense_commit(cache: KVCache, start: jax.Array, path: jax.Array, m: jax.Array, active: jax.Array,
                  impl: Impl) -> KVCache:
    bs = path.shape[1]
    # Accepted nodes' K/V move from their tree slots to contiguous slots L..L+m.
    slots = start[:, None] + path
    layers = len(cache.k)
    if compact_in_one_launch(cache, bs, impl):
        moved = kv_compact.kv_compact(cache.k + cache.v, slots, start)
    else:
        moved = tuple(write_rows(x, gather_rows(x, slots), start) for x in cache.k + cache.v)
    new_len = start + jnp.where(active, m + 1, 0)
    return KVCache(k=moved[:layers], v=moved[layers:], lengths=new_len)


def _hybrid_prefill(target: Qwen35Params, cfg: Qwen35Config, prompts: jax.Array, prompt_lens: jax.Array,
                    max_len: int, tap_layers: tuple[int, ...], impl: Impl, last_pre_norm: bool = False
                    ) -> tuple[jax.Array, jax.Array, HybridCache]:
    batch, width = prompts.shape
    cache = HybridCache.create(cfg, batch, max_len, target.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    lens = prompt_lens.astype(jnp.int32)
    out = qwen3_5.forward(target, cfg, prompts, positions, cache, lens, tap_layers=tap_layers,
                          logit_rows=(lens - 1)[:, None], attn_impl=impl.attention, last_tap_pre_norm=last_pre_norm)
    return out.logits[:, 0], out.taps, out.cache


def _hybrid_verify(target: Qwen35Params, cfg: Qwen35Config, tree: Tree, positions: jax.Array,
                   cache: HybridCache, tap_layers: tuple[int, ...], impl: Impl, last_pre_norm: bool = False
                   ) -> tuple[jax.Array, jax.Array, Qwen35Verified]:
    return qwen3_5.verify(target, cfg, tree.tokens, positions, tree.visible, tree.parents, cache,
                          tap_layers=tap_layers, attn_impl=impl.attention, last_tap_pre_norm=last_pre_norm)


def _hybrid_commit(verified: Qwen35Verified, start: jax.Array, path: jax.Array, m: jax.Array,
                   active: jax.Array, impl: Impl) -> HybridCache:
    del start, impl  # the verified cache holds the committed lengths
    return qwen3_5.commit(verified, path, jnp.where(active, m + 1, 0))


DENSE = TargetFamily(prefill=_dense_prefill, verify=_dense_verify, commit=_dense_commit)
HYBRID = TargetFamily(prefill=_hybrid_prefill, verify=_hybrid_verify, commit=_hybrid_commit)


def taps_pre_norm(dcfg: Any) -> bool:
    """Whether the drafter takes the target's last layer before its final norm: an MTP head with
    hidden_source "pre_norm" (a DFlash drafter's taps keep HF's meaning, after the norm)."""
    return isinstance(dcfg, mtp.MTPConfig) and dcfg.hidden_source == "pre_norm"


def target_family(cfg: ModelConfig | Qwen35Config) -> TargetFamily:
    """The family of a target from its config's type: DENSE (Qwen3, Llama) or HYBRID (Qwen3.5 / 3.6)."""
    if isinstance(cfg, Qwen35Config):
        return HYBRID
    if isinstance(cfg, ModelConfig):
        return DENSE
    raise ValueError(f"cfg must be a ModelConfig (dense target) or a Qwen35Config (Qwen3.5 / Qwen3.6 hybrid), "
                     f"got {type(cfg).__name__}")


# ----------------------------------------------------------------------------- stages

def drafter_pass(state: SpecState, target: ModelParams | Qwen35Params, dparams: Any, dcfg: Any,
                 s: SpecSettings) -> tuple[jax.Array, Any]:
    """Step 1: one drafter pass over [root, MASK x (bs-1)] -> (logits [batch, bs-1, vocab], the
    drafter's context cache with the block in its scratch slots, for the round to go on with)."""
    batch = state.root.shape[0]
    block = jnp.full((batch, s.block_size), dcfg.mask_token_id, jnp.int32).at[:, 0].set(state.root)
    hidden, draft_cache = dr.draft_with_cache(dparams, dcfg, target, state.draft_cache, block,
                                              state.cache.lengths, _block_limit(state, s) + 1)
    return dr.draft_logits(dparams, dcfg, target, hidden), draft_cache


def propose(state: SpecState, logits: jax.Array, s: SpecSettings) -> tuple[Draft, jax.Array]:
    """Step 2: the drafted chain (DFlash) or the best-`budget` tree (DDTree) from the drafter's
    logits [batch, bs-1, vocab]. Returns (draft, the round's remaining PRNG key)."""
    key, k_draft = jax.random.split(state.key)
    draft_probs = None
    if s.is_chain:
        if s.sampling.greedy:
            drafted = jnp.argmax(logits, -1).astype(jnp.int32)
        else:
            draft_probs = sampling_probs(logits, s.sampling)
            drafted = sample_from_probs(k_draft, draft_probs)
        tree = chain_tree(jnp.concatenate([state.root[:, None], drafted], 1), s.width)
    else:
        if s.sampling.greedy:
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        else:
            probs = sampling_probs(logits, s.sampling)
            log_probs = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
        with jax.named_scope("tree"):  # a scope of its own, so profiles can split it from the drafter pass
            tree = build_tree(log_probs, state.root, s.budget, s.width)
    return Draft(tree=tree, draft_probs=draft_probs, limit=_block_limit(state, s)), key


def draft_stage(state: SpecState, target: ModelParams | Qwen35Params, dparams: Any, dcfg: Any,
                s: SpecSettings) -> tuple[Draft, jax.Array, SpecState]:
    """Steps 1-2: one drafter pass, then the chain (DFlash) or the best-`budget` tree (DDTree).
    Returns (draft, the round's PRNG key, the state with the drafter's cache as the pass left it)."""
    if s.method == "mtp":
        return _mtp_draft_stage(state, target, dparams, dcfg, s)
    logits, draft_cache = drafter_pass(state, target, dparams, dcfg, s)
    draft, key = propose(state, logits, s)
    return draft, key, dataclasses.replace(state, draft_cache=draft_cache)


def _mtp_draft_stage(state: SpecState, target: ModelParams | Qwen35Params, mparams: mtp.MTPParams,
                     mcfg: mtp.MTPConfig, s: SpecSettings) -> tuple[Draft, jax.Array, SpecState]:
    """Steps 1-2 for an MTP head: `mtp_steps` chained steps, then their chain (drafted tokens
    sampled at T > 0, for the chain's rejection sampling) or the best-`budget` tree of their
    per-step distributions along the top-1 chain. The head's cache is left as it was."""
    key, k_draft = jax.random.split(state.key)
    sample_chain = s.is_chain and not s.sampling.greedy
    logits, drafted, probs = mtp.draft_chain(mparams, mcfg, target, state.draft_cache, state.root, s.mtp_steps,
                                             k_draft, s.sampling, sample_chain)
    if s.is_chain:
        tree = chain_tree(jnp.concatenate([state.root[:, None], drafted], 1), s.width)
        return Draft(tree=tree, draft_probs=probs, limit=_block_limit(state, s)), key, state
    draft, _ = propose(dataclasses.replace(state, key=k_draft), logits, s)
    return draft, key, state


def verify_stage(state: SpecState, draft: Draft, target: ModelParams | Qwen35Params,
                 cfg: ModelConfig | Qwen35Config, dcfg: Any, impl: Impl = Impl()
                 ) -> tuple[jax.Array, jax.Array, KVCache | Qwen35Verified]:
    """Step 3: the target over all tree slots at positions L + depth, K/V to slots L..L+W-1.
    Returns (logits [batch, W, vocab], taps [batch, W, taps * embed], what `commit_stage` takes)."""
    tree = draft.tree
    positions = state.cache.lengths[:, None] + tree.depths
    return target_family(cfg).verify(target, cfg, tree, positions, state.cache, tuple(dcfg.target_layer_ids), impl,
                                     taps_pre_norm(dcfg))


def accept_stage(key: jax.Array, draft: Draft, logits: jax.Array, s: SpecSettings
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Step 4 -> (path [batch, bs], m [batch], bonus [batch])."""
    if s.sampling.greedy:
        choice = jnp.argmax(logits, -1).astype(jnp.int32)
        return follow_target(draft.tree, choice, s.block_size - 1, draft.node_ok)
    if s.is_chain:  # DFlash and MTP chains: rejection sampling against the drafted tokens' probabilities
        target_probs = sampling_probs(logits, s.sampling)
        return chain_rejection(key, draft.tree.tokens, target_probs, draft.draft_probs, draft.limit)
    # DDTree at T > 0: an independent target sample at every node; descending when a child
    # matches keeps each emitted token an exact target sample.
    choice = sample(key, logits, s.sampling)
    return follow_target(draft.tree, choice, s.block_size - 1, draft.node_ok)


def compact_in_one_launch(cache: KVCache, bs: int, impl: Impl = Impl(), backend: str | None = None) -> bool:
    """Whether the commit moves the accepted K/V with `kv_compact` (one launch for all 2 x layers
    buffers, where XLA takes a gather and a row write per buffer): on a GPU (`backend`, default
    `jax.default_backend()`), without a mesh (as `model.epilogue_schedule`; under one the
    buffers are sharded and stay on XLA's per-buffer path), with all buffers of one shape and
    dtype (`kv_compact.applies`), and not when `impl` keeps the round in XLA
    (`Impl.round_kernels`)."""
    if not impl.round_kernels:
        return False
    if (backend or jax.default_backend()) != "gpu" or mesh_sizes() != (1, 1):
        return False
    return kv_compact.applies(cache.k + cache.v, bs)


def _context_epilogue(impl: Impl) -> str:
    """`append_context`'s epilogue: its kernel where it applies ("auto"), XLA's kernels where
    `impl` keeps the round in XLA (`Impl.round_kernels`), as the K/V compaction does."""
    return "auto" if impl.round_kernels else "xla"


def commit_stage(state: SpecState, draft: Draft, path: jax.Array, m: jax.Array, bonus: jax.Array,
                 taps: jax.Array, verified: KVCache | Qwen35Verified, cfg: ModelConfig | Qwen35Config,
                 dparams: Any, dcfg: Any, s: SpecSettings, key: jax.Array, impl: Impl = Impl(), *,
                 target: ModelParams | Qwen35Params | None = None) -> SpecState:
    """Step 5: commit the accepted path in the target's cache, extend the drafter context, emit tokens.

    verified: `verify_stage`'s cache result; a finished sequence (`state.done`) commits nothing.
    target: the target's weights; an MTP head (method "mtp") needs its embedding, others do not."""
    batch, bs = path.shape
    active = ~state.done
    start = state.cache.lengths
    cache = target_family(cfg).commit(verified, start, path, m, active, impl)
    # The drafter's context grows by the target features of the root and accepted nodes.
    path_taps = gather_rows(taps, path)
    if s.method == "mtp":
        if target is None:
            raise ValueError("commit_stage: method 'mtp' needs target= (the head embeds the accepted tokens)")
        path_tokens = jnp.take_along_axis(draft.tree.tokens, path, 1)
        draft_cache = mtp.commit(dparams, dcfg, target, state.draft_cache, path_tokens, path_taps, m, active)
    else:
        positions = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        draft_cache = dr.append_context(dparams, dcfg, state.draft_cache, path_taps, positions,
                                        jnp.where(active, m + 1, 0), epilogue=_context_epilogue(impl))
    # Emitted this round: the accepted drafted tokens, then the bonus.
    j = jnp.arange(bs, dtype=jnp.int32)[None]
    nxt = jnp.take_along_axis(draft.tree.tokens, path, 1)
    shifted = jnp.concatenate([nxt[:, 1:], nxt[:, -1:]], 1)  # token of the node at depth j + 1
    emitted = jnp.where(j < m[:, None], shifted, jnp.where(j == m[:, None], bonus[:, None], PAD))
    produced = jnp.minimum(m + 1, s.max_new_tokens - state.count)
    stop_hit = is_stop(emitted, s.stop_tokens) & (j < produced[:, None])
    first_stop = jnp.argmax(stop_hit, axis=1).astype(jnp.int32)
    stopped = jnp.any(stop_hit, axis=1)
    produced = jnp.where(stopped, first_stop + 1, produced)
    produced = jnp.where(active, produced, 0)
    cols = jnp.where(j < produced[:, None], state.count[:, None] + j, s.max_new_tokens)
    out = state.out.at[jnp.arange(batch)[:, None], cols].set(emitted, mode="drop")
    count = state.count + produced
    accepted = state.accepted.at[jnp.arange(batch), jnp.where(active, state.rounds, s.max_new_tokens)].set(
        produced, mode="drop")
    done = state.done | stopped | (count >= s.max_new_tokens)
    return SpecState(cache=cache, draft_cache=draft_cache, root=jnp.where(active, bonus, state.root),
                     out=out, count=count, done=done, accepted=accepted,
                     rounds=state.rounds + active.astype(jnp.int32), key=key)


def spec_round(state: SpecState, target: ModelParams | Qwen35Params, cfg: ModelConfig | Qwen35Config,
               dparams: Any, dcfg: Any, s: SpecSettings, impl: Impl = Impl()) -> SpecState:
    """One fused round for the whole batch.

    Each stage runs under a named scope ("draft", "tree", "verify", "accept", "commit") so that a
    profile of the fused program can attribute device time to stages (`bench.profile`).
    """
    with jax.named_scope("draft"):
        draft, key, state = draft_stage(state, target, dparams, dcfg, s)
    with jax.named_scope("verify"):
        logits, taps, cache = verify_stage(state, draft, target, cfg, dcfg, impl)
    with jax.named_scope("accept"):
        key, k_accept = jax.random.split(key)
        path, m, bonus = accept_stage(k_accept, draft, logits, s)
    with jax.named_scope("commit"):
        return commit_stage(state, draft, path, m, bonus, taps, cache, cfg, dparams, dcfg, s, key, impl, target=target)


# ----------------------------------------------------------------------------- generation

def start_state(target: ModelParams | Qwen35Params, cfg: ModelConfig | Qwen35Config, dparams: Any, dcfg: Any,
                prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array, max_len: int, s: SpecSettings,
                impl: Impl = Impl()) -> SpecState:
    """Prefill the target, seed the drafter context with the prompt's features, emit token 1."""
    batch, width = prompts.shape
    need = width + s.max_new_tokens + s.cache_slack()
    if need > max_len:
        raise ValueError(f"max_len {max_len} is too small: prompts of width {width} + max_new_tokens "
                         f"{s.max_new_tokens} + {s.cache_slack()} scratch slots need {need}")
    dtype = target.embed.dtype
    logits, taps, cache = target_family(cfg).prefill(target, cfg, prompts, prompt_lens, max_len,
                                                     tuple(dcfg.target_layer_ids), impl, taps_pre_norm(dcfg))
    key, sub = jax.random.split(key)
    first = sample(sub, logits, s.sampling)
    if s.method == "mtp":
        draft_cache = mtp.prefill(dparams, dcfg, target, mtp.MTPCache.create(cfg, batch, max_len, dtype), prompts,
                                  prompt_lens, taps, first)
    else:
        draft_cache = dr.DraftCache.create(dcfg, batch, max_len, dtype)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        draft_cache = dr.append_context(dparams, dcfg, draft_cache, taps, positions, prompt_lens,
                                        epilogue=_context_epilogue(impl))
    out = jnp.full((batch, s.max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    return SpecState(cache=cache, draft_cache=draft_cache, root=first, out=out,
                     count=jnp.ones((batch,), jnp.int32),
                     done=is_stop(first, s.stop_tokens) | (s.max_new_tokens <= 1),
                     accepted=jnp.zeros((batch, s.max_new_tokens), jnp.int32),
                     rounds=jnp.zeros((batch,), jnp.int32), key=key)


def _generate(target: ModelParams | Qwen35Params, cfg: ModelConfig | Qwen35Config, dparams: Any, dcfg: Any,
              prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array, *, settings: SpecSettings,
              max_len: int, impl: Impl = Impl()) -> Generation:
    state = start_state(target, cfg, dparams, dcfg, prompts, prompt_lens, key, max_len, settings, impl)

    def rounds(st: SpecState) -> SpecState:
        # A round of a finished sequence commits and emits nothing (`commit_stage`'s `active`).
        return jax.lax.fori_loop(0, impl.rounds_per_check,
                                 lambda _, s: spec_round(s, target, cfg, dparams, dcfg, settings, impl), st)

    state = jax.lax.while_loop(lambda st: ~jnp.all(st.done), rounds, state)
    return Generation(tokens=state.out, num_tokens=state.count, accepted=state.accepted,
                      rounds=state.rounds)


_STATIC = ("cfg", "dcfg", "settings", "max_len", "impl")
# XLA's DotMerger concatenates weights that share an input inside the round loop: each layer's
# q/k/v at Qwen3-8B, budget 256 (a 48 MB copy per layer per round; with the pass off a DDTree(256)
# round took 15.66 ms instead of 16.20 on an H200), and a Qwen3.6-27B hybrid's GDN input
# projections in the DFlash round (5.4 of its 30.3 ms on an H100, BENCHMARKS.md). Dense DFlash
# rounds showed no gain from the pass, so every speculative program compiles with it off.
DOT_MERGER_OFF = {"xla_gpu_dot_merger_threshold_mb": 0}
# XLA's command buffers for every command type (`generate.COMMAND_BUFFERS_ALL`), the loop types
# included: a DDTree(256) round as decoding runs it (`bench/decode_loop.py`, 63-127 rounds, in turns)
# took 10.33 / 10.58 / 10.54 / 10.12 / 10.57 ms with them against 10.52 / 10.78 / 10.75 / 10.49 /
# 10.95 ms with command buffers off, on five H200s, the same tokens; without the loop types 10.70
# against 10.78; DFlash (block 16, 127 rounds) 5.81 ms against 6.10 with XLA's default command
# types and 6.03 with none (BENCHMARKS.md). spec_round's fori_loop, which reads nothing back, is
# as fast either way.
SPEC_COMPILER_OPTIONS = {**DOT_MERGER_OFF, **COMMAND_BUFFERS_ALL}
# The same without graphs, for programs a profiler must see into (a trace cannot attribute the
# kernels of a graph to their HLO instructions).
SPEC_PROFILED_OPTIONS = {**DOT_MERGER_OFF, **COMMAND_BUFFERS_OFF}
_generate_jit = jax.jit(_generate, static_argnames=_STATIC, compiler_options=SPEC_COMPILER_OPTIONS)


def speculative_program(settings: SpecSettings) -> Any:
    """The jitted generation (same signature as `generate_speculative`); one program serves every
    method, compiled for `settings` as a static argument."""
    del settings
    return _generate_jit


def generate_speculative(target: ModelParams | Qwen35Params, cfg: ModelConfig | Qwen35Config, dparams: Any,
                         dcfg: Any, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array, *,
                         settings: SpecSettings, max_len: int, impl: Impl = Impl()) -> Generation:
    """DFlash, DDTree or MTP (dparams, dcfg: `mtp.MTPParams`, `mtp.MTPConfig`) generation for
    right-padded prompts [batch, P], all on device (one jit).

    target, cfg: a dense target (ModelParams, ModelConfig) or a Qwen3.5 / Qwen3.6 hybrid
    (Qwen35Params, Qwen35Config), whose GDN states are rolled back to each round's accepted
    path exactly (`qwen3_5.commit`). settings: what is decoded; impl: how (`impl.Impl`; static,
    like settings; `impl.attention` serves a hybrid's attention layers as a dense target's).
    """
    return speculative_program(settings)(target, cfg, dparams, dcfg, prompts, prompt_lens, key,
                                         settings=settings, max_len=max_len, impl=impl)
