"""Draft-tree builders: brute force, the paper's heap, structure, chain, arguments, jit."""
from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import tree as tree_module
from dflash_jax.tree import Tree, ancestors_visible, build_tree, chain_tree, chunked_top_k, ranked_top_k, tree_width


def build_with(lp: jax.Array, roots: jax.Array, budget: int, **impl) -> Tree:
    """`build_tree` with its implementation choices (`top_k_chunk`, `rank_max`,
    `kernel_backend`) set, as `tree._build_tree` takes them; the tree must not depend on them."""
    impl = {"top_k_chunk": tree_module.TOP_K_CHUNK, "rank_max": tree_module.RANK_TOP_K_MAX,
            "kernel_backend": None, **impl}
    return tree_module._build_tree(lp, roots, budget=budget, width=tree_width(budget), **impl)


# ---------------------------------------------------------------------------------------------
# References written independently of the library.

def _token_ranks(lp_d: np.ndarray) -> np.ndarray:
    """rank[token] within one depth: higher log-prob first, equal log-probs by lower token id."""
    order = np.argsort(-lp_d, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank


def brute_force(lp: np.ndarray, budget: int) -> list[tuple[tuple[int, ...], np.float32]]:
    """All prefixes of depth <= D, best `budget` first by (score desc, depth, rank in depth).

    lp: [depth, vocab] float32. Rank in a depth orders by (score desc, parent's rank, token
    rank): the documented tie-break. Scores are accumulated in float32 root-to-leaf, as on device.
    Returns [(path, score)] in slot order: by depth, then rank within the depth.
    """
    depth, vocab = lp.shape
    level: list[tuple[tuple[int, ...], np.float32]] = [((), np.float32(0.0))]
    everything = []
    for d in range(depth):
        rank = _token_ranks(lp[d])
        children = []
        for parent_rank, (path, score) in enumerate(level):
            for tok in range(vocab):
                s = np.float32(score + lp[d, tok])
                children.append(((-s, parent_rank, rank[tok]), path + (tok,), s))
        children.sort(key=lambda c: c[0])
        level = [(path, s) for _, path, s in children]
        everything += [((-s, d, r), d, r, path, s) for r, (path, s) in enumerate(level)]
    everything.sort(key=lambda e: e[0])
    best = sorted(everything[:budget], key=lambda e: (e[1], e[2]))
    return [(path, s) for _, _, _, path, s in best]


def heap_tree(lp: np.ndarray, budget: int) -> dict[tuple[int, ...], float]:
    """DDTree's best-first heap: pop the best prefix, push its next sibling and its first child."""
    depth, vocab = lp.shape
    order = np.argsort(-lp, axis=1, kind="stable")
    sorted_lp = np.take_along_axis(lp, order, axis=1)
    # entry: (-score, tiebreak counter, depth index, token rank, parent path, parent score)
    counter = itertools.count()
    heap = [(-float(sorted_lp[0, 0]), next(counter), 0, 0, (), np.float32(0.0))]
    taken: dict[tuple[int, ...], float] = {}
    while heap and len(taken) < budget:
        _, _, d, r, parent_path, parent_score = heapq.heappop(heap)
        score = np.float32(parent_score + sorted_lp[d, r])
        path = parent_path + (int(order[d, r]),)
        taken[path] = float(score)
        if r + 1 < vocab:
            sib = np.float32(parent_score + sorted_lp[d, r + 1])
            heapq.heappush(heap, (-float(sib), next(counter), d, r + 1, parent_path, parent_score))
        if d + 1 < depth:
            child = np.float32(score + sorted_lp[d + 1, 0])
            heapq.heappush(heap, (-float(child), next(counter), d + 1, 0, path, score))
    return taken


def tree_paths(tree: Tree, b: int) -> list[tuple[tuple[int, ...], float]]:
    """[(token path below the root, score)] for the valid non-root slots, in slot order."""
    tree = jax.device_get(tree)
    tokens, parents, valid, scores = tree.tokens[b], tree.parents[b], tree.valid[b], tree.scores[b]
    out = []
    for i in range(1, tree.width):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.append((tuple(reversed(path)), float(scores[i])))
    return out


def check_structure(tree: Tree, n_valid: int) -> None:
    """Invariants every tree must satisfy, checked by walking parent pointers in numpy."""
    batch, width = tree.tokens.shape
    assert width >= n_valid, (width, n_valid)
    for arr in (tree.parents, tree.depths, tree.valid, tree.scores):
        assert arr.shape == (batch, width)
    assert tree.visible.shape == (batch, width, width)
    assert tree.tokens.dtype == jnp.int32 and tree.parents.dtype == jnp.int32
    assert tree.depths.dtype == jnp.int32 and tree.valid.dtype == jnp.bool_
    assert tree.scores.dtype == jnp.float32 and tree.visible.dtype == jnp.bool_
    tree = jax.device_get(tree)
    parents, depths, valid = tree.parents, tree.depths, tree.valid
    slot = np.arange(width)
    for b in range(batch):
        assert valid[b].sum() == n_valid
        assert valid[b, :n_valid].all(), "valid slots come first"
        assert parents[b, 0] == -1 and depths[b, 0] == 0
        node = valid[b] & (slot > 0)
        p = parents[b, node]
        assert np.all((p >= 0) & (p < slot[node])), "parent < child"
        assert valid[b, p].all()
        np.testing.assert_array_equal(depths[b, node], depths[b, p] + 1)
        expect = np.eye(width, dtype=bool)
        cursor = np.where(valid[b], parents[b], -1)
        for _ in range(width):  # walk every valid row up to the root at once
            live = cursor >= 0
            if not live.any():
                break
            expect[slot[live], cursor[live]] = True
            cursor = np.where(live, parents[b, np.maximum(cursor, 0)], -1)
        np.testing.assert_array_equal(tree.visible[b], expect)


def random_log_probs(seed: int, shape: tuple[int, ...], sharpness: float = 2.0) -> np.ndarray:
    # numpy, not jax.random: eager jax ops would each compile, and tests here are compile-bound.
    logits = sharpness * np.random.default_rng(seed).standard_normal(shape)
    logits -= logits.max(axis=-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))).astype(np.float32)


