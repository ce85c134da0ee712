"""One depth of DDTree's tree: the best k children of the kept parents, in one launch (Pallas, Triton).

`tree.build_tree` keeps, per depth, the best `budget` nodes among the children (parent rank i,
token rank j) of the previous depth's kept nodes, over a static list of candidate pairs
(`tree._candidate_pairs`: those with (i + 1)(j + 1) <= budget, about budget * ln(budget)).
In XLA each depth was a gather and add, a ranking (an [m, m] compare and sum), a second
reduction placing each rank, and three gathers: about 5 dependent small kernels a depth, 14
depths a tree, a third of a DDTree(256) tree's 0.35 ms (BENCHMARKS.md, eighteenth session).

Here one launch does a depth: program p takes candidates [p * block, (p + 1) * block), scores
them, counts for each the candidates ranked ahead of it (higher score, or equal at a lower
index: `lax.top_k`'s stable order), and writes each candidate whose rank is below k straight to
that position of the outputs (ranks are a permutation, so no two collide).

Scores compare as floats, which orders them as top_k does for what `build_tree` feeds in (its
sanitised log-probs hold no NaN, and no sum of them is -0.0). `depth_select_reference` is the
same contract in jnp, the way `build_tree` computes it without the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import next_power_of_two

# Candidates per program: 1568 at budget 256 make 13 programs, each comparing its 128 against
# all 1568 in 13 steps of 128 x 128.
BLOCK = 128


def _kernel(parent_ref, token_lp_ref, token_id_ref, pi_ref, tj_ref, best_ref, parent_out_ref,
            token_out_ref, *, m: int, k: int, block: int, dump: int):
    """One program: one sequence, candidates [p * block, (p + 1) * block).

    Refs (batch squeezed): parent_ref [P'] f32 the kept parents' scores; token_lp_ref [T'] f32
    and token_id_ref [T'] int32 the depth's best tokens; pi_ref, tj_ref [M'] int32 the candidate
    pairs (padded with 0); outputs [K'] (best scores, parent ranks, token ids), K' > k: slot
    `dump` takes the writes of candidates ranked k or later.
    """
    own = pl.program_id(1) * block + jnp.arange(block, dtype=jnp.int32)

    def scores(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        pi, tj = pi_ref[rows], tj_ref[rows]
        return parent_ref[pi] + token_lp_ref[tj], (pi, tj)

    mine, (pi, tj) = scores(own)

    def count(b, rank):
        other = b * block + jnp.arange(block, dtype=jnp.int32)
        theirs, _ = scores(other)
        ahead = (theirs[None, :] > mine[:, None]) | (
            (theirs[None, :] == mine[:, None]) & (other[None, :] < own[:, None]))
        ahead = ahead & (other < m)[None, :]
        return rank + jnp.sum(ahead.astype(jnp.int32), axis=1)

    rank = lax.fori_loop(0, pl.cdiv(m, block), count, jnp.zeros((block,), jnp.int32))
    slot = jnp.where((own < m) & (rank < k), rank, dump)
    plgpu.store(best_ref.at[slot], mine)
    plgpu.store(parent_out_ref.at[slot], pi)
    plgpu.store(token_out_ref.at[slot], token_id_ref[tj])


def check(parent_scores: jax.Array, token_lp: jax.Array, token_ids: jax.Array, pi: np.ndarray,
          tj: np.ndarray, k: int) -> None:
    """Raises ValueError naming the argument whose shape, dtype or range does not fit."""
    if parent_scores.ndim != 2 or token_lp.ndim != 2:
        raise ValueError(f"depth_select: parent_scores and token_lp must be [batch, n], got "
                         f"{parent_scores.shape} and {token_lp.shape}")
    if token_lp.shape[0] != parent_scores.shape[0] or token_ids.shape != token_lp.shape:
        raise ValueError(f"depth_select: token_ids {token_ids.shape} and token_lp {token_lp.shape} must be "
                         f"[batch={parent_scores.shape[0]}, tokens]")
    if parent_scores.dtype != jnp.float32 or token_lp.dtype != jnp.float32:
        raise ValueError(f"depth_select: scores must be float32, got {parent_scores.dtype}, {token_lp.dtype}")
    pi, tj = np.asarray(pi), np.asarray(tj)
    if pi.ndim != 1 or pi.shape != tj.shape or pi.size < 1:
        raise ValueError(f"depth_select: pi and tj must be equal non-empty [m], got {pi.shape}, {tj.shape}")
    if pi.min() < 0 or pi.max() >= parent_scores.shape[1] or tj.min() < 0 or tj.max() >= token_lp.shape[1]:
        raise ValueError("depth_select: pi / tj index past parent_scores / token_lp")
    if not 1 <= k <= pi.size:
        raise ValueError(f"depth_select: k must be in 1..{pi.size} (the candidates), got {k}")


def depth_select(parent_scores: jax.Array, token_lp: jax.Array, token_ids: jax.Array, pi: np.ndarray,
                 tj: np.ndarray, k: int, *, block: int = BLOCK, num_warps: int = 4,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The best k of the candidates parent_scores[:, pi] + token_lp[:, tj], in top_k's order.

    Args:
      parent_scores: [batch, P] float32, the kept nodes of the depth above, best first.
      token_lp, token_ids: [batch, T] float32 / int32, this depth's best tokens, best first.
      pi, tj: [m] static numpy int32 candidate pairs (parent rank, token rank).
      k: static, 1 <= k <= m.
    Returns:
      (scores [batch, k] float32, parent rank [batch, k] int32 = pi of each, token id [batch, k]
      int32 = token_ids at tj of each), ordered by score, ties by lower candidate index.
    """
    check(parent_scores, token_lp, token_ids, pi, tj, k)
    if block < 16 or block & (block - 1):
        raise ValueError(f"depth_select: block={block} must be a power of two >= 16")
    batch = parent_scores.shape[0]
    m = int(np.asarray(pi).size)
    block = min(block, next_power_of_two(m))
    m_pad = pl.cdiv(m, block) * block
    pad_to = lambda x, n, fill: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=fill)  # noqa: E731
    parents = pad_to(parent_scores, next_power_of_two(parent_scores.shape[1]), -jnp.inf)
    t_pad = next_power_of_two(token_lp.shape[1])
    lp, ids = pad_to(token_lp, t_pad, -jnp.inf), pad_to(token_ids.astype(jnp.int32), t_pad, 0)
    pairs = [jnp.asarray(np.pad(np.asarray(a, np.int32), (0, m_pad - m))) for a in (pi, tj)]
    out_len = next_power_of_two(k + 1)  # room for the dump slot past the k kept
    sq = getattr(pl, "squeezed", None)  # the squeezed-dimension marker on newer jax, None on older
    row = lambda n: pl.BlockSpec((sq, n), lambda b, p: (b, 0))  # noqa: E731
    whole = lambda n: pl.BlockSpec((n,), lambda b, p: (0,))  # noqa: E731
    best, parent, token = pl.pallas_call(
        functools.partial(_kernel, m=m, k=k, block=block, dump=out_len - 1),
        grid=(batch, m_pad // block),
        in_specs=[row(parents.shape[1]), row(t_pad), row(t_pad), whole(m_pad), whole(m_pad)],
        out_specs=(row(out_len),) * 3,
        out_shape=(jax.ShapeDtypeStruct((batch, out_len), jnp.float32),
                   jax.ShapeDtypeStruct((batch, out_len), jnp.int32),
                   jax.ShapeDtypeStruct((batch, out_len), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="depth_select",
    )(parents, lp, ids, *pairs)
    return best[:, :k], parent[:, :k], token[:, :k]


def depth_select_reference(parent_scores: jax.Array, token_lp: jax.Array, token_ids: jax.Array,
                           pi: np.ndarray, tj: np.ndarray, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`depth_select` in jnp: the candidates' scores, `lax.top_k`, and the gathers."""
    check(parent_scores, token_lp, token_ids, pi, tj, k)
    pi, tj = jnp.asarray(pi, jnp.int32), jnp.asarray(tj, jnp.int32)
    best, which = lax.top_k(parent_scores[:, pi] + token_lp[:, tj], k)
    return best, pi[which], jnp.take_along_axis(token_ids, tj[which], axis=1).astype(jnp.int32)
