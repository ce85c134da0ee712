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
# budgets 16 / 64 / 512 were as fast or faster at 1 + budget (BENCHMARKS.md).
ROW_BLOCK = 1
# Vocabulary chunk of the two-stage top_k (`chunked_top_k`); 0 = one top_k over the whole row.
TOP_K_CHUNK = 2048
# Longest row that the tree's top-k selections (per depth and over all depths) rank with
# `ranked_top_k` instead of `lax.top_k`: ranking compares every pair, m * m per row.
RANK_TOP_K_MAX = 4096


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


def tree_width(budget: int) -> int:
    """Slots for a root plus `budget` nodes: 1 + budget rounded up to a multiple of ROW_BLOCK.

    Not the next power of two: verify cost grows with the width, and e.g. budget 256 would
    otherwise pay for 512 rows.
    """
    budget = _check_int("budget", budget, 1)
    return _round_up(1 + budget, ROW_BLOCK)


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
               width: int | None = None) -> Tree:
    """DDTree: the root plus the `budget` most probable draft prefixes.

    log_probs:   [batch, depth, vocab] float, log q_d for draft depths 1..depth (the drafter's
                 per-depth distributions; they do not depend on the parent). Must be <= 0;
                 larger values are treated as 0 and NaN as -inf.
    root_tokens: [batch] int, the last bonus token of each sequence.
    budget:      static int >= 1, drafted nodes per tree (the root is extra).
    width:       static int >= 1 + budget, node slots (default `tree_width(budget)`).

    The vocabulary top-k runs as `vocab_backend` says for this backend (on a GPU the Triton
    kernels of `kernel_top_k`, elsewhere `chunked_top_k`); the tree's own selections rank rows
    of up to RANK_TOP_K_MAX with `ranked_top_k` and leave longer ones to lax.top_k. The tree
    is the same either way.

    Node scores are summed log-probs along the path. Ties are broken by lower depth, then by
    rank within the depth (lower parent rank, then lower token rank, token ranks coming from a
    stable top-k over the vocabulary), so a parent always beats an equal-scoring child and the
    selection is prefix-closed. If fewer than `budget` prefixes exist (tiny vocabulary x depth),
    the rest are padding. Output slots are ordered by depth, then by rank within the depth.
    """
    _check_draft_inputs(log_probs, root_tokens)
    budget = _check_int("budget", budget, 1)
    width = tree_width(budget) if width is None else _check_int("width", width, 1 + budget)
    return _build_tree(log_probs, root_tokens, budget=budget, width=width, top_k_chunk=TOP_K_CHUNK,
                       rank_max=RANK_TOP_K_MAX, kernel_backend=vocab_backend())


def chunked_top_k(rows: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values and indices, same order and tie-break) in two stages.

    rows: [n, length]; k <= length. Stage 1 takes the top k of every `chunk` entries, stage 2
    the top k of those n_chunks * k candidates: each of the row's top k is among its chunk's
    top k, so the result is exact. Ties keep top_k's stable order (lower index first) because
    candidates are laid out chunk by chunk, each chunk in its own stable order, so among equal
    values a lower candidate position means a lower index.
    Why: on GPU XLA sorts the whole row for a large k; at [15, 151936] and k = 256 that sort
    took 0.55 ms of a 13.2 ms DDTree(256) round (BENCHMARKS.md). Sorting
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
    only up to `RANK_TOP_K_MAX`.
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


def kernel_top_k(rows: jax.Array, k: int, backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)` (values bitwise, int32 indices, same order and tie-break) as two
    Triton kernels (`pallas_kernels.top_k.top_k`: chunk maxima over the row, then per row the
    exact k-th best chunk, the chosen chunks' candidates and their exact top k), where they
    apply (`pallas_kernels.top_k.applies`: k <= 2048, rows up to about half a million entries
    at k 16); elsewhere `chunked_top_k`.

    rows: [n, length] float32 or narrower; k: static int <= length; backend: where it runs
    (default `jax.default_backend()`): compiled on "gpu", in Pallas' interpreter elsewhere.
    Why: at [15, 151936] XLA ways of the same selection (chunk maxima preselected by ranking,
    or a radix select) took 103-106 us of kernel time at k 256 on the H200 in a dozen or more
    kernels; here the row is read once by one launch and the selection runs in a second one. In
    the DDTree round the tree's kernels took 0.15 against 0.23 ms at budget 256 and 0.27
    against 0.39 at budget 512 (BENCHMARKS.md).
    """
    from pallas_kernels import top_k as kernels

    _, k = _check_rank_input(rows, k)
    if k == 0 or not kernels.applies(rows.shape[1], k):
        return chunked_top_k(rows, k)
    return kernels.top_k(rows, k, interpret=(backend or jax.default_backend()) != "gpu")


def vocab_backend(backend: str | None = None) -> str | None:
    """The tree's vocabulary top-k for a backend (default `jax.default_backend()`): "gpu"
    (`kernel_top_k`, compiled) on a GPU, else None (`chunked_top_k`). XLA's CPU backend has no
    use for the kernels: interpreted, they are a test of their logic, not a speed-up."""
    return "gpu" if (backend or jax.default_backend()) == "gpu" else None


def _per_depth_best(log_probs: jax.Array, budget: int, chunk: int = TOP_K_CHUNK,
                    rank_max: int = RANK_TOP_K_MAX, kernel_backend: str | None = None
                    ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """Best `budget` nodes of every depth, each depth in rank order.

    log_probs: [batch, depth, vocab] sanitised float32. kernel_backend: None for the vocabulary
    top-k by `chunked_top_k`, else `kernel_top_k`'s backend ("gpu": compiled; any other:
    interpreted).
    Returns per depth d (list index d-1), each [batch, n_d]: scores, token ids, and the rank of
    the parent within depth d-1's list (0 = root at depth 1).
    """
    batch, depth, vocab = log_probs.shape
    n_tokens = min(budget, vocab)
    # Stable top_k: equal log-probs rank by lower token id, the tie-break the tests assume.
    # On rows ([batch * depth, vocab]): XLA lowers a rank-2 top_k to its TopK kernel, but a
    # rank-3 one to a full sort of the vocabulary (measured: 220 of a 340 ms CPU round).
    rows = log_probs.reshape(batch * depth, vocab)
    if kernel_backend is not None:
        token_lp, token_ids = kernel_top_k(rows, n_tokens, kernel_backend)
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
        # BENCHMARKS.md).
        best, which = jax.lax.optimization_barrier((best, which))
        scores.append(best)
        parent_rank.append(jnp.asarray(pi)[which])
        tokens.append(jnp.take_along_axis(token_ids[:, d], jnp.asarray(tj)[which], axis=1)
                      .astype(jnp.int32))
    return scores, tokens, parent_rank


def _build_tree_impl(log_probs: jax.Array, root_tokens: jax.Array, budget: int, width: int,
                     top_k_chunk: int = TOP_K_CHUNK, rank_max: int = RANK_TOP_K_MAX,
                     kernel_backend: str | None = None) -> Tree:
    """`build_tree` with its implementation choices explicit (static): the vocabulary chunk of
    `chunked_top_k`, the longest row ranked rather than top_k'd, and the vocabulary top-k's
    kernel backend (`_per_depth_best`); tests drive each path with them."""
    batch, depth, _ = log_probs.shape
    scores, tokens, parent_rank = _per_depth_best(_sanitize(log_probs), budget, top_k_chunk, rank_max,
                                                  kernel_backend)

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
                      static_argnames=("budget", "width", "top_k_chunk", "rank_max", "kernel_backend"))


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