def n_prefixes(depth: int, vocab: int) -> int:
    return sum(vocab ** d for d in range(1, depth + 1))


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth,vocab", [(3, 6), (4, 5), (3, 2)])
@pytest.mark.parametrize("budget", [1, 2, 7, 31, 64])
def test_equals_brute_force(depth: int, vocab: int, budget: int) -> None:
    batch = 3
    lp = random_log_probs(depth * 100 + vocab * 10 + budget, (batch, depth, vocab))
    roots = jnp.arange(batch, dtype=jnp.int32) + 100
    tree = build_tree(jnp.asarray(lp), roots, budget)
    n_nodes = min(budget, n_prefixes(depth, vocab))
    check_structure(tree, 1 + n_nodes)
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, 0], np.asarray(roots))
    for b in range(batch):
        got = tree_paths(tree, b)
        want = brute_force(lp[b], budget)
        assert [p for p, _ in got] == [p for p, _ in want]
        np.testing.assert_array_equal([s for _, s in got], [s for _, s in want])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [3, 17, 40])
def test_ties_are_deterministic_and_prefix_closed(seed: int, budget: int) -> None:
    # Dyadic values sum exactly, so ties stay ties; 0 log-probs make children tie their parents
    # and -inf makes whole subtrees tie each other.
    depth, vocab = 4, 4
    rng = np.random.default_rng(seed)
    lp = rng.choice(np.array([0.0, -0.5, -1.0, -np.inf], np.float32), size=(2, depth, vocab))
    lp[0] = -1.0  # uniform: every prefix of a depth ties
    tree = build_tree(jnp.asarray(lp), jnp.array([1, 2], jnp.int32), budget)
    check_structure(tree, 1 + min(budget, n_prefixes(depth, vocab)))
    for b in range(2):
        got = tree_paths(tree, b)
        want = brute_force(lp[b], budget)
        assert [p for p, _ in got] == [p for p, _ in want]
        np.testing.assert_array_equal([s for _, s in got], [s for _, s in want])


