"""Draft trees: DDTree's best-first tree and DFlash's chain, built on device with static shapes.

A tree is stored per sequence as `W` node slots. Slot 0 is the root (the last bonus token, not
yet in the target cache); slots 1..n are drafted nodes ordered so that a parent always precedes
its children; the remaining slots are padding (`valid` False). The verify step runs the target
over all `W` slots with the `visible` mask as tree attention; the accept step walks down from
the root following the target's choice.

DDTree (arXiv 2604.12989) grows the tree with a best-first heap: pop the most probable prefix,
push its next-ranked sibling and its first child, until `budget` nodes are taken. Because the
drafter's per-depth distributions do not depend on the parent, the heap's result is exactly the
`budget` prefixes with the highest summed log-probability, which `build_tree` computes with a
few top-k selections instead of a data-dependent loop.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The tree width is 1 + budget rounded up to a multiple of this. 1: no padding, because the
# verify's kernels pad their own rows (the Hopper kernel to 128-row blocks of W x group rows,
# the Triton kernel by masking) and every padded node is a row of every GEMM. On an H200,
# DDTree(256) at W 257 took 10.72-10.95 ms against 10.99-11.38 at W 272 (row block 16), and
# budgets 16 / 64 / 512 were as fast or faster at 1 + budget (BENCHMARKS.md, nineteenth and
# twentieth sessions).
ROW_BLOCK = 1
# Vocabulary chunk of the two-stage top_k (`chunked_top_k`); 0 = one top_k over the whole row.
TOP_K_CHUNK = 2048
# Longest row that the tree's top-k selections (per depth and over all depths) rank with
# `ranked_top_k` instead of `lax.top_k`: ranking compares every pair, m * m per row.
RANK_TOP_K_MAX = 4096
# The vocabulary top-k's preselection (`preselected_top_k`) by default: each level cuts a row of
# length n into about fanout * k chunks and keeps the k with the highest maxima (n / fanout
# entries), ranking about fanout * k maxima; the default fan-out keeps that near
# PRESELECT_RANKED (within 2..PRESELECT_FANOUT), and rows of k > PRESELECT_MAX_K take
# `chunked_top_k`. Measured on the H200 at [15, 151936] (BENCHMARKS.md, eighteenth session),
# kernel time per top-k, chunked / fan-out 2 / 4 / 8 / 16, us: k 16: 285 / 83 / 54 / 37 / 43;
# k 64: 183 / - / 67 / 52 / 53; k 256: 212 / 113 / 103 / 164 / 262; k 512: 296 / 159 / 217 / 374.
PRESELECT_FANOUT = 8
PRESELECT_RANKED = 1024
PRESELECT_MAX_K = 512
# `radix_top_k`'s key bits per pass: ceil(32 / RADIX_BITS) passes over the row, each counting
# 2**RADIX_BITS - 1 thresholds.
RADIX_BITS = 4
# `build_tree`'s vocabulary top-k on a GPU by default: `radix_top_k` (preselect -RADIX_PRECHUNK)
# when True, else `preselected_top_k`. Off: at [15, 151936] on the H200 (jax 0.11.2), kernel us
# per top-k, preselect's default / radix at prechunk 1 / 2 / 4: k 16: 36 / 148 / 123 / 94; k 64:
# 52 / 152 / 128 / 95; k 256: 103 / 268 / 236 / 106; k 512: 217 (fan-out 4) / 473 / 178 / 135.
RADIX_BY_DEFAULT = False
# `radix_top_k`'s preselection chunk by default: 4 keeps its passes on a quarter of the row.
RADIX_PRECHUNK = 4
# `build_tree`'s `preselect` value for the vocabulary top-k as two Triton kernels
# (`kernel_top_k`, pallas_kernels/top_k.py).
KERNEL_PRESELECT = "kernel"
# `build_tree`'s vocabulary top-k on a GPU by default: `kernel_top_k` when True (before
# RADIX_BY_DEFAULT). On an H200 the tree's kernels took 0.15 against 0.23 ms a DDTree(256) round
# and 0.27 against 0.39 at budget 512 (BENCHMARKS.md, twenty-ninth session).
KERNEL_TOP_K_BY_DEFAULT = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A batch of draft trees, `W` node slots per sequence.

    tokens:  [batch, W] int32    node tokens; slot 0 is the root (last bonus token); padding 0
    parents: [batch, W] int32    parent slot, always < the node's own slot; -1 for the root and
                                 for padding
    depths:  [batch, W] int32    root 0, a node = its parent + 1; padding 0
    valid:   [batch, W] bool     False on padding slots
    visible: [batch, W, W] bool  visible[b, i, j]: slot j is an ancestor-or-self of slot i (both
                                 valid); a padding row sees only itself, so no attention row is
                                 empty, and padding is never accepted
    scores:  [batch, W] float32  summed draft log-prob of the node's path (root 0, padding -inf;
                                 all 0 for a chain)
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    valid: jax.Array
    visible: jax.Array
    scores: jax.Array

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_int(name: str, value: Any, minimum: int) -> int:
    # Sizes decide array shapes, so they must be Python ints known at trace time.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a Python int (static), got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def tree_width(budget: int, row_block: int = ROW_BLOCK) -> int:
    """Slots for a root plus `budget` nodes: 1 + budget rounded up to a multiple of `row_block`.

    Not the next power of two: verify cost grows with the width, and e.g. budget 256 would
    otherwise pay for 512 rows.
    """
    budget = _check_int("budget", budget, 1)
    row_block = _check_int("row_block", row_block, 1)
    return _round_up(1 + budget, row_block)


def ancestors_visible(parents: jax.Array, valid: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Ancestor-or-self mask from parent pointers.

    parents: [batch, W] int32 (-1 or out of range = no parent); valid: [batch, W] bool.
    max_depth: static bound on any node's depth (default W - 1); the loop runs
    ceil(log2(max_depth + 1)) times, so a tight bound makes it cheaper.
    Returns visible: [batch, W, W] bool, visible[b, i, j] = j is an ancestor-or-self of i and both
    are valid; padding rows see only themselves.
    """
    if parents.ndim != 2:
        raise ValueError(f"parents must be [batch, width], got shape {parents.shape}")
    if valid.shape != parents.shape:
        raise ValueError(f"valid must have the shape of parents {parents.shape}, got {valid.shape}")
    width = parents.shape[1]
    max_depth = width - 1 if max_depth is None else _check_int("max_depth", max_depth, 0)
    return _ancestors_visible(parents, valid, max_depth=max_depth)


