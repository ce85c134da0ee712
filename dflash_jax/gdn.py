"""The gated delta rule of the Qwen3.5 / Qwen3.6 hybrid targets (GDN layers), as pure functions.

Per value head the recurrent state S is a [dk, dv] matrix. With q and k L2-normalised and q
scaled by 1/sqrt(dk), one token does

    S' = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T;  o_t = S_t^T q_t.

Four forms of it live here, all taking the same inputs:
- `recurrent`: a scan over time (the one-token decode step is T = 1);
- `chunked`: the WY / UT form for prefill, one triangular solve per chunk of `chunk` tokens;
- `tree_verify`: the same form over the W nodes of a draft tree (a chain for DFlash), with the
  causal mask replaced by the ancestor-or-self mask, so that every node gets the output of the
  recurrence along its own root..node path from the committed state (its W x W chunk runs as
  `pallas_kernels.tree_gdn`'s Pallas kernel on a GPU, that module's jnp reference elsewhere; the
  chunked form shares the reference);
- `commit_state`: the state after an accepted root..last path, in closed form from what
  `tree_verify` kept (no per-node states, no second pass).
The depthwise causal conv in front of the rule has the matching `causal_conv`, `tree_conv` and
`commit_conv_state`.

Conventions shared by every function:
- q, k: [batch, T, Hk, dk] as they leave the conv (NOT normalised): each function L2-normalises
  them (x * rsqrt(sum x^2 + 1e-6), as transformers' `l2norm`) and scales q by dk ** -0.5.
- Key heads serve value heads as transformers' `repeat_interleave`: value head h reads key head
  h // (Hv // Hk).
- v: [batch, T, Hv, dv]; g, beta: [batch, T, Hv] (`gates` makes them from the projections).
- state: [batch, Hv, dk, dv]. Its dtype is the compute dtype (float32; float64 in tests), and
  outputs come back in it.
- Products run at `Precision.HIGHEST`: on GPUs the default float32 matmul may round to TF32, and
  the committed state must equal the one a plain decode would have built.
This module imports nothing from dflash_jax, so kernels and the model can both build on it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.tree_gdn import GdnImpl, tree_gdn, tree_gdn_reference

# transformers' `l2norm` adds this inside the rsqrt (matching the FLA kernels).
L2_EPS = 1e-6
# Qwen3.5 / Qwen3.6 prefill chunk (transformers' `torch_chunk_gated_delta_rule` default).
CHUNK = 64

_HI = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *ops: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *ops, precision=_HI)


def gates(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-token decay and write strength from the in_proj outputs a and b.

    a, b: [..., Hv]; a_log (the checkpoint's `A_log`), dt_bias: [Hv].
    Returns (g, beta), both float32 [..., Hv]: g = -exp(A_log) * softplus(a + dt_bias) (log of the
    decay, <= 0) and beta = sigmoid(b). float32 because exp(A_log) overflows in half precision.
    """
    heads = a.shape[-1]
    for name, x in (("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        if x.shape[-1] != heads:
            raise ValueError(f"gates: {name} has {x.shape[-1]} heads in its last axis, a has {heads}")
    f32 = jnp.float32
    g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b.astype(f32))


def _check_rule_inputs(fn: str, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, state: jax.Array) -> None:
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"{fn}: q and k must both be [batch, T, Hk, dk], got {q.shape} and {k.shape}")
    batch, length, key_heads, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (batch, length):
        raise ValueError(f"{fn}: v must be [batch={batch}, T={length}, Hv, dv], got {v.shape}")
    value_heads, dv = v.shape[2:]
    if value_heads % key_heads:
        raise ValueError(f"{fn}: value heads ({value_heads}, v) must be a multiple of key heads "
                         f"({key_heads}, q/k)")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, length, value_heads):
            raise ValueError(f"{fn}: {name} must be [batch, T, Hv] = {(batch, length, value_heads)}, "
                             f"got {x.shape}")
    if state.shape != (batch, value_heads, dk, dv):
        raise ValueError(f"{fn}: state must be [batch, Hv, dk, dv] = {(batch, value_heads, dk, dv)}, "
                         f"got {state.shape}")
    if not jnp.issubdtype(state.dtype, jnp.floating):
        raise ValueError(f"{fn}: state must be floating (it sets the compute dtype), got {state.dtype}")