@pytest.mark.parametrize("k,chunk,length", [(8, 8, 61), (5, 16, 100), (16, 16, 48), (3, 8, 17)])
def test_chunked_top_k_equals_top_k_with_ties(k: int, chunk: int, length: int) -> None:
    # Few distinct values (and -inf) across chunks, so ties straddle chunk borders; the last
    # chunk is partial except at length 48.
    rng = np.random.default_rng(k * 1000 + chunk * 10 + length)
    rows = rng.choice(np.array([-0.25, -1.0, -2.0, -np.inf], np.float32), size=(5, length))
    rows[1] = -np.inf  # nothing but -inf: the real entries still beat the padding
    rows[2] = -1.0
    want_val, want_idx = jax.lax.top_k(jnp.asarray(rows), k)
    got_val, got_idx = chunked_top_k(jnp.asarray(rows), k, chunk)
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(got_val), np.asarray(want_val))


@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (2, 5, 0), (3, 17, 5), (4, 64, 64), (2, 300, 256),
                                   (3, 1500, 256)])
def test_ranked_top_k_equals_top_k_with_ties(n: int, m: int, k: int) -> None:
    rng = np.random.default_rng(n * 10000 + m * 10 + k)
    rows = rng.choice(np.array([0.0, -1.0, -2.0, -np.inf], np.float32), size=(n + 3, m))
    rows[0] = -np.inf                                   # nothing but -inf
    rows[1] = -1.0                                      # one value everywhere
    rows[2] = rng.standard_normal(m).astype(np.float32)  # (almost surely) no ties
    rows = jnp.asarray(rows)
    want_val, want_idx = jax.lax.top_k(rows, k)
    got_val, got_idx = jax.jit(ranked_top_k, static_argnums=1)(rows, k)
    assert got_idx.dtype == jnp.int32 and got_val.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(got_val), np.asarray(want_val))
    # The sorted chosen set that build_tree uses for the final selection.
    chosen, slot = jax.jit(tree_module._ranked_top_k_set, static_argnums=1)(rows, k)
    want_chosen = np.sort(np.asarray(want_idx), axis=1)
    np.testing.assert_array_equal(np.asarray(chosen), want_chosen)
    want_slot = np.zeros(rows.shape, np.int32)
    np.put_along_axis(want_slot, want_chosen, np.arange(1, k + 1, dtype=np.int32)[None], axis=1)
    np.testing.assert_array_equal(np.asarray(slot), want_slot)


def test_ranked_top_k_orders_floats_totally_like_top_k() -> None:
    # -0.0 below +0.0 and NaN at the ends by its sign, as top_k orders them.
    nan = np.nan
    rows = jnp.array([[0.0, -0.0, nan, -nan, -np.inf, np.inf, -1.0, 0.0, -0.0, nan],
                      [-0.0, -0.0, 0.0, -3.0, -0.0, np.inf, np.inf, -nan, 0.0, 1.0]], jnp.float32)
    want_val, want_idx = jax.lax.top_k(rows, 10)
    got_val, got_idx = ranked_top_k(rows, 10)
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.signbit(np.asarray(got_val)), np.signbit(np.asarray(want_val)))
    np.testing.assert_array_equal(np.asarray(got_val), np.asarray(want_val))