def _ancestors_visible_impl(parents: jax.Array, valid: jax.Array, max_depth: int) -> jax.Array:
    width = parents.shape[1]
    valid = valid.astype(bool)
    slot = jnp.arange(width, dtype=jnp.int32)
    parents = parents.astype(jnp.int32)
    in_range = (parents >= 0) & (parents < width)
    safe = jnp.where(in_range, parents, 0)
    parent_valid = jnp.take_along_axis(valid, safe, axis=1)
    # Roots, padding and broken links point at themselves, so repeated jumps stop there.
    jump = jnp.where(in_range & valid & parent_valid, safe, slot[None, :])

    # Pointer doubling: after k rounds `seen` holds ancestors at distance < 2**k and `jump` the
    # ancestor at distance 2**k (clamped at the root).
    seen = jnp.broadcast_to(slot[:, None] == slot[None, :], (parents.shape[0], width, width))
    rows = jax.vmap(lambda m, idx: m[idx])
    for _ in range(max(0, math.ceil(math.log2(max_depth + 1)))):
        seen = seen | rows(seen, jump)
        jump = jnp.take_along_axis(jump, jump, axis=1)

    both_valid = valid[:, :, None] & valid[:, None, :]
    return (seen & both_valid) | (slot[:, None] == slot[None, :])


_ancestors_visible = jax.jit(_ancestors_visible_impl, static_argnames=("max_depth",))


def _sanitize(log_probs: jax.Array) -> jax.Array:
    """float32 log-probs with NaN -> -inf and anything >= 0 (incl. -0.0) -> +0.0.

    Why: prefix closure needs every child's score <= its parent's, and top_k orders floats
    totally (-0.0 < +0.0, NaN above everything), so these values could otherwise let a child
    outrank its parent. A no-op on proper log-probs except for -0.0.
    """
    lp = log_probs.astype(jnp.float32)
    return jnp.where(lp < 0.0, lp, jnp.where(jnp.isnan(lp), -jnp.inf, 0.0))


