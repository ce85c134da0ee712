"""Accept rules: which drafted nodes the target keeps, and the bonus token it adds.

Both rules return the accepted path as node slots `path [batch, D+1]` (path[:, 0] is the root,
path[:, d] the accepted node at depth d for d <= m, then repeats of the deepest node), the
number of accepted drafted tokens `m [batch]`, and the `bonus [batch]` token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.tree import Tree


def follow_target(tree: Tree, target_tokens: jax.Array, max_depth: int,
                  node_ok: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walks down from the root, at each node moving to the child whose token is the target's choice.

    target_tokens: [batch, W] int32, the target's token at every node (argmax for greedy; an
        independent sample from the target's distribution at T > 0 -- each step's token is then
        an exact target sample, so the walk is lossless).
    max_depth: static bound on node depths (bs - 1 for a block-size-bs drafter).
    node_ok: optional [batch, W] bool; nodes outside it can't be accepted (e.g. past max_new_tokens).
    """
    valid = tree.valid if node_ok is None else tree.valid & node_ok
    parent_choice = jnp.take_along_axis(target_tokens, jnp.maximum(tree.parents, 0), axis=1)
    match = valid & (tree.tokens == parent_choice)
    match = match.at[:, 0].set(True)
    # A node is on the path iff it and all its ancestors match; children of one parent carry
    # distinct tokens, so the accepted nodes form a single root-to-leaf path.
    on_path = jnp.all(~tree.visible | match[:, None, :], axis=-1) & valid.at[:, 0].set(True)
    depth_key = jnp.where(on_path, tree.depths, -1)
    deepest = jnp.argmax(depth_key, axis=1).astype(jnp.int32)
    m = jnp.max(depth_key, axis=1).astype(jnp.int32)
    levels = jnp.arange(max_depth + 1, dtype=jnp.int32)
    at_level = on_path[:, None, :] & (tree.depths[:, None, :] == levels[None, :, None])  # [B, D+1, W]
    path = jnp.where(levels[None, :] <= m[:, None], jnp.argmax(at_level, axis=-1).astype(jnp.int32),
                     deepest[:, None])
    bonus = jnp.take_along_axis(target_tokens, deepest[:, None], axis=1)[:, 0]
    return path, m, bonus


def chain_rejection(key: jax.Array, chain_tokens: jax.Array, target_probs: jax.Array,
                    draft_probs: jax.Array, limit: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standard speculative rejection sampling on a DFlash chain.

    chain_tokens: [batch, bs] (root + drafted tokens); target_probs: [batch, bs, vocab] target
    distribution at each chain node; draft_probs: [batch, bs-1, vocab] the distributions the
    drafted tokens were sampled from; limit: [batch] how many drafted tokens may be accepted.
    Token d is kept with probability min(1, p/q); on the first rejection the bonus comes from
    the residual max(p - q, 0), and after full acceptance from p at the last kept node.
    """
    batch, bs = chain_tokens.shape
    k_accept, k_bonus = jax.random.split(key)
    drafted = chain_tokens[:, 1:]
    p = jnp.take_along_axis(target_probs[:, :-1], drafted[..., None], -1)[..., 0]
    q = jnp.take_along_axis(draft_probs, drafted[..., None], -1)[..., 0]
    u = jax.random.uniform(k_accept, q.shape, jnp.float32)
    ok = (u * q < p) & (jnp.arange(bs - 1)[None] < limit[:, None])
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_m = jnp.take_along_axis(target_probs, m[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(draft_probs, jnp.minimum(m, bs - 2)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_m - q_next, 0.0)
    total = jnp.sum(residual, -1, keepdims=True)
    rejected = (m < limit)[:, None]
    dist = jnp.where(rejected & (total > 0), residual / jnp.maximum(total, 1e-30), p_m)
    logp = jnp.where(dist > 0, jnp.log(jnp.maximum(dist, 1e-38)), -jnp.inf)
    bonus = jax.random.categorical(k_bonus, logp, axis=-1).astype(jnp.int32)
    levels = jnp.arange(bs, dtype=jnp.int32)
    path = jnp.minimum(levels[None, :], m[:, None])
    return path, m, bonus