def test_tree_without_ranking_is_the_same() -> None:
    # rank_max = 0 takes lax.top_k (and the sort) everywhere: the tree must not change.
    rng = np.random.default_rng(5)
    lp = rng.choice(np.array([0.0, -0.5, -1.0, -np.inf], np.float32), size=(2, 6, 40))
    lp[1] = random_log_probs(6, (6, 40))
    lp, roots = jnp.asarray(lp), jnp.array([1, 2], jnp.int32)

    def build(rank_max: int) -> Tree:
        return build_with(lp, roots, 64, rank_max=rank_max)

    def sorts(rank_max: int) -> int:
        return str(jax.make_jaxpr(lambda: tree_module._build_tree_impl(
            lp, roots, budget=64, width=tree_width(64), rank_max=rank_max))()).count(" sort[")

    assert sorts(tree_module.RANK_TOP_K_MAX) == 0 and sorts(0) == 1
    ranked, sorted_ = build(tree_module.RANK_TOP_K_MAX), build(0)
    for a, b in zip(jax.tree_util.tree_leaves(ranked), jax.tree_util.tree_leaves(sorted_)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_structure(ranked, 65)


@pytest.mark.parametrize("budget", [5, 8])
def test_chunked_vocabulary_top_k_equals_brute_force_with_ties(budget: int) -> None:
    depth, vocab = 3, 24
    rng = np.random.default_rng(budget)
    lp = rng.choice(np.array([0.0, -0.5, -1.0, -np.inf], np.float32), size=(2, depth, vocab))
    tree = build_with(jnp.asarray(lp), jnp.array([1, 2], jnp.int32), budget, top_k_chunk=8)
    for b in range(2):
        got = tree_paths(tree, b)
        want = brute_force(lp[b], budget)
        assert [p for p, _ in got] == [p for p, _ in want]


def test_parent_wins_tie_with_child_even_for_negative_zero() -> None:
    # top_k orders -0.0 below +0.0; the child (-0.0 + 0.0 = +0.0) must still not beat its parent.
    lp = jnp.array([[[-0.0, -1.0], [0.0, -1.0]]], jnp.float32)
    tree = build_tree(lp, jnp.array([5]), 1)
    assert tree_paths(tree, 0) == [((0,), 0.0)]
    tree = build_tree(lp, jnp.array([5]), 2)
    assert tree_paths(tree, 0) == [((0,), 0.0), ((0, 0), 0.0)]


def test_nan_and_positive_log_probs_keep_the_tree_closed() -> None:
    lp = random_log_probs(7, (2, 4, 5))
    lp[0, 1, 2] = np.nan
    lp[1, 2, 0] = 3.0
    tree = build_tree(jnp.asarray(lp), jnp.array([0, 0]), 20)
    check_structure(tree, 21)


# One top_k over the vocabulary; 4 chunks of 256; and the default chunk over 5000 tokens.
@pytest.mark.parametrize("top_k_chunk,vocab", [(0, 1000), (256, 1000), (tree_module.TOP_K_CHUNK, 5000)])
def test_equals_best_first_heap_realistic_shapes(top_k_chunk: int, vocab: int) -> None:
    batch, depth, budget = 2, 15, 256
    lp = random_log_probs(11, (batch, depth, vocab), sharpness=4.0)
    tree = build_with(jnp.asarray(lp), jnp.array([3, 4], jnp.int32), budget, top_k_chunk=top_k_chunk)
    assert tree.width == 1 + budget  # tree_width: no padding
    check_structure(tree, 1 + budget)
    for b in range(batch):
        got = dict(tree_paths(tree, b))
        want = heap_tree(lp[b], budget)
        assert got.keys() == want.keys()
        for path, score in want.items():
            assert got[path] == pytest.approx(score, rel=1e-6, abs=1e-6)


def test_tree_width() -> None:
    assert tree_width(1) == 2  # the root and one node: no padding by default
    assert tree_width(16) == 17
    assert tree_width(255) == 256
    assert tree_width(256) == 257
    assert tree_width(512) == 513


def test_explicit_wider_width_pads() -> None:
    lp = random_log_probs(3, (1, 3, 6))
    tree = build_tree(jnp.asarray(lp), jnp.array([9]), 7, width=48)
    assert tree.width == 48
    check_structure(tree, 8)
    assert np.all(np.asarray(tree.parents)[0, 8:] == -1)
    assert np.all(np.isneginf(np.asarray(tree.scores)[0, 8:]))


def test_ancestors_visible_on_hand_tree() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5      slot 6: padding
    parents = jnp.array([[-1, 0, 0, 1, 1, 2, -1]], jnp.int32)
    valid = jnp.array([[True] * 6 + [False]])
    expect = np.zeros((7, 7), bool)
    for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [6]]):
        expect[i, anc] = True
    np.testing.assert_array_equal(np.asarray(ancestors_visible(parents, valid))[0], expect)
    np.testing.assert_array_equal(np.asarray(ancestors_visible(parents, valid, max_depth=2))[0],
                                  expect)