def _l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _heads_major(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                 dtype: jnp.dtype, valid: jax.Array | None, repeat: bool = True
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Normalises q/k, repeats key heads to value heads (unless `repeat` is False: the tree
    kernel reads key head h // group itself), casts to `dtype`, moves heads before time.

    Returns q, k [B, Hv (or Hk), T, dk], v [B, Hv, T, dv], g, beta [B, Hv, T]. Where `valid` [B, T] is
    False, every input becomes 0: g = 0 keeps the decay at 1 and beta = 0 writes nothing, so such a
    token leaves the state exactly as it was, whatever the caller put in its slot.
    """
    group = v.shape[2] // q.shape[2]
    q = _l2_normalize(q.astype(dtype)) * (q.shape[-1] ** -0.5)
    k = _l2_normalize(k.astype(dtype))
    if repeat:
        q, k = (jnp.repeat(x, group, axis=2) for x in (q, k))
    v, g, beta = v.astype(dtype), g.astype(dtype), beta.astype(dtype)
    if valid is not None:
        q, k, v = (jnp.where(valid[:, :, None, None], x, 0) for x in (q, k, v))
        g, beta = (jnp.where(valid[:, :, None], x, 0) for x in (g, beta))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return q, k, v, g.transpose(0, 2, 1), beta.transpose(0, 2, 1)


def _valid_from_lengths(fn: str, lengths: jax.Array | None, batch: int, length: int) -> jax.Array | None:
    if lengths is None:
        return None
    if lengths.shape != (batch,):
        raise ValueError(f"{fn}: lengths must be [batch] = ({batch},), got {lengths.shape}")
    return jnp.arange(length)[None, :] < lengths[:, None]


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              state: jax.Array, lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (a `lax.scan` over T); T = 1 is the decode step.

    q, k: [B, T, Hk, dk] unnormalised; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; state [B, Hv, dk, dv].
    lengths: optional [B] int, valid tokens per sequence (right padding): tokens t >= lengths[b]
        leave the state unchanged and get output 0.
    Returns (out [B, T, Hv, dv], final state [B, Hv, dk, dv]), both in state.dtype.
    """
    _check_rule_inputs("recurrent", q, k, v, g, beta, state)
    batch, length = q.shape[:2]
    valid = _valid_from_lengths("recurrent", lengths, batch, length)
    q, k, v, g, beta = _heads_major(q, k, v, g, beta, state.dtype, valid)

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        u = b_t[..., None] * (v_t - _einsum("bhk,bhkv->bhv", k_t, s))
        s = s + k_t[..., :, None] * u[..., None, :]
        return s, _einsum("bhk,bhkv->bhv", q_t, s)

    time_major = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    # One step (decode) is unrolled: no loop around it.
    state, out = jax.lax.scan(step, state, time_major, unroll=length == 1)
    out = out.transpose(1, 0, 2, 3)  # [T, B, Hv, dv] -> [B, T, Hv, dv]
    if valid is not None:
        out = jnp.where(valid[:, :, None, None], out, 0)
    return out, state


def _advance(state: jax.Array, k: jax.Array, u: jax.Array, decay: jax.Array,
             weight_mask: jax.Array | None, last: jax.Array | None) -> jax.Array:
    """S = exp(G(l)) S0 + sum_s [mask_s] exp(G(l) - G(s)) k_s u_s^T, per sequence and head.

    state: [B, Hv, dk, dv]; k: [B, Hk, W, dk] with Hk dividing Hv (value head h reads key head
    h // (Hv // Hk)); u: [B, Hv, W, dv]; decay: [B, Hv, W]; weight_mask: [B, W] bool or None (all);
    last: [B] int, the node l, or None for the block's last node.
    """
    if last is None:
        g_last = decay[..., -1:]
    else:
        g_last = jnp.take_along_axis(decay, last[:, None, None], axis=2)  # [B, H, 1]
    diff = g_last - decay
    if weight_mask is not None:
        diff = jnp.where(weight_mask[:, None, :], diff, -jnp.inf)
    w = jnp.exp(diff)
    batch, value_heads, width, dv = u.shape
    key_heads, group = k.shape[1], value_heads // k.shape[1]
    grouped = lambda x: x.reshape((batch, key_heads, group) + x.shape[2:])
    written = _einsum("bhgs,bhsk,bhgsv->bhgkv", grouped(w), k, grouped(u))
    return jnp.exp(g_last)[..., None] * state + written.reshape(state.shape)


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            state: jax.Array, lengths: jax.Array | None = None, chunk: int = CHUNK
            ) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in the chunked WY / UT form (prefill): equal to `recurrent`.

    Same arguments and results as `recurrent`; chunk: static int, tokens per triangular solve
    (T shorter than it uses one chunk of T). T is padded to a multiple of the chunk with tokens
    that leave the state unchanged.
    """
    _check_rule_inputs("chunked", q, k, v, g, beta, state)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked: chunk must be a positive int, got {chunk!r}")
    batch, length = q.shape[:2]
    valid = _valid_from_lengths("chunked", lengths, batch, length)
    q, k, v, g, beta = _heads_major(q, k, v, g, beta, state.dtype, valid, repeat=False)
    chunk = min(chunk, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length

    def split(x: jax.Array) -> jax.Array:
        # [B, H, T, ...] -> [n_chunks, B, H, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        x = x.reshape(x.shape[:2] + (n_chunks, chunk) + x.shape[3:])
        return jnp.moveaxis(x, 2, 0)

    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))[None]

    def body(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_c, k_c, v_c, g_c, b_c = xs
        decay = jnp.cumsum(g_c, axis=-1)
        out, u = tree_gdn_reference(q_c, k_c, v_c, b_c, decay, causal, s)
        return _advance(s, k_c, u, decay, None, None), out

    state, out = jax.lax.scan(body, state, tuple(split(x) for x in (q, k, v, g, beta)),
                              unroll=n_chunks == 1)
    # [n_chunks, B, H, chunk, dv] -> [B, T, H, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, out.shape[2], n_chunks * chunk, -1)
    out = out[:, :, :length].transpose(0, 2, 1, 3)
    if valid is not None:
        out = jnp.where(valid[:, :, None, None], out, 0)
    return out, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyKept:
    """What `tree_verify` keeps for `commit_state`, per sequence, value head and node.

    k:     [B, Hk, W, dk]  normalised keys, one per key head (value head h reads h // (Hv // Hk))
    u:     [B, Hv, W, dv]  the solved U (the delta each node writes)
    decay: [B, Hv, W]      G(t), the sum of g along the root..t path
    """

    k: jax.Array
    u: jax.Array
    decay: jax.Array


def _check_visible(fn: str, visible: jax.Array, batch: int, width: int) -> None:
    if visible.shape != (batch, width, width) or visible.dtype != jnp.bool_:
        raise ValueError(f"{fn}: visible must be bool [batch, W, W] = {(batch, width, width)}, "
                         f"got {visible.dtype} {visible.shape}")


def tree_verify(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                state0: jax.Array, visible: jax.Array, *, impl: GdnImpl = "auto"
                ) -> tuple[jax.Array, VerifyKept]:
    """Every node's output of the recurrence along its own root..node path, in one pass.

    The W nodes are in topological order (a parent's slot < its children's), node 0 is the root,
    which is not yet in state0; a chain (DFlash) has parents t - 1. Inputs as `recurrent` with
    T = W, and visible [B, W, W] bool: visible[b, t, s] = s is an ancestor-or-self of t (the
    `Tree.visible` of dflash_jax.tree). Every row must see itself. A padding node that sees only
    itself and that no node sees changes nothing for the others, as long as its inputs are finite
    and its g <= 0 (as `gates` makes them): its U is multiplied by the zeros of the mask.
    G(t) = sum of g over visible[t]; D[t, s] = exp(G(t) - G(s)) where visible, else 0;
    (I + A) U = beta * (V - exp(G) * (K S0)) with A[t, s] = beta_t (k_t . k_s) D[t, s] on strict
    ancestors (one W x W unit lower triangular solve per head); O = exp(G) * (Q S0) + ((Q K^T) * D) U.
    impl: `pallas_kernels.tree_gdn.tree_gdn`'s, for everything from K S0 to O ("auto": the jnp
    reference, which XLA runs faster than the Pallas kernel; "pallas" asks for the kernel).
    Returns (out [B, W, Hv, dv] in state0.dtype, kept for `commit_state`).
    """
    _check_rule_inputs("tree_verify", q, k, v, g, beta, state0)
    batch, width = q.shape[:2]
    _check_visible("tree_verify", visible, batch, width)
    q, k, v, g, beta = _heads_major(q, k, v, g, beta, state0.dtype, None, repeat=False)
    decay = _einsum("bts,bhs->bht", visible.astype(g.dtype), g)
    out, u = tree_gdn(q, k, v, beta, decay, visible, state0, impl=impl)
    return out.transpose(0, 2, 1, 3), VerifyKept(k=k, u=u, decay=decay)


def commit_state(state0: jax.Array, kept: VerifyKept, path_mask: jax.Array, last: jax.Array) -> jax.Array:
    """The state after the accepted path root..last, from `tree_verify`'s kept values.

    state0: [B, Hv, dk, dv], the state the verify started from; path_mask: [B, W] bool, the
    accepted nodes (the root..last path: `visible[b, last[b]]`); last: [B] int, the accepted node
    the path ends at (0 when only the root is accepted).
    S = exp(G(l)) S0 + sum over s in the path of exp(G(l) - G(s)) k_s u_s^T: exact, with neither
    per-node states nor a second pass. Returns [B, Hv, dk, dv] in state0.dtype.
    """
    batch, heads, width = kept.decay.shape
    if state0.shape[:2] != (batch, heads):
        raise ValueError(f"commit_state: state0 must be [batch={batch}, Hv={heads}, dk, dv], got {state0.shape}")
    if path_mask.shape != (batch, width) or path_mask.dtype != jnp.bool_:
        raise ValueError(f"commit_state: path_mask must be bool [batch, W] = {(batch, width)}, "
                         f"got {path_mask.dtype} {path_mask.shape}")
    if last.shape != (batch,):
        raise ValueError(f"commit_state: last must be [batch] = ({batch},), got {last.shape}")
    return _advance(state0, kept.k, kept.u, kept.decay, path_mask, last.astype(jnp.int32))


def _check_conv(fn: str, x: jax.Array, conv_state: jax.Array, weight: jax.Array,
                bias: jax.Array | None) -> int:
    if x.ndim != 3:
        raise ValueError(f"{fn}: x must be [batch, T, channels], got {x.shape}")
    batch, _, channels = x.shape
    if weight.ndim != 2 or weight.shape[1] != channels or weight.shape[0] < 1:
        raise ValueError(f"{fn}: weight must be [kernel, channels={channels}], got {weight.shape}")
    kernel = weight.shape[0]
    if conv_state.shape != (batch, kernel - 1, channels):
        raise ValueError(f"{fn}: conv_state must be [batch, kernel - 1, channels] = "
                         f"{(batch, kernel - 1, channels)}, got {conv_state.shape}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"{fn}: bias must be [channels] = ({channels},), got {bias.shape}")
    return kernel


def _conv_taps(taps: list[jax.Array], weight: jax.Array, bias: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """taps: kernel arrays [B, N, C], oldest input first; returns silu(sum_j w[j] x_j + bias) as dtype.

    Computed in float32 at least (float64 inputs stay float64). One multiply-add per tap, so XLA
    fuses the taps' reads (gathers, in a tree) into one elementwise pass: as an einsum over a
    stacked [B, N, kernel, C] window the tree's conv was a reduction fusion of 3.1 ms a DDTree(256)
    round at Qwen3.6-27B (48 GDN layers, H100).
    """
    acc = jnp.promote_types(dtype, jnp.float32)
    weight = weight.astype(acc)
    y = sum(x.astype(acc) * weight[j] for j, x in enumerate(taps))
    if bias is not None:
        y = y + bias.astype(acc)
    return jax.nn.silu(y).astype(dtype)


def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array, bias: jax.Array | None = None,
                lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal conv then SiLU, for prefill and decode steps.

    x: [B, T, C], the concatenated q/k/v channels of T new tokens; conv_state: [B, kernel - 1, C],
    the last kernel - 1 inputs before them, oldest first (zeros for a fresh sequence);
    weight: [kernel, C], weight[kernel - 1] multiplies the current token (transformers'
    `conv1d.weight[:, 0, :].T`); bias: optional [C]. Computed in float32 (or float64).
    lengths: optional [B] int, valid tokens (right padding); outputs past them are unspecified.
    Returns (y [B, T, C] in x.dtype, the new conv state [B, kernel - 1, C] in conv_state.dtype: the
    last kernel - 1 inputs up to each sequence's last valid token, reaching into the old state).
    """
    kernel = _check_conv("causal_conv", x, conv_state, weight, bias)
    batch, length, _ = x.shape
    history = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, kernel - 1 + T, C]
    y = _conv_taps([history[:, j:j + length] for j in range(kernel)], weight, bias, x.dtype)
    if lengths is None:
        new_state = history[:, length:]
    else:
        if lengths.shape != (batch,):
            raise ValueError(f"causal_conv: lengths must be [batch] = ({batch},), got {lengths.shape}")
        rows = lengths[:, None] + jnp.arange(kernel - 1)[None, :]
        new_state = jnp.take_along_axis(history, rows[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)


def _lag_rows(parents: jax.Array, nodes: jax.Array, lags: int, kernel: int) -> jax.Array:
    """Rows of [conv_state; x] holding each node's input `lag` steps up its path, lag 0..lags-1.

    parents: [B, W] (-1 at a root); nodes: [B, N]. Row kernel - 1 + n is node n, rows
    0..kernel - 2 the conv state (oldest first). Past the root the walk continues into the state,
    newest first. Returns [B, N, lags] int32.
    """
    width = parents.shape[1]
    parents = parents.astype(jnp.int32)
    row = kernel - 1 + nodes.astype(jnp.int32)
    rows = [row]
    for _ in range(lags - 1):
        is_node = row >= kernel - 1
        node = jnp.clip(row - (kernel - 1), 0, width - 1)
        parent = jnp.take_along_axis(parents, node, axis=1)
        from_node = jnp.where(parent >= 0, kernel - 1 + parent, kernel - 2)
        row = jnp.where(is_node, from_node, row - 1)
        rows.append(row)
    return jnp.stack(rows, axis=-1)


def _check_parents(fn: str, parents: jax.Array, batch: int, width: int) -> None:
    if parents.shape != (batch, width) or not jnp.issubdtype(parents.dtype, jnp.integer):
        raise ValueError(f"{fn}: parents must be integer [batch, W] = {(batch, width)}, "
                         f"got {parents.dtype} {parents.shape}")


def tree_conv(x: jax.Array, conv_state: jax.Array, parents: jax.Array, weight: jax.Array,
              bias: jax.Array | None = None) -> jax.Array:
    """The causal conv over each tree node's own path.

    x: [B, W, C], the nodes' conv inputs in topological order; parents: [B, W] int, the parent
    slot (< the node's), -1 for the root (and for padding, as `Tree.parents`); the rest as
    `causal_conv`. Node t's window is itself, its parent, grandparent, ..., and once the path
    reaches past the root, the committed conv state (newest first). A chain equals `causal_conv`.
    Returns y [B, W, C] in x.dtype.
    """
    kernel = _check_conv("tree_conv", x, conv_state, weight, bias)
    batch, width, _ = x.shape
    _check_parents("tree_conv", parents, batch, width)
    history = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    nodes = jnp.broadcast_to(jnp.arange(width), (batch, width))
    rows = _lag_rows(parents, nodes, kernel, kernel)[..., ::-1]  # oldest first, as the weight
    taps = [jnp.take_along_axis(history, rows[:, :, j, None], axis=1) for j in range(kernel)]
    return _conv_taps(taps, weight, bias, x.dtype)


def commit_conv_state(conv_state: jax.Array, x: jax.Array, parents: jax.Array, last: jax.Array) -> jax.Array:
    """The conv state after the accepted path root..last: its last kernel - 1 conv inputs.

    conv_state: [B, kernel - 1, C], the state the verify started from; x: [B, W, C], the nodes'
    conv inputs; parents: [B, W] as `tree_conv`; last: [B] int, the last accepted node.
    A path shorter than kernel - 1 is padded from the old state. Returns [B, kernel - 1, C] in
    conv_state.dtype.
    """
    if x.ndim != 3 or conv_state.ndim != 3 or conv_state.shape[::2] != x.shape[::2]:
        raise ValueError(f"commit_conv_state: conv_state [batch, kernel - 1, C] and x [batch, W, C] "
                         f"disagree: {conv_state.shape} and {x.shape}")
    batch, width, _ = x.shape
    _check_parents("commit_conv_state", parents, batch, width)
    if last.shape != (batch,):
        raise ValueError(f"commit_conv_state: last must be [batch] = ({batch},), got {last.shape}")
    kernel = conv_state.shape[1] + 1
    if kernel == 1:
        return conv_state
    history = jnp.concatenate([conv_state, x.astype(conv_state.dtype)], axis=1)
    rows = _lag_rows(parents, last[:, None], kernel - 1, kernel)[:, 0, ::-1]  # [B, kernel - 1]
    return jnp.take_along_axis(history, rows[:, :, None], axis=1)
