"""The gated delta rule (dflash_jax.gdn) against a float64 numpy recurrence written here and
transformers' PyTorch reference: recurrent, chunked, tree / chain verify, the closed-form commit
and the conv forms."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import gdn

HK, HV, DK, DV = 2, 4, 8, 6  # key heads < value heads: each key head serves two value heads
KERNEL, CHANNELS = 4, 10
TOL32 = dict(rtol=1e-5, atol=1e-5)
TOL64 = dict(rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- float64 numpy reference


def ref_qk(q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q, k [..., Hk, dk] -> normalised (q also scaled) and given to the value heads, float64.

    Value head h reads key head h // (Hv // Hk) (transformers' repeat_interleave).
    """
    def norm(x):
        x = np.asarray(x, np.float64)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    heads = [h // (HV // HK) for h in range(HV)]
    return (norm(q) / np.sqrt(q.shape[-1]))[..., heads, :], norm(k)[..., heads, :]


def ref_run(q, k, v, g, beta, state, order):
    """Runs one sequence's tokens `order` through the recurrence from `state`.

    q, k: [N, Hk, dk] raw; v: [N, Hv, dv]; g, beta: [N, Hv]; state: [Hv, dk, dv].
    Returns (the output of every token of `order` [len, Hv, dv], the final state), float64.
    """
    qn, kn = ref_qk(q, k)
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    s = np.array(state, np.float64)
    outs = []
    for t in order:
        s = np.exp(g[t])[:, None, None] * s
        u = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", kn[t], s))
        s = s + kn[t][:, :, None] * u[:, None, :]
        outs.append(np.einsum("hk,hkv->hv", qn[t], s))
    return np.array(outs).reshape(len(order), HV, -1), s


def path_of(parents: np.ndarray, t: int) -> list[int]:
    path = [t]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def ref_conv_path(x, state, weight, bias, path):
    """The conv at the last node of `path` (root..t) and the conv state after it, float64."""
    seq = np.concatenate([np.asarray(state, np.float64), np.asarray(x, np.float64)[path]], axis=0)
    y = (np.asarray(weight, np.float64) * seq[-KERNEL:]).sum(0) + np.asarray(bias, np.float64)
    return y / (1 + np.exp(-y)), seq[-(KERNEL - 1):]


# ---------------------------------------------------------------- inputs


def rule_inputs(rng: np.random.Generator, batch: int, length: int):
    q = rng.normal(size=(batch, length, HK, DK))
    k = rng.normal(size=(batch, length, HK, DK))
    v = rng.normal(size=(batch, length, HV, DV))
    g = -rng.uniform(0.01, 1.5, size=(batch, length, HV))
    beta = rng.uniform(0.05, 0.95, size=(batch, length, HV))
    state = 0.5 * rng.normal(size=(batch, HV, DK, DV))
    return q, k, v, g, beta, state


def as32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def random_tree(rng: np.random.Generator, nodes: int, width: int, max_depth: int) -> np.ndarray:
    """Parents [width] of a random tree of `nodes` nodes in topological order, -1 padded."""
    parents = np.full(width, -1)
    depth = np.zeros(width, int)
    for t in range(1, nodes):
        # Half the time extend the newest node, so that trees get deep as well as wide.
        if rng.random() < 0.5 and depth[t - 1] < max_depth:
            p = t - 1
        else:
            p = int(rng.choice([s for s in range(t) if depth[s] < max_depth]))
        parents[t], depth[t] = p, depth[p] + 1
    return parents


def visible_of(parents: np.ndarray, nodes: int) -> np.ndarray:
    """Ancestor-or-self mask; a padding slot sees only itself (as dflash_jax.tree.Tree)."""
    width = len(parents)
    vis = np.eye(width, dtype=bool)
    for t in range(nodes):
        vis[t, path_of(parents, t)] = True
    return vis


def tree_batch(rng, batch, width, max_depth):
    counts = [width] + [int(rng.integers(1, width + 1)) for _ in range(batch - 1)]
    parents = np.stack([random_tree(rng, n, width, max_depth) for n in counts])
    visible = np.stack([visible_of(p, n) for p, n in zip(parents, counts)])
    return counts, parents, visible


verify = jax.jit(gdn.tree_verify)
commit = jax.jit(gdn.commit_state)
# Every node of the tree as the accepted path's end at once: vmap over `last`.
commit_each = jax.jit(jax.vmap(gdn.commit_state, in_axes=(None, None, 1, 1), out_axes=1))
tree_conv = jax.jit(gdn.tree_conv)
commit_conv_each = jax.jit(jax.vmap(gdn.commit_conv_state, in_axes=(None, None, None, 1), out_axes=1))
recurrent = jax.jit(gdn.recurrent)
chunked = jax.jit(gdn.chunked, static_argnames=("chunk",))
causal_conv = jax.jit(gdn.causal_conv)


def check_tree(seed: int, batch: int, width: int, max_depth: int, tol: dict) -> None:
    """tree_verify / commit_state / tree_conv / commit_conv_state against the per-path reference
    for every node, in the ambient float precision (inputs follow the state's dtype)."""
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    rng = np.random.default_rng(seed)
    counts, parents, visible = tree_batch(rng, batch, width, max_depth)
    q, k, v, g, beta, s0 = rule_inputs(rng, batch, width)
    x = rng.normal(size=(batch, width, CHANNELS))
    cstate = rng.normal(size=(batch, KERNEL - 1, CHANNELS))
    weight, bias = rng.normal(size=(KERNEL, CHANNELS)), rng.normal(size=CHANNELS)
    cast = functools.partial(jnp.asarray, dtype=dtype)

    out, kept = verify(*map(cast, (q, k, v, g, beta, s0)), jnp.asarray(visible))
    nodes = jnp.broadcast_to(jnp.arange(width), (batch, width))
    states = commit_each(cast(s0), kept, jnp.asarray(visible), nodes)  # [B, W(last), Hv, dk, dv]
    y = tree_conv(cast(x), cast(cstate), jnp.asarray(parents), cast(weight), cast(bias))
    cstates = commit_conv_each(cast(cstate), cast(x), jnp.asarray(parents), nodes)
    assert out.dtype == dtype and states.dtype == dtype and y.dtype == dtype
    for b in range(batch):
        for t in range(counts[b]):
            path = path_of(parents[b], t)
            want_out, want_state = ref_run(q[b], k[b], v[b], g[b], beta[b], s0[b], path)
            np.testing.assert_allclose(out[b, t], want_out[-1], **tol, err_msg=f"out b{b} t{t}")
            np.testing.assert_allclose(states[b, t], want_state, **tol, err_msg=f"state b{b} t{t}")
            want_y, want_c = ref_conv_path(x[b], cstate[b], weight, bias, path)
            np.testing.assert_allclose(y[b, t], want_y, **tol, err_msg=f"conv b{b} t{t}")
            np.testing.assert_allclose(cstates[b, t], want_c, **tol, err_msg=f"conv state b{b} t{t}")


# ---------------------------------------------------------------- tests


def test_gates_match_transformers_formula():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3, HV)), rng.normal(size=(2, 3, HV))
    a_log, dt_bias = np.log(rng.uniform(0.01, 16, HV)), rng.normal(size=HV)
    g, beta = gdn.gates(*as32(a, b, a_log, dt_bias))
    ta, tb, tal, tdt = (torch.tensor(z, dtype=torch.float32) for z in (a, b, a_log, dt_bias))
    want_g = -tal.exp() * torch.nn.functional.softplus(ta + tdt)
    np.testing.assert_allclose(g, want_g.numpy(), **TOL32)
    np.testing.assert_allclose(beta, tb.sigmoid().numpy(), **TOL32)
    assert g.dtype == beta.dtype == jnp.float32