def test_chain_tree() -> None:
    block = jnp.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]], jnp.int32)
    tree = chain_tree(block, width=16)  # padded: slots 5..15 are invalid
    assert tree.width == 16
    check_structure(tree, 5)
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, :5], np.asarray(block))
    np.testing.assert_array_equal(np.asarray(tree.parents)[0, :5], [-1, 0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(tree.depths)[1, :5], [0, 1, 2, 3, 4])
    causal = np.tril(np.ones((5, 5), bool))
    np.testing.assert_array_equal(np.asarray(tree.visible)[:, :5, :5], np.stack([causal] * 2))
    # Same mask as the general helper would compute from the parents.
    np.testing.assert_array_equal(np.asarray(tree.visible),
                                  np.asarray(ancestors_visible(tree.parents, tree.valid)))
    assert chain_tree(jnp.zeros((1, 16), jnp.int32)).width == 16
    assert chain_tree(jnp.zeros((1, 17), jnp.int32)).width == 17  # default: bs (ROW_BLOCK 1)
    assert chain_tree(block).width == 5


def test_bad_arguments_name_the_argument() -> None:
    lp = jnp.zeros((2, 3, 5), jnp.float32)
    roots = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, roots, 0)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, roots, 2.0)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, roots, jnp.int32(4))
    with pytest.raises(ValueError, match="width"):
        build_tree(lp, roots, 16, width=16)
    with pytest.raises(ValueError, match="k must be"):
        ranked_top_k(lp[0], 6)
    with pytest.raises(ValueError, match="log_probs"):
        build_tree(lp[0], roots, 4)
    with pytest.raises(ValueError, match="log_probs"):
        build_tree(lp[:, :0], roots, 4)
    with pytest.raises(ValueError, match="log_probs"):
        build_tree(lp.astype(jnp.int32), roots, 4)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(lp, roots[:1], 4)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(lp, roots[:, None], 4)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(lp, roots.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="budget"):
        tree_width(0)
    with pytest.raises(ValueError, match="block_tokens"):
        chain_tree(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="width"):
        chain_tree(jnp.zeros((1, 8), jnp.int32), width=7)
    with pytest.raises(ValueError, match="valid"):
        ancestors_visible(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 5), bool))


@pytest.mark.parametrize("batch", [1, 3])
def test_runs_under_jit(batch: int) -> None:
    lp = jnp.asarray(random_log_probs(5, (batch, 6, 50)))
    roots = jnp.arange(batch, dtype=jnp.int32)
    jitted = jax.jit(build_tree, static_argnames=("budget", "width"))
    tree = jitted(lp, roots, budget=24)
    eager = build_tree(lp, roots, 24)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_structure(tree, 25)

    @jax.jit
    def round_trip(lp: jax.Array, roots: jax.Array) -> tuple[Tree, Tree]:
        blocks = jnp.concatenate([roots[:, None], jnp.argmax(lp, axis=-1).astype(jnp.int32)], 1)
        return build_tree(lp, roots, 24), chain_tree(blocks)

    tree2, chain = round_trip(lp, roots)
    np.testing.assert_array_equal(np.asarray(tree2.tokens), np.asarray(tree.tokens))
    # Slot 1 is the best depth-1 node, i.e. the chain's first drafted token (the argmax).
    np.testing.assert_array_equal(np.asarray(tree2.tokens)[:, 1], np.asarray(chain.tokens)[:, 1])
    np.testing.assert_array_equal(np.asarray(tree2.parents)[:, 1], 0)