def _candidate_pairs(n_parents: int, n_tokens: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent rank i, token rank j) pairs that can be among a depth's best `budget` nodes.

    Child (i, j) is outranked by every (i', j') with i' <= i, j' <= j (score at least as high,
    and earlier in the tie-break), so it can only be in the top `budget` if (i+1)(j+1) <= budget:
    about budget * ln(budget) candidates instead of budget**2. Ordered lexicographically, which
    is the tie-break order (lower parent rank, then lower token rank).
    """
    i, j = np.meshgrid(np.arange(n_parents), np.arange(n_tokens), indexing="ij")
    keep = (i + 1) * (j + 1) <= budget
    return i[keep].astype(np.int32), j[keep].astype(np.int32)


def _check_draft_inputs(log_probs: Any, root_tokens: Any) -> None:
    if getattr(log_probs, "ndim", None) != 3:
        raise ValueError("log_probs must be [batch, depth, vocab], got shape "
                         f"{getattr(log_probs, 'shape', None)}")
    if getattr(root_tokens, "ndim", None) != 1:
        raise ValueError(f"root_tokens must be [batch], got shape {getattr(root_tokens, 'shape', None)}")
    if root_tokens.shape[0] != log_probs.shape[0]:
        raise ValueError(f"root_tokens batch {root_tokens.shape[0]} != log_probs batch "
                         f"{log_probs.shape[0]}")
    if log_probs.shape[1] < 1 or log_probs.shape[2] < 1:
        raise ValueError(f"log_probs needs depth >= 1 and vocab >= 1, got shape {log_probs.shape}")
    if not jnp.issubdtype(log_probs.dtype, jnp.floating):
        raise ValueError(f"log_probs must be floating point, got {log_probs.dtype}")
    if not jnp.issubdtype(root_tokens.dtype, jnp.integer):
        raise ValueError(f"root_tokens must be integer, got {root_tokens.dtype}")


def build_tree(log_probs: jax.Array, root_tokens: jax.Array, budget: int,
               width: int | None = None, top_k_chunk: int = TOP_K_CHUNK,
               rank_max: int = RANK_TOP_K_MAX, preselect: int | str | None = None) -> Tree:
    """DDTree: the root plus the `budget` most probable draft prefixes.

    log_probs:   [batch, depth, vocab] float, log q_d for draft depths 1..depth (the drafter's
                 per-depth distributions; they do not depend on the parent). Must be <= 0;
                 larger values are treated as 0 and NaN as -inf.
    root_tokens: [batch] int, the last bonus token of each sequence.
    budget:      static int >= 1, drafted nodes per tree (the root is extra).
    width:       static int >= 1 + budget, node slots (default `tree_width(budget)`).
    top_k_chunk: static int >= 0, the vocabulary chunk of `chunked_top_k` (0: one top_k);
                 the tree is the same for every value.
    rank_max:    static int >= 0, the longest row the tree's own top-k selections rank with
                 `ranked_top_k` (longer ones use lax.top_k); the tree is the same for every value.
    preselect:   static int, the fan-out of the vocabulary top-k's preselection
                 (`preselected_top_k`); 0 takes `chunked_top_k`; a negative -c takes
                 `radix_top_k` with prechunk c (-1: none); KERNEL_PRESELECT ("kernel") takes
                 `kernel_top_k` (Triton kernels; interpreted off a GPU); None:
                 `preselect_fanout`'s default for the backend. The tree is the same for every
                 value.

    Node scores are summed log-probs along the path. Ties are broken by lower depth, then by
    rank within the depth (lower parent rank, then lower token rank, token ranks coming from a
    stable top-k over the vocabulary), so a parent always beats an equal-scoring child and the
    selection is prefix-closed. If fewer than `budget` prefixes exist (tiny vocabulary x depth),
    the rest are padding. Output slots are ordered by depth, then by rank within the depth.
    """
    _check_draft_inputs(log_probs, root_tokens)
    budget = _check_int("budget", budget, 1)
    width = tree_width(budget) if width is None else _check_int("width", width, 1 + budget)
    top_k_chunk = _check_int("top_k_chunk", top_k_chunk, 0)
    rank_max = _check_int("rank_max", rank_max, 0)
    preselect = preselect_fanout(preselect, min(budget, log_probs.shape[2]))
    return _build_tree(log_probs, root_tokens, budget=budget, width=width, top_k_chunk=top_k_chunk,
                       rank_max=rank_max, preselect=preselect)


def chunked_top_k(rows: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values and indices, same order and tie-break) in two stages.

    rows: [n, length]; k <= length. Stage 1 takes the top k of every `chunk` entries, stage 2
    the top k of those n_chunks * k candidates: each of the row's top k is among its chunk's
    top k, so the result is exact. Ties keep top_k's stable order (lower index first) because
    candidates are laid out chunk by chunk, each chunk in its own stable order, so among equal
    values a lower candidate position means a lower index.
    Why: on GPU XLA sorts the whole row for a large k; at [15, 151936] and k = 256 that sort
    took 0.55 ms of a 13.2 ms DDTree(256) round (BENCHMARKS.md, eleventh session). Sorting
    2048-long rows and one 19200-long row per depth is cheaper.
    Falls back to one top_k when chunk is 0, smaller than k, or the row is short.
    """
    n, length = rows.shape
    if chunk <= 0 or chunk < k or length <= 2 * chunk:
        return jax.lax.top_k(rows, k)
    n_chunks = -(-length // chunk)
    # Padding is -inf at the highest indices: a real -inf entry always ranks before it.
    padded = jnp.pad(rows, ((0, 0), (0, n_chunks * chunk - length)), constant_values=-jnp.inf)
    local_val, local_idx = jax.lax.top_k(padded.reshape(n * n_chunks, chunk), k)
    cand_val = local_val.reshape(n, n_chunks * k)
    cand_idx = (local_idx.reshape(n, n_chunks, k)
                + (jnp.arange(n_chunks, dtype=local_idx.dtype) * chunk)[None, :, None]).reshape(n, n_chunks * k)
    val, pos = jax.lax.top_k(cand_val, k)
    return val, jnp.take_along_axis(cand_idx, pos, axis=1)


def _order_keys(values: jax.Array) -> jax.Array:
    """int32 keys whose signed order is top_k's order on the float values.

    top_k orders floats totally: -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN. A float's
    bits read as a signed int follow that order for sign bit 0 and the reverse for sign bit 1,
    so flipping the 31 low bits of the negative ones makes the whole order match.
    """
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _stable_ranks(values: jax.Array) -> jax.Array:
    """rank[b, c]: the position of values[b, c] in top_k's order (higher first, ties by index).

    values: [n, m] float. rank = #{c' : v[c'] > v[c]} + #{c' < c : v[c'] == v[c]}, a permutation
    of 0..m-1 per row. The [n, m, m] compare feeds straight into the sum, for XLA to fuse into
    one reduction on GPU; XLA's CPU backend writes the compare out as int32 first (59 MB per
    row at m = 3840) and reduces it in a tree of reduce-windows.
    """
    return _key_ranks(_order_keys(values))


def _key_ranks(key: jax.Array) -> jax.Array:
    """`_stable_ranks` of int32 order keys [n, m] (higher key first, ties by lower index)."""
    m = key.shape[1]
    idx = jnp.arange(m, dtype=jnp.int32)
    other, this = key[:, None, :], key[:, :, None]                    # c' on the last axis
    ahead = (other > this) | ((other == this) & (idx[None, None, :] < idx[None, :, None]))
    return jnp.sum(ahead, axis=2, dtype=jnp.int32)


def _check_rank_input(values: Any, k: int) -> tuple[int, int]:
    if getattr(values, "ndim", None) != 2:
        raise ValueError(f"values must be [n, m], got shape {getattr(values, 'shape', None)}")
    if not jnp.issubdtype(values.dtype, jnp.floating) or jnp.dtype(values.dtype).itemsize > 4:
        raise ValueError(f"values must be float32 or narrower, got {values.dtype}")
    k = _check_int("k", k, 0)
    if k > values.shape[1]:
        raise ValueError(f"k must be <= the row length {values.shape[1]}, got {k}")
    return values.shape[1], k


def ranked_top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(values, k)` (values and int32 indices, same order and tie-break) by ranking.

    values: [n, m] float (float32 or narrower); k: static int <= m. Every entry's rank in top_k's
    order (`_stable_ranks`: higher value first, equal values by lower index, floats ordered
    totally as top_k does, -0.0 below +0.0) comes from one [n, m, m] compare-and-sum; output
    position r holds the index whose rank is r, found by a [n, k, m] reduction, and its value.
    Why: on GPU XLA lowers a small top_k with k = 256 to a sort of several single-SM kernels;
    two fused reductions cost less when m is small. The work grows as m * m, so callers use it
    only up to `RANK_TOP_K_MAX` (`build_tree`'s rank_max).
    """
    _, k = _check_rank_input(values, k)
    indices = _positions_of_ranks(_stable_ranks(values), k)
    return jnp.take_along_axis(values, indices, axis=1), indices


def _positions_of_ranks(rank: jax.Array, k: int) -> jax.Array:
    """[n, k] int32: the index whose rank is 0, 1, ..., k-1, from ranks [n, m] (a permutation)."""
    position = jnp.arange(k, dtype=jnp.int32)
    idx = jnp.arange(rank.shape[1], dtype=jnp.int32)
    # Ranks are a permutation, so exactly one c matches each position.
    return jnp.sum(jnp.where(rank[:, None, :] == position[None, :, None], idx[None, None, :], 0),
                   axis=2, dtype=jnp.int32)


def _ranked_top_k_set(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The indices of `lax.top_k(values, k)` sorted ascending, without a sort.

    values: [n, m] float; k: static int <= m. Returns (chosen [n, k] int32 ascending, slot
    [n, m] int32: 1 + the position of c in `chosen`, 0 where c is not chosen). The chosen set is
    {c : rank[c] < k}; with count[c] = #{chosen c' <= c} (a cumulative sum), the p-th chosen
    index is #{c : count[c] <= p}.
    """
    _, k = _check_rank_input(values, k)
    return _top_k_set_of_ranks(_stable_ranks(values), k)


def _top_k_set_of_ranks(rank: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`_ranked_top_k_set` from the ranks [n, m] (a permutation of 0..m-1 per row)."""
    taken = rank < k                                                          # [n, m]
    count = jnp.cumsum(taken, axis=1, dtype=jnp.int32)
    position = jnp.arange(k, dtype=jnp.int32)
    chosen = jnp.sum(count[:, None, :] <= position[None, :, None], axis=2, dtype=jnp.int32)
    return chosen, jnp.where(taken, count, 0)


def _preselect(keys: jax.Array, indices: jax.Array, k: int, chunk: int, rank_max: int
               ) -> tuple[jax.Array, jax.Array]:
    """One preselection level: the k chunks of `chunk` entries with the highest maxima.

    keys: [n, m] int32 order keys (`_order_keys`); indices: [n, m] int32, ascending along each
    row. Returns the chosen chunks' keys and indices, [n, k * chunk] each, chunk by chunk in
    ascending order, so the indices stay ascending and the row's top k (higher key first, ties
    by lower index) is among them: an entry left out lies in a chunk that k chosen chunks
    outrank, and each of their maxima outranks the entry (a higher key, or an equal one at a
    lower index). Padding takes the lowest key, so it ranks after every real entry and is never
    among the k (k <= the real entries).
    """
    n, m = keys.shape
    n_chunks = -(-m // chunk)
    pad = ((0, 0), (0, n_chunks * chunk - m))
    blocks = jnp.pad(keys, pad, constant_values=np.iinfo(np.int32).min).reshape(n, n_chunks, chunk)
    block_idx = jnp.pad(indices, pad, constant_values=np.iinfo(np.int32).max).reshape(n, n_chunks, chunk)
    best = jnp.max(blocks, axis=2)                                               # [n, n_chunks]
    if n_chunks <= rank_max:
        chosen, _ = _top_k_set_of_ranks(_key_ranks(best), k)
    else:
        chosen = jnp.sort(jax.lax.top_k(best, k)[1], axis=1)

    def take(x: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x, chosen[:, :, None], axis=1).reshape(n, k * chunk)

    return take(blocks), take(block_idx)


def preselected_top_k(rows: jax.Array, k: int, fanout: int = PRESELECT_FANOUT,
                      rank_max: int = RANK_TOP_K_MAX) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values and int32 indices, same order and tie-break), for long rows.

    rows: [n, length] float32 or narrower; k: static int <= length; fanout: static int >= 2.
    While a row holds at least 2 * fanout * k candidates, a preselection level (`_preselect`)
    cuts it into chunks of length // (fanout * k) (longer where that makes more than rank_max
    chunks) and keeps the k chunks with the highest maxima. The candidates left are ranked
    (`ranked_top_k`'s method) when at most `rank_max` long, else go to one lax.top_k; the chunk
    maxima likewise. All of it works on int32 keys in top_k's total order of floats
    (`_order_keys`).
    Why: at [15, 151936] and k = 256 (DDTree(256), Qwen3's vocabulary) XLA sorts each
    2048-entry chunk of `chunked_top_k` on GPU: 0.13 ms of a 0.37 ms tree. A level is a max over
    chunks and a ranking of about a thousand maxima: the top-k took 103 us against 212, and
    DDTree(256) rounds 11.23 ms against 11.48 (H200, BENCHMARKS.md, eighteenth session).
    """
    _, k = _check_rank_input(rows, k)
    fanout = _check_int("fanout", fanout, 2)
    n, length = rows.shape
    keys = _order_keys(rows)
    indices = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length))
    while keys.shape[1] // (fanout * k) >= 2:
        chunk = keys.shape[1] // (fanout * k)
        if rank_max >= 2 * k:  # chunks long enough for their maxima to be ranked, not sorted
            chunk = max(chunk, -(-keys.shape[1] // rank_max))
        keys, indices = _preselect(keys, indices, k, chunk, rank_max)
    if keys.shape[1] <= rank_max:
        pos = _positions_of_ranks(_key_ranks(keys), k)
    else:
        pos = jax.lax.top_k(keys, k)[1]
    chosen = jnp.take_along_axis(indices, pos, axis=1)
    return jnp.take_along_axis(rows, chosen, axis=1), chosen


def _unsigned_keys(keys: jax.Array) -> jax.Array:
    """uint32 keys in the order of the int32 order keys (`_order_keys`): the sign bit flipped.

    Why unsigned: a radix pass adds offsets of up to 2**32 - 2**s to the interval's lower end,
    which fits an unsigned key but would overflow a signed one.
    """
    return jax.lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(0x80000000)


def _counts_at_least(ukeys: jax.Array, thresholds: list[jax.Array], variadic: bool = True
                     ) -> list[jax.Array]:
    """[n] int32 per threshold t ([n] uint32): #{c : ukeys[:, c] >= t}.

    variadic: one reduce with an operand per threshold, so the GPU kernel reads each key once and
    keeps a count per threshold; otherwise a [n, T, m] compare summed over m, which XLA reduces
    row by row, reading the keys once per threshold.
    """
    if variadic:
        ops = tuple((ukeys >= t[:, None]).astype(jnp.int32) for t in thresholds)
        return list(jax.lax.reduce(ops, (jnp.int32(0),) * len(ops),
                                   lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,)))
    thr = jnp.stack(thresholds, axis=1)                                           # [n, T]
    counts = jnp.sum(ukeys[:, None, :] >= thr[:, :, None], axis=2, dtype=jnp.int32)
    return [counts[:, j] for j in range(len(thresholds))]


def _radix_kth_largest(ukeys: jax.Array, k: int, bits: int, variadic: bool = True) -> jax.Array:
    """[n] uint32: the k-th largest key of each row (1 <= k <= m), found `bits` bits per pass.

    ukeys: [n, m] uint32. Invariant: #{keys >= lo} >= k > #{keys >= lo + 2**s}, so the k-th
    largest key lies in [lo, lo + 2**s). A pass counts the keys at or above the 2**b - 1 inner
    thresholds lo + j * 2**(s - b) and moves lo to the highest one still counting k (counts
    fall as j grows). It starts at lo = 0, s = 32 and ends at s = 0, where lo is the key: a fixed
    ceil(32 / bits) passes, each one reduction over the row and a tiny one over its counts, with
    no data-dependent control flow (a lax.cond or while_loop on data would sync with the host).
    Why not narrow the start from the row's bounds first: the passes must cover the worst case
    (keys across the whole range, e.g. a NaN or +-inf), so a data-dependent start saves none.
    """
    n = ukeys.shape[0]
    lo = jnp.zeros((n,), jnp.uint32)
    shift = 32
    while shift > 0:
        step = max(shift - bits, 0)
        thresholds = [lo + jnp.uint32(j << step) for j in range(1, 1 << (shift - step))]
        # Summed elementwise, not stacked and reduced: XLA can then fuse the update into the
        # counting reduction's last kernel instead of launching two more per pass.
        j = sum((c >= k).astype(jnp.uint32) for c in _counts_at_least(ukeys, thresholds, variadic))
        lo = lo + (j << jnp.uint32(step))
        shift = step
    return lo


def _prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive cumulative sum of [n, m] int32 along the row, in two levels of compare-sums.

    Why not jnp.cumsum: on GPU it lowers to a reduce-window over the whole row, which took
    113 us at m = 3617 on the H200; here the row is cut into g groups of h ~ sqrt(m) entries,
    prefixed within each group (m * h adds) and across the group totals (g * g).
    """
    n, m = x.shape
    h = max(1, math.isqrt(m - 1) + 1)
    g = -(-m // h)
    groups = jnp.pad(x, ((0, 0), (0, g * h - m))).reshape(n, g, h)
    q = jnp.arange(h, dtype=jnp.int32)
    within = jnp.sum(jnp.where(q[None, :] <= q[:, None], groups[:, :, None, :], 0), axis=3,
                     dtype=jnp.int32)                                             # [n, g, h]
    totals = within[:, :, -1]
    gi = jnp.arange(g, dtype=jnp.int32)
    before = jnp.sum(jnp.where(gi[None, :] < gi[:, None], totals[:, None, :], 0), axis=2,
                     dtype=jnp.int32)                                             # [n, g]
    return (within + before[:, :, None]).reshape(n, g * h)[:, :m]


def _compaction_block(m: int, k: int) -> int:
    """Block length b for `_radix_top_k_set`'s compaction: it costs about k * ceil(m / b)
    compares to find each output's block and k * b * b to find the entry within it."""
    return min(range(1, 129), key=lambda b: k * -(-m // b) + k * b * b)


def _radix_top_k_set(keys: jax.Array, k: int, bits: int, variadic: bool = True) -> jax.Array:
    """[n, k] int32: the indices of `lax.top_k`'s selection on order keys, sorted ascending.

    keys: [n, m] int32 order keys (`_order_keys`); 1 <= k <= m. With tau the k-th largest key
    (`_radix_kth_largest`), the selection is every key > tau (g of them) and the r = k - g
    lowest-index keys == tau: top_k breaks ties by lower index. Compaction without a sort or a
    cumulative sum over the row: the row is cut into blocks of b entries, each block's counts of
    keys > tau and == tau come from one reduction, their cumulative sums over the blocks give how
    many selected entries precede each block, output p finds its block by a count over the
    blocks and the entry within it by prefix counts over the block's b entries. Padding at the
    row's end counts as neither.
    """
    n, m = keys.shape
    ukeys = _unsigned_keys(keys)
    tau = _radix_kth_largest(ukeys, k, bits, variadic)[:, None]                   # [n, 1]
    b = _compaction_block(m, k)
    n_blocks = -(-m // b)
    # One int32 per entry: bit 0 "> tau", bit 16 "== tau"; block sums stay below 2**16 per field.
    flags = (ukeys > tau).astype(jnp.int32) | ((ukeys == tau).astype(jnp.int32) << 16)
    flags = jnp.pad(flags, ((0, 0), (0, n_blocks * b - m))).reshape(n, n_blocks, b)
    per_block = jnp.sum(flags, axis=2, dtype=jnp.int32)                           # [n, n_blocks]
    both = _prefix_sum(jnp.concatenate([per_block & 0xFFFF, per_block >> 16], axis=0))
    gt_incl, eq_incl = both[:n], both[n:]                                         # [n, n_blocks] each
    r = k - gt_incl[:, -1:]                                                       # ties to take, [n, 1]
    eq_excl = eq_incl - (per_block >> 16)
    taken_incl = gt_incl + jnp.minimum(eq_incl, r)     # selected entries up to each block's end
    taken_excl = gt_incl - (per_block & 0xFFFF) + jnp.minimum(eq_excl, r)
    position = jnp.arange(k, dtype=jnp.int32)
    # Output p lies in the first block whose running count exceeds p.
    block = jnp.sum(taken_incl[:, None, :] <= position[None, :, None], axis=2, dtype=jnp.int32)  # [n, k]
    want = position[None, :] - jnp.take_along_axis(taken_excl, block, axis=1)    # rank in the block
    quota = jnp.maximum(r - jnp.take_along_axis(eq_excl, block, axis=1), 0)     # ties it may take
    inner = jnp.take_along_axis(flags, block[:, :, None], axis=1)               # [n, k, b]
    q = jnp.arange(b, dtype=jnp.int32)
    prefix = jnp.sum(jnp.where(q[None, :] <= q[:, None], inner[:, :, None, :], 0), axis=3,
                     dtype=jnp.int32)                                             # [n, k, b]
    taken = (prefix & 0xFFFF) + jnp.minimum(prefix >> 16, quota[:, :, None])
    offset = jnp.sum(taken <= want[:, :, None], axis=2, dtype=jnp.int32)
    return block * b + offset


def radix_top_k(rows: jax.Array, k: int, bits: int = RADIX_BITS, prechunk: int = RADIX_PRECHUNK,
                variadic: bool = True) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values and int32 indices, same order and tie-break) by radix select.

    rows: [n, length] float32 or narrower; k: static int <= length; bits: static int in 1..8,
    key bits resolved per pass; prechunk: static int >= 1, the chunk of one preselection level
    first (1: none; skipped when the row has fewer than k chunks); variadic: how the passes
    count (`_counts_at_least`).
    Method, on int32 keys in top_k's total order of floats (`_order_keys`): find each row's k-th
    largest key exactly by narrowing a key interval `bits` bits per pass (`_radix_kth_largest`:
    ceil(32 / bits) passes, each one reduction over the row counting the keys at or above
    2**bits - 1 thresholds), take the keys above it and the lowest-index keys equal to it, compact
    them to k indices in ascending order (`_radix_top_k_set`), then rank just those k (k * k
    compares) into top_k's order. With prechunk c > 1 the row is first cut into chunks of c
    and the exact top k chunks by maximum are found the same way (`_preselect`'s argument: the
    row's top k lies in them); their k * c entries are then ranked.
    Why: on GPU XLA sorts for lax.top_k, and `preselected_top_k` ranks about a thousand maxima
    per level at O(m * m) compares each; here the long row is only read by a fixed number of
    fused reductions and the rest works on [n, k]-sized arrays, whatever the values (ties,
    -inf, NaN) are. Measured on the H200 at [15, 151936]: XLA splits each pass's reduction into
    two kernels and the 15-output reduce reads the row at well under memory speed (about 13 us
    a pass on the whole row, 7 on a quarter), so the 8 passes dominate: prechunk 4 took 106 us
    at k = 256 (preselect's 103) and 135 at k = 512 (its 217), but 94 at k = 16 (its 36).
    """
    _, k = _check_rank_input(rows, k)
    bits = _check_int("bits", bits, 1)
    if bits > 8:
        raise ValueError(f"bits must be <= 8 (2**bits - 1 counts a pass), got {bits}")
    prechunk = _check_int("prechunk", prechunk, 1)
    n, length = rows.shape
    if k == 0:
        return jax.lax.top_k(rows, 0)
    keys = _order_keys(rows)
    if prechunk > 1 and length // prechunk >= k:
        n_chunks = -(-length // prechunk)
        pad = ((0, 0), (0, n_chunks * prechunk - length))
        # Padding takes the lowest key at the highest indices, so it ranks after every real
        # entry; every chunk holds a real entry (the padding is shorter than a chunk).
        blocks = jnp.pad(keys, pad, constant_values=np.iinfo(np.int32).min).reshape(n, n_chunks, prechunk)
        chosen = _radix_top_k_set(jnp.max(blocks, axis=2), k, bits, variadic)   # [n, k] ascending
        candidates = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(n, k * prechunk)
        within = (chosen[:, :, None] * prechunk
                  + jnp.arange(prechunk, dtype=jnp.int32)[None, None, :]).reshape(n, k * prechunk)
    else:
        within = _radix_top_k_set(keys, k, bits, variadic)                        # [n, k] ascending
        candidates = jnp.take_along_axis(keys, within, axis=1)
    # Candidates lie in ascending index order, so ranking them by position breaks ties by index.
    order = _positions_of_ranks(_key_ranks(candidates), k)
    indices = jnp.take_along_axis(within, order, axis=1)
    return jnp.take_along_axis(rows, indices, axis=1), indices


def kernel_top_k(rows: jax.Array, k: int, backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values bitwise, int32 indices, same order and tie-break) as two
    Triton kernels (`pallas_kernels.top_k.top_k`: chunk maxima over the row, then per row the
    exact k-th best chunk, the chosen chunks' candidates and their exact top k), where they
    apply (`pallas_kernels.top_k.applies`: k <= 2048, rows up to about half a million entries
    at k 16); elsewhere `chunked_top_k`.

    rows: [n, length] float32 or narrower; k: static int <= length; backend: where it runs
    (default `jax.default_backend()`): compiled on "gpu", in Pallas' interpreter elsewhere.
    Why: at [15, 151936] the XLA ways (`preselected_top_k`, `radix_top_k`) took 103-106 us of
    kernel time at k 256 on the H200 in a dozen or more kernels; here the row is read once by
    one launch and the selection runs in a second one.
    """
    from pallas_kernels import top_k as kernels

    _, k = _check_rank_input(rows, k)
    if k == 0 or not kernels.applies(rows.shape[1], k):
        return chunked_top_k(rows, k)
    return kernels.top_k(rows, k, interpret=(backend or jax.default_backend()) != "gpu")


def preselect_fanout(preselect: int | str | None, k: int, backend: str | None = None) -> int | str:
    """The fan-out `build_tree` uses for a vocabulary top-k of k: `preselect` as given (0 =
    none; a negative -c takes `radix_top_k` with prechunk c, -1 without one; KERNEL_PRESELECT
    takes `kernel_top_k`), or by default, on a GPU (`backend`, default `jax.default_backend()`),
    KERNEL_PRESELECT if KERNEL_TOP_K_BY_DEFAULT, else -RADIX_PRECHUNK if RADIX_BY_DEFAULT, else
    PRESELECT_RANKED // k within 2..PRESELECT_FANOUT for k <= PRESELECT_MAX_K, else none. None
    elsewhere: XLA's CPU backend writes each ranking's [n, m, m] compare out before summing it;
    on the 2-core development CPU, trees at [15, 49152] (SmolLM2) took 1.9 against 3.3 ms at
    k 16 but 25 against 9 ms at k 64 and 73 against 49 ms at k 256 (BENCHMARKS.md, eighteenth
    session). The tree is the same for every fan-out."""
    if preselect is None:
        if (backend or jax.default_backend()) != "gpu":
            return 0
        if KERNEL_TOP_K_BY_DEFAULT:
            return KERNEL_PRESELECT
        if RADIX_BY_DEFAULT:
            return -RADIX_PRECHUNK
        if k > PRESELECT_MAX_K:
            return 0
        return min(PRESELECT_FANOUT, max(2, PRESELECT_RANKED // max(k, 1)))
    if isinstance(preselect, str) and preselect == KERNEL_PRESELECT:
        return KERNEL_PRESELECT
    preselect = _check_int("preselect", preselect, -(1 << 30))
    if preselect == 1:
        raise ValueError("preselect must be 0 (none), a fan-out >= 2 or -prechunk (radix), got 1")
    return preselect


def _per_depth_best(log_probs: jax.Array, budget: int, chunk: int = TOP_K_CHUNK,
                    rank_max: int = RANK_TOP_K_MAX, preselect: int | str = 0,
                    kernel_backend: str | None = None
                    ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """Best `budget` nodes of every depth, each depth in rank order.

    log_probs: [batch, depth, vocab] sanitised float32. preselect: as `preselect_fanout`
    returns it; kernel_backend: `kernel_top_k`'s backend (default: jax's).
    Returns per depth d (list index d-1), each [batch, n_d]: scores, token ids, and the rank of
    the parent within depth d-1's list (0 = root at depth 1).
    """
    batch, depth, vocab = log_probs.shape
    n_tokens = min(budget, vocab)
    # Stable top_k: equal log-probs rank by lower token id, the tie-break the tests assume.
    # On rows ([batch * depth, vocab]): XLA lowers a rank-2 top_k to its TopK kernel, but a
    # rank-3 one to a full sort of the vocabulary (measured: 220 of a 340 ms CPU round).
    rows = log_probs.reshape(batch * depth, vocab)
    if preselect == KERNEL_PRESELECT:
        token_lp, token_ids = kernel_top_k(rows, n_tokens, kernel_backend)
    elif preselect < 0:
        token_lp, token_ids = radix_top_k(rows, n_tokens, RADIX_BITS, -preselect)
    elif preselect:
        token_lp, token_ids = preselected_top_k(rows, n_tokens, preselect, rank_max)
    else:
        token_lp, token_ids = chunked_top_k(rows, n_tokens, chunk)
    token_lp = token_lp.reshape(batch, depth, n_tokens)
    token_ids = token_ids.reshape(batch, depth, n_tokens)

    scores = [token_lp[:, 0]]
    tokens = [token_ids[:, 0].astype(jnp.int32)]
    parent_rank = [jnp.zeros((batch, n_tokens), jnp.int32)]
    for d in range(1, depth):
        pi, tj = _candidate_pairs(scores[-1].shape[1], n_tokens, budget)
        candidates = scores[-1][:, pi] + token_lp[:, d, tj]        # [batch, n_pairs]
        n_keep = min(budget, pi.size)
        # Both are stable (ties by lower candidate index: lexicographic ties); ranking avoids
        # the sort XLA would run for top_k on GPU while the pairwise compare stays small.
        top_k = ranked_top_k if pi.size <= rank_max else jax.lax.top_k
        best, which = top_k(candidates, n_keep)
        # Kept in memory: otherwise XLA fuses the chain of gathers and adds of every level before
        # into this level's consumers and recomputes it there, so level d costs O(d): on an H200
        # its select fusions grew from 1.7 to 7.6 us over the 14 levels of DDTree(256), and stay
        # at 1.3-1.7 us with the barrier (the tree 223-232 against 255-263 us a round;
        # BENCHMARKS.md, twenty-seventh session).
        best, which = jax.lax.optimization_barrier((best, which))
        scores.append(best)
        parent_rank.append(jnp.asarray(pi)[which])
        tokens.append(jnp.take_along_axis(token_ids[:, d], jnp.asarray(tj)[which], axis=1)
                      .astype(jnp.int32))
    return scores, tokens, parent_rank


def _build_tree_impl(log_probs: jax.Array, root_tokens: jax.Array, budget: int, width: int,
                     top_k_chunk: int = TOP_K_CHUNK, rank_max: int = RANK_TOP_K_MAX,
                     preselect: int | str = 0, kernel_backend: str | None = None) -> Tree:
    batch, depth, _ = log_probs.shape
    scores, tokens, parent_rank = _per_depth_best(_sanitize(log_probs), budget, top_k_chunk, rank_max,
                                                  preselect, kernel_backend)

    # Concatenate the depths: flat index = offset[d] + rank, so a lower flat index means lower
    # depth, then lower rank -- exactly the tie-break, which stable top_k applies for free.
    sizes = [s.shape[1] for s in scores]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
    flat_scores = jnp.concatenate(scores, axis=1)                                 # [batch, N]
    flat_tokens = jnp.concatenate(tokens, axis=1)
    flat_parent = jnp.concatenate(
        [jnp.full((batch, sizes[0]), -1, jnp.int32)]
        + [parent_rank[d] + offsets[d - 1] for d in range(1, depth)], axis=1)     # -1 = root
    flat_depth = np.concatenate([np.full(n, d + 1, np.int32) for d, n in enumerate(sizes)])

    n_nodes = min(budget, flat_scores.shape[1])
    # The best n_nodes in ascending flat index: that orders slots by depth, so every parent
    # lands before its children. slot_of: a chosen flat index's slot (1..n_nodes), else 0.
    if flat_scores.shape[1] <= rank_max:
        chosen, slot_of = _ranked_top_k_set(flat_scores, n_nodes)                # no sort
    else:
        _, chosen = jax.lax.top_k(flat_scores, n_nodes)
        chosen = jnp.sort(chosen, axis=1)                                         # [batch, n]
        slot_of = jnp.zeros(flat_scores.shape, jnp.int32).at[
            jnp.arange(batch)[:, None], chosen].set(
            jnp.broadcast_to(jnp.arange(1, n_nodes + 1, dtype=jnp.int32), chosen.shape),
            indices_are_sorted=True, unique_indices=True)
    node_parent_flat = jnp.take_along_axis(flat_parent, chosen, axis=1)
    # Prefix closure guarantees a chosen node's parent was chosen too, so slot_of is filled there.
    node_parent = jnp.where(node_parent_flat < 0, 0, jnp.take_along_axis(
        slot_of, jnp.maximum(node_parent_flat, 0), axis=1))

    pad = width - 1 - n_nodes

    def assemble(root: jax.Array, nodes: jax.Array, fill: Any) -> jax.Array:
        return jnp.concatenate([root[:, None].astype(nodes.dtype), nodes,
                                jnp.full((batch, pad), fill, nodes.dtype)], axis=1)

    out_tokens = assemble(root_tokens.astype(jnp.int32),
                          jnp.take_along_axis(flat_tokens, chosen, axis=1), 0)
    parents = assemble(jnp.full((batch,), -1, jnp.int32), node_parent, -1)
    depths = assemble(jnp.zeros((batch,), jnp.int32), jnp.asarray(flat_depth)[chosen], 0)
    out_scores = assemble(jnp.zeros((batch,), jnp.float32),
                          jnp.take_along_axis(flat_scores, chosen, axis=1), -jnp.inf)
    valid = jnp.broadcast_to(jnp.arange(width) < 1 + n_nodes, (batch, width))
    visible = _ancestors_visible_impl(parents, valid, max_depth=depth)
    return Tree(tokens=out_tokens, parents=parents, depths=depths, valid=valid,
                visible=visible, scores=out_scores)


_build_tree = jax.jit(_build_tree_impl,
                      static_argnames=("budget", "width", "top_k_chunk", "rank_max", "preselect",
                                       "kernel_backend"))


def chain_tree(block_tokens: jax.Array, width: int | None = None) -> Tree:
    """DFlash's draft as a degenerate tree: a single chain.

    block_tokens: [batch, bs] int, the root followed by the bs - 1 drafted tokens.
    width: static int >= bs, node slots (default bs, rounded up to a multiple of ROW_BLOCK).
    Slot i holds block_tokens[:, i] at depth i with parent i - 1; visibility is causal. Scores are
    all 0 (a chain carries no draft log-probs); padding as in `build_tree`.
    """
    if getattr(block_tokens, "ndim", None) != 2:
        raise ValueError(f"block_tokens must be [batch, bs], got shape "
                         f"{getattr(block_tokens, 'shape', None)}")
    if not jnp.issubdtype(block_tokens.dtype, jnp.integer):
        raise ValueError(f"block_tokens must be integer, got {block_tokens.dtype}")
    batch, block = block_tokens.shape
    if block < 1:
        raise ValueError(f"block_tokens needs at least the root (bs >= 1), got shape {block_tokens.shape}")
    width = _round_up(block, ROW_BLOCK) if width is None else _check_int("width", width, block)
    return _chain_tree(block_tokens, width=width)


def _chain_tree_impl(block_tokens: jax.Array, width: int) -> Tree:
    batch, block = block_tokens.shape
    slot = jnp.arange(width, dtype=jnp.int32)
    is_node = slot < block
    tokens = jnp.pad(block_tokens.astype(jnp.int32), ((0, 0), (0, width - block)))
    parents = jnp.where(is_node, slot - 1, -1)
    depths = jnp.where(is_node, slot, 0)
    scores = jnp.where(is_node, 0.0, -jnp.inf).astype(jnp.float32)

    def per_batch(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x, (batch,) + x.shape)

    valid = per_batch(is_node)
    # A chain's ancestors are just the earlier slots, so skip the pointer-doubling loop.
    causal = (slot[None, :] <= slot[:, None]) & is_node[:, None] & is_node[None, :]
    visible = per_batch(causal | (slot[:, None] == slot[None, :]))
    return Tree(tokens=tokens, parents=per_batch(parents), depths=per_batch(depths), valid=valid,
                visible=visible, scores=per_batch(scores))


_chain_tree = jax.jit(_chain_tree_impl, static_argnames=("width",))