def test_recurrent_matches_float64_reference_with_ragged_lengths():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = rule_inputs(rng, 2, 9)
    lengths = np.array([9, 5])
    # Garbage in the padding slots must not reach the state.
    for x in (q, k, v):
        x[1, 5:] = 1e3
    out, state = recurrent(*as32(q, k, v, g, beta, s0), jnp.asarray(lengths))
    for b in range(2):
        want_out, want_state = ref_run(q[b], k[b], v[b], g[b], beta[b], s0[b], range(lengths[b]))
        np.testing.assert_allclose(out[b, :lengths[b]], want_out, **TOL32)
        np.testing.assert_allclose(state[b], want_state, **TOL32)
    np.testing.assert_array_equal(out[1, 5:], 0)


def test_recurrent_and_chunked_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    rng = np.random.default_rng(2)
    q, k, v, g, beta, s0 = rule_inputs(rng, 2, 11)
    t = [torch.tensor(z, dtype=torch.float32) for z in (q, k, v, g, beta, s0)]
    # The model repeats key heads to value heads before calling the rule; so do we here.
    tq, tk = (z.repeat_interleave(HV // HK, dim=2) for z in t[:2])
    kw = dict(initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_rec = hf.torch_recurrent_gated_delta_rule(tq, tk, t[2], g=t[3], beta=t[4], **kw)
    want_chunk = hf.torch_chunk_gated_delta_rule(tq, tk, t[2], g=t[3], beta=t[4], chunk_size=4, **kw)
    jax_in = as32(q, k, v, g, beta, s0)
    for got, want in ((recurrent(*jax_in), want_rec), (chunked(*jax_in, chunk=4), want_chunk),
                      (chunked(*jax_in, chunk=4), want_rec)):
        np.testing.assert_allclose(got[0], want[0].numpy(), **TOL32)
        np.testing.assert_allclose(got[1], want[1].numpy(), **TOL32)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_chunked_equals_recurrent_ragged(batch):
    rng = np.random.default_rng(3 + batch)
    q, k, v, g, beta, s0 = rule_inputs(rng, batch, 13)
    lengths = jnp.asarray([13, 6, 1][:batch])
    args = as32(q, k, v, g, beta, s0)
    want_out, want_state = recurrent(*args, lengths)
    # 13 is no multiple of 4 or 5; 64 > 13 runs as one chunk of 13.
    for chunk in (4, 5, 64):
        out, state = chunked(*args, lengths, chunk=chunk)
        np.testing.assert_allclose(out, want_out, **TOL32, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(state, want_state, **TOL32, err_msg=f"chunk {chunk}")


def test_chunked_default_chunk_over_several_chunks():
    """The prefill's own chunk (64) over 150 tokens: two full chunks and a partial one."""
    rng = np.random.default_rng(11)
    args = as32(*rule_inputs(rng, 2, 150))
    lengths = jnp.asarray([150, 70])
    out, state = chunked(*args, lengths)
    want_out, want_state = recurrent(*args, lengths)
    np.testing.assert_allclose(out, want_out, **TOL32)
    np.testing.assert_allclose(state, want_state, **TOL32)


def test_causal_conv_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 7, CHANNELS))
    state = rng.normal(size=(2, KERNEL - 1, CHANNELS))
    weight = rng.normal(size=(KERNEL, CHANNELS))
    tw = torch.tensor(weight.T, dtype=torch.float32)  # HF conv1d.weight[:, 0, :]
    tx = torch.tensor(x, dtype=torch.float32).transpose(1, 2)
    # Prefill from an empty state: transformers pads with zeros.
    want = hf.causal_conv1d_fn(tx, tw, None, activation="silu").transpose(1, 2)
    y, new = causal_conv(*as32(x, np.zeros_like(state), weight))
    np.testing.assert_allclose(y, want.numpy(), **TOL32)
    np.testing.assert_allclose(new, x[:, -(KERNEL - 1):], **TOL32)
    # Steps from a state: transformers' update rolls a [B, C, state_len] state in place.
    tstate = torch.tensor(state, dtype=torch.float32).transpose(1, 2).contiguous()
    want = hf.causal_conv1d_update(tx[:, :, :2], tstate, tw, None, activation="silu").transpose(1, 2)
    y, new = causal_conv(*as32(x[:, :2], state, weight))
    np.testing.assert_allclose(y, want.numpy(), **TOL32)
    np.testing.assert_allclose(new, tstate.transpose(1, 2).numpy(), **TOL32)


@pytest.mark.parametrize("batch", [1, 3])
def test_causal_conv_ragged_lengths(batch):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(batch, 6, CHANNELS))
    state = rng.normal(size=(batch, KERNEL - 1, CHANNELS))
    weight, bias = rng.normal(size=(KERNEL, CHANNELS)), rng.normal(size=CHANNELS)
    lengths = [6, 2, 0][:batch]
    y, new = causal_conv(*as32(x, state, weight, bias), jnp.asarray(lengths))
    for b in range(batch):
        for t in range(lengths[b]):
            want_y, _ = ref_conv_path(x[b], state[b], weight, bias, list(range(t + 1)))
            np.testing.assert_allclose(y[b, t], want_y, **TOL32)
        want_state = np.concatenate([state[b], x[b, :lengths[b]]])[-(KERNEL - 1):]
        np.testing.assert_allclose(new[b], want_state, **TOL32)


def test_chain_verify_and_every_commit_equal_the_recurrence():
    """DFlash: a chain of W nodes. Outputs equal the recurrence; for every accepted length m the
    committed recurrent and conv states equal those of running over the root + m tokens alone."""
    rng = np.random.default_rng(6)
    batch, width = 2, 8
    q, k, v, g, beta, s0 = rule_inputs(rng, batch, width)
    x = rng.normal(size=(batch, width, CHANNELS))
    cstate = rng.normal(size=(batch, KERNEL - 1, CHANNELS))
    weight = rng.normal(size=(KERNEL, CHANNELS))
    args = as32(q, k, v, g, beta, s0)
    slot = np.arange(width)
    chain = jnp.asarray(np.broadcast_to(slot[:, None] >= slot[None, :], (batch, width, width)))
    parents = jnp.asarray(np.broadcast_to(slot - 1, (batch, width)))

    out, kept = verify(*args, chain)
    want_out, _ = recurrent(*args)
    np.testing.assert_allclose(out, want_out, **TOL32)
    y = tree_conv(*as32(x, cstate), parents, jnp.asarray(weight, jnp.float32))
    want_y, _ = causal_conv(*as32(x, cstate, weight))
    np.testing.assert_allclose(y, want_y, **TOL32)

    for m in range(width):
        # The two sequences accept different lengths in the same call.
        accepted = np.array([m, width - 1 - m])
        path = jnp.asarray(slot[None, :] <= accepted[:, None])
        state = commit(args[5], kept, path, jnp.asarray(accepted))
        new_c = jax.jit(gdn.commit_conv_state)(*as32(cstate, x), parents, jnp.asarray(accepted))
        _, want_state = recurrent(*args, jnp.asarray(accepted + 1))
        _, want_c = causal_conv(*as32(x, cstate, weight), lengths=jnp.asarray(accepted + 1))
        np.testing.assert_allclose(state, want_state, **TOL32, err_msg=f"m={m}")
        np.testing.assert_allclose(new_c, want_c, **TOL32, err_msg=f"m={m}")


@pytest.mark.parametrize("width,max_depth", [(1, 0), (2, 1), (16, 15), (65, 15), (65, 3), (257, 15)])
def test_tree_verify_float64_every_node_and_path(width, max_depth):
    with jax.enable_x64(True):
        check_tree(seed=width + max_depth, batch=2, width=width, max_depth=max_depth, tol=TOL64)


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_verify_float32_every_node_and_path(batch):
    check_tree(seed=10 + batch, batch=batch, width=33, max_depth=15, tol=TOL32)


def test_closed_form_commit_equals_replaying_the_path():
    """The commit from the verify's U, K, G equals running our recurrence over the accepted
    path's nodes gathered in order (the other way to commit)."""
    rng = np.random.default_rng(7)
    batch, width = 3, 24
    counts, parents, visible = tree_batch(rng, batch, width, max_depth=15)
    q, k, v, g, beta, s0 = rule_inputs(rng, batch, width)
    args = as32(q, k, v, g, beta, s0)
    _, kept = verify(*args, jnp.asarray(visible))
    last = np.array([int(rng.integers(0, n)) for n in counts])
    state = commit(args[5], kept, jnp.asarray(visible[np.arange(batch), last]), jnp.asarray(last))
    paths = [path_of(parents[b], last[b]) for b in range(batch)]
    order = np.array([p + [0] * (width - len(p)) for p in paths])
    gathered = [jnp.take_along_axis(a, jnp.asarray(order).reshape((batch, width) + (1,) * (a.ndim - 2)), 1)
                for a in args[:5]]
    _, want = recurrent(*gathered, args[5], jnp.asarray([len(p) for p in paths]))
    np.testing.assert_allclose(state, want, **TOL32)


def test_padding_nodes_change_nothing():
    rng = np.random.default_rng(8)
    batch, width, nodes = 2, 20, 12
    parents = np.stack([random_tree(rng, nodes, width, 15) for _ in range(batch)])
    visible = np.stack([visible_of(p, nodes) for p in parents])
    q, k, v, g, beta, s0 = rule_inputs(rng, batch, width)
    x = rng.normal(size=(batch, width, CHANNELS))
    cstate = rng.normal(size=(batch, KERNEL - 1, CHANNELS))
    weight = rng.normal(size=(KERNEL, CHANNELS))
    last = jnp.asarray([nodes - 1, 3])
    path = jnp.asarray(visible[np.arange(batch), np.asarray(last)])

    def run(q, k, v, g, beta, x):
        out, kept = verify(*as32(q, k, v, g, beta, s0), jnp.asarray(visible))
        y = tree_conv(*as32(x, cstate), jnp.asarray(parents), jnp.asarray(weight, jnp.float32))
        new_c = jax.jit(gdn.commit_conv_state)(*as32(cstate, x), jnp.asarray(parents), last)
        return out[:, :nodes], commit(jnp.asarray(s0, jnp.float32), kept, path, last), y[:, :nodes], new_c

    base = run(q, k, v, g, beta, x)
    # Other finite inputs in the padding slots, with gates as `gdn.gates` makes them (g <= 0,
    # 0 < beta < 1).
    noisy = [a.copy() for a in (q, k, v, g, beta, x)]
    for a in noisy[:3] + noisy[5:]:
        a[:, nodes:] = rng.normal(size=a[:, nodes:].shape) * 50
    noisy[3][:, nodes:] = -rng.uniform(0, 20, size=noisy[3][:, nodes:].shape)
    noisy[4][:, nodes:] = rng.uniform(0, 1, size=noisy[4][:, nodes:].shape)
    for got, want in zip(run(*noisy), base):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_causal_mask_on_a_branching_tree_is_wrong():
    """Negative control: the same verify with the causal mask instead of the ancestor mask gives
    outputs that differ from the per-path recurrence on a branching tree."""
    rng = np.random.default_rng(9)
    width = 6
    parents = np.array([-1, 0, 0, 1, 2, 2])  # two branches from the root
    q, k, v, g, beta, s0 = rule_inputs(rng, 1, width)
    causal = np.tril(np.ones((1, width, width), bool))
    out, _ = verify(*as32(q, k, v, g, beta, s0), jnp.asarray(causal))
    wrong = 0
    for t in range(width):
        want, _ = ref_run(q[0], k[0], v[0], g[0], beta[0], s0[0], path_of(parents, t))
        wrong += not np.allclose(out[0, t], want[-1], rtol=1e-3, atol=1e-3)
    # Nodes 0, 1 have the same path either way; 2..5 see a wrong sibling under the causal mask.
    assert wrong == width - 2
    out, _ = verify(*as32(q, k, v, g, beta, s0), jnp.asarray(visible_of(parents, width)[None]))
    for t in range(width):
        want, _ = ref_run(q[0], k[0], v[0], g[0], beta[0], s0[0], path_of(parents, t))
        np.testing.assert_allclose(out[0, t], want[-1], **TOL32)


def test_width_513_jits():
    """The largest tree the verify must take (1 + 512 nodes): shapes only, compiled not run."""
    b, w = 1, 513
    spec = jax.ShapeDtypeStruct
    lowered = jax.jit(gdn.tree_verify).lower(
        spec((b, w, HK, DK), jnp.float32), spec((b, w, HK, DK), jnp.float32),
        spec((b, w, HV, DV), jnp.float32), spec((b, w, HV), jnp.float32),
        spec((b, w, HV), jnp.float32), spec((b, HV, DK, DV), jnp.float32), spec((b, w, w), jnp.bool_))
    kept = lowered.out_info[1]
    assert kept.u.shape == (b, HV, w, DV) and kept.decay.shape == (b, HV, w)
    assert kept.k.shape == (b, HK, w, DK)  # one key per key head, not repeated to value heads


def test_bad_inputs_name_the_argument():
    rng = np.random.default_rng(10)
    q, k, v, g, beta, s0 = as32(*rule_inputs(rng, 2, 5))
    with pytest.raises(ValueError, match="state must be"):
        gdn.recurrent(q, k, v, g, beta, s0[:1])
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn.chunked(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], s0[:, :3])
    with pytest.raises(ValueError, match="beta must be"):
        gdn.recurrent(q, k, v, g, beta[:, :4], s0)
    with pytest.raises(ValueError, match="lengths must be"):
        gdn.chunked(q, k, v, g, beta, s0, jnp.asarray([5]))
    with pytest.raises(ValueError, match="visible must be"):
        gdn.tree_verify(q, k, v, g, beta, s0, jnp.ones((2, 5, 5), jnp.float32))
    x = jnp.zeros((2, 5, CHANNELS))
    with pytest.raises(ValueError, match="conv_state must be"):
        gdn.causal_conv(x, jnp.zeros((2, KERNEL, CHANNELS)), jnp.zeros((KERNEL, CHANNELS)))
    with pytest.raises(ValueError, match="parents must be"):
        gdn.tree_conv(x, jnp.zeros((2, KERNEL - 1, CHANNELS)), jnp.zeros((2, 4), jnp.int32),
                      jnp.zeros((KERNEL, CHANNELS)))
