"""The per-depth selection kernel of DDTree's tree (`pallas_kernels/depth_select.py`).

On CPU: the kernel in interpret mode against its jnp reference (`lax.top_k` over the candidate
scores, the gathers) on tie-heavy and random inputs, its lowering for cuda at DDTree(256) and
DDTree(512)'s shapes, its input checks. The whole tree with the kernel (interpreted) against
brute force and the paper's heap is in test_tree.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.tree import _candidate_pairs
from pallas_kernels.depth_select import depth_select, depth_select_reference


def make_case(seed: int, batch: int, parents: int, tokens: int, ties: bool):
    """Sorted (best first) parent scores and token log-probs, with -inf entries; dyadic values
    with ties sum exactly, so candidates tie across parents and tokens."""
    rng = np.random.default_rng(seed)
    if ties:
        ps = rng.choice(np.array([-0.5, -1.0, -2.0, -np.inf], np.float32), (batch, parents))
        lp = rng.choice(np.array([0.0, -0.5, -1.0, -3.0], np.float32), (batch, tokens))
    else:
        ps = -np.abs(rng.standard_normal((batch, parents))).astype(np.float32) * 4
        lp = -np.abs(rng.standard_normal((batch, tokens))).astype(np.float32) * 4
        ps[:, -1] = -np.inf
    ps, lp = -np.sort(-ps, axis=1), -np.sort(-lp, axis=1)
    ids = rng.permutation(10 * tokens)[:tokens].astype(np.int32)[None].repeat(batch, 0)
    return jnp.asarray(ps), jnp.asarray(lp), jnp.asarray(ids)


# (budget, parents kept above, tokens): every depth's shape at budgets 1..256 in build_tree,
# fewer parents than the budget (a shallow depth of a tiny vocabulary), fewer tokens.
SHAPES = [(1, 1, 1), (4, 4, 4), (16, 16, 16), (17, 17, 5), (64, 64, 64), (64, 20, 64), (256, 256, 256)]


@pytest.mark.parametrize("budget,parents,tokens", SHAPES)
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("block", [16, 128])
def test_kernel_matches_reference(budget: int, parents: int, tokens: int, ties: bool, block: int) -> None:
    pi, tj = _candidate_pairs(parents, tokens, budget)
    k = min(budget, pi.size)
    ps, lp, ids = make_case(budget * 7 + parents + tokens + ties, 3, parents, tokens, ties)
    got = depth_select(ps, lp, ids, pi, tj, k, block=block, interpret=True)
    want = depth_select_reference(ps, lp, ids, pi, tj, k)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (3, k) and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_reference_is_a_stable_selection_by_hand() -> None:
    # Two parents, two tokens, every pair a candidate: scores [-1, -2, -1, -2] + ... by hand.
    ps = jnp.array([[-1.0, -1.0]], jnp.float32)
    lp = jnp.array([[-0.5, -1.5]], jnp.float32)
    ids = jnp.array([[7, 9]], jnp.int32)
    pi, tj = np.array([0, 0, 1, 1], np.int32), np.array([0, 1, 0, 1], np.int32)
    for fn in (depth_select_reference, lambda *a: depth_select(*a, interpret=True)):
        best, parent, token = fn(ps, lp, ids, pi, tj, 3)
        np.testing.assert_array_equal(np.asarray(best), [[-1.5, -1.5, -2.5]])
        np.testing.assert_array_equal(np.asarray(parent), [[0, 1, 0]])  # the tie goes to parent 0
        np.testing.assert_array_equal(np.asarray(token), [[7, 7, 9]])


@pytest.mark.parametrize("budget", [256, 512])
def test_lowers_for_cuda(budget: int) -> None:
    pi, tj = _candidate_pairs(budget, budget, budget)
    f = jax.ShapeDtypeStruct((1, budget), jnp.float32)
    i = jax.ShapeDtypeStruct((1, budget), jnp.int32)
    text = jax.jit(lambda a, b, c: depth_select(a, b, c, pi, tj, budget)).trace(f, f, i).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "depth_select" in text


def test_bad_arguments_name_the_argument() -> None:
    ps, lp, ids = make_case(0, 1, 4, 4, True)
    pi, tj = _candidate_pairs(4, 4, 4)
    with pytest.raises(ValueError, match="k must be"):
        depth_select(ps, lp, ids, pi, tj, 0)
    with pytest.raises(ValueError, match="pi / tj"):
        depth_select(ps, lp, ids, pi + 4, tj, 2)
    with pytest.raises(ValueError, match="float32"):
        depth_select(ps.astype(jnp.bfloat16), lp, ids, pi, tj, 2)
    with pytest.raises(ValueError, match="token_ids"):
        depth_select(ps, lp, ids[:, :2], pi, tj, 2)
    with pytest.raises(ValueError, match="block"):
        depth_select(ps, lp, ids, pi, tj, 2, block=24)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("budget,parents,tokens", SHAPES + [(512, 512, 512)])
def test_gpu_kernel_matches_reference(budget: int, parents: int, tokens: int) -> None:
    pi, tj = _candidate_pairs(parents, tokens, budget)
    k = min(budget, pi.size)
    for ties in (True, False):
        ps, lp, ids = make_case(budget + ties, 2, parents, tokens, ties)
        got = jax.jit(lambda a, b, c: depth_select(a, b, c, pi, tj, k))(ps, lp, ids)
        want = depth_select_reference(ps, lp, ids, pi, tj, k)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("budget", [16, 256])
def test_gpu_tree_with_the_kernel_is_the_xla_tree(budget: int) -> None:
    from dflash_jax.tree import build_tree
    rng = np.random.default_rng(budget)
    lp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((2, 15, 151936)) * 4, jnp.float32), -1)
    roots = jnp.array([1, 2], jnp.int32)
    a = build_tree(lp, roots, budget, depth_select="kernel")
    b = build_tree(lp, roots, budget, depth_select="xla", preselect=0)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
