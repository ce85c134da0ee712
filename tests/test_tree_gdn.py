"""The tree-GDN verify kernel (pallas_kernels.tree_gdn): interpret mode against its jnp reference
and against a float64 numpy recurrence written here, node by node from each node's parent state
(the per-path recurrence: a node's state is its parent's advanced by the node); `cuda` lowering on
CPU; GPU parity tests (`-k gpu_`) that skip without a GPU."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import gdn
from pallas_kernels.tree_gdn import (
    MAX_BLOCKS,
    PRECISIONS,
    default_block_sizes,
    default_dots,
    impl_for_attention,
    resolve_impl,
    tree_gdn,
    tree_gdn_pallas,
    tree_gdn_reference,
)

ON_GPU = jax.default_backend() == "gpu"
MAX_DEPTH = 15


def random_tree(rng: np.random.Generator, width: int, padding: int) -> np.ndarray:
    """Parents [width] of a random tree of width - padding nodes in topological order, depth <=
    MAX_DEPTH, then `padding` padding nodes (parent -2: they see only themselves)."""
    nodes = width - padding
    parents = np.full(width, -2)
    parents[0] = -1
    depth = np.zeros(width, int)
    for t in range(1, nodes):
        allowed = np.flatnonzero(depth[:t] < MAX_DEPTH)
        # Mostly one of the latest nodes (deep paths), sometimes any (wide branching).
        if rng.random() < 0.6:
            parents[t] = allowed[-1 - int(rng.integers(min(3, len(allowed))))]
        else:
            parents[t] = allowed[int(rng.integers(len(allowed)))]
        depth[t] = depth[parents[t]] + 1
    return parents


def visible_of(parents: np.ndarray) -> np.ndarray:
    """[W, W] bool ancestor-or-self; a padding node (parent -2) sees itself only."""
    width = len(parents)
    vis = np.eye(width, dtype=bool)
    for t in range(width):
        if parents[t] >= 0:
            vis[t] |= vis[parents[t]]
    return vis


def make_case(seed: int, batch: int, key_heads: int, group: int, width: int, dim: int, padding: int = 0):
    """float64 numpy inputs of the kernel's contract, and the parents [batch, W]."""
    rng = np.random.default_rng(seed)
    value_heads = key_heads * group

    def unit(*shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(batch, key_heads, width, dim) * dim ** -0.5
    k = unit(batch, key_heads, width, dim)
    v = rng.standard_normal((batch, value_heads, width, dim))
    beta = rng.uniform(0, 1, (batch, value_heads, width))
    g = -rng.uniform(0, 1.5, (batch, value_heads, width))
    parents = np.stack([random_tree(rng, width, padding) for _ in range(batch)])
    visible = np.stack([visible_of(p) for p in parents])
    decay = np.einsum("bts,bhs->bht", visible.astype(np.float64), g)
    state0 = rng.standard_normal((batch, value_heads, dim, dim)) * 0.3
    return (q, k, v, beta, decay, visible, state0), g, parents


def recurrence(args, g: np.ndarray, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every node's output o_t and written delta u_t by the gated delta rule along its path,
    float64: S' = exp(g_t) S_parent; u_t = beta_t (v_t - S'^T k_t); S_t = S' + k_t u_t^T;
    o_t = S_t^T q_t. Padding nodes get NaN (nothing defines them)."""
    q, k, v, beta, _, _, state0 = args
    batch, value_heads, width, dim = v.shape
    group = value_heads // q.shape[1]
    out = np.full(v.shape, np.nan)
    u = np.full(v.shape, np.nan)
    for b in range(batch):
        for h in range(value_heads):
            states = {}
            for t in range(width):
                if parents[b, t] == -2:
                    continue
                prev = state0[b, h] if parents[b, t] == -1 else states[parents[b, t]]
                s = np.exp(g[b, h, t]) * prev
                kt, qt = k[b, h // group, t], q[b, h // group, t]
                u[b, h, t] = beta[b, h, t] * (v[b, h, t] - s.T @ kt)
                states[t] = s + np.outer(kt, u[b, h, t])
                out[b, h, t] = states[t].T @ qt
    return out, u


def as32(args):
    return tuple(jnp.asarray(a) if a.dtype == bool else jnp.asarray(a, jnp.float32) for a in args)


def check_close(got: jax.Array, want: np.ndarray, parents: np.ndarray, tol: float, what: str) -> None:
    real = (parents != -2)[:, None, :, None]
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite value"
    err = np.max(np.abs(np.where(real, got - want, 0.0)))
    scale = max(1.0, np.max(np.abs(np.where(real, want, 0.0))))
    assert err <= tol * scale, f"{what}: max error {err:.3g} against scale {scale:.3g}"


CASES = [  # batch, key heads, group, W, dk = dv, padding nodes
    (2, 1, 2, 1, 64, 0),
    (2, 1, 2, 16, 64, 3),
    (2, 1, 2, 64, 128, 5),
    (2, 2, 2, 40, 64, 0),     # W not a multiple of the block: padded inside the kernel too
    (2, 1, 2, 257, 128, 9),
]


@pytest.mark.parametrize("batch,key_heads,group,width,dim,padding", CASES)
def test_interpret_kernel_matches_reference_and_recurrence(batch, key_heads, group, width, dim, padding):
    args, g, parents = make_case(width + dim, batch, key_heads, group, width, dim, padding)
    out, u = jax.jit(functools.partial(tree_gdn_pallas, interpret=True))(*as32(args))
    ref_out, ref_u = tree_gdn_reference(*as32(args))
    want_out, want_u = recurrence(args, g, parents)
    check_close(out, want_out, parents, 1e-5, "kernel O vs recurrence")
    check_close(u, want_u, parents, 1e-5, "kernel U vs recurrence")
    check_close(out, np.asarray(ref_out), parents, 1e-5, "kernel O vs reference")
    check_close(u, np.asarray(ref_u), parents, 1e-5, "kernel U vs reference")


@pytest.mark.parametrize("width,padding", [(1, 0), (2, 0), (17, 0), (33, 4), (66, 3)])
def test_reference_matches_recurrence_in_float64(width, padding):
    """The doubling solve of (I + A) U = rhs at W = 1 + a power of two (17: one block of 16 rows;
    66 pads 65 rows to 128, three levels above the blocks of 16) against the per-path recurrence."""
    args, g, parents = make_case(3 + width, 2, 2, 2, width, 16, padding=padding)
    with jax.enable_x64(True):
        out, u = tree_gdn_reference(*(jnp.asarray(a) for a in args))
        out, u = np.asarray(out), np.asarray(u)
    want_out, want_u = recurrence(args, g, parents)
    check_close(out, want_out, parents, 1e-12, "reference O")
    check_close(u, want_u, parents, 1e-12, "reference U")


def test_reference_float32_at_w257():
    """DDTree(256)'s width in float32 (the model's dtype for the chunk): within 1e-5."""
    args, g, parents = make_case(257, 1, 1, 2, 257, 32, padding=5)
    out, u = tree_gdn_reference(*as32(args))
    want_out, want_u = recurrence(args, g, parents)
    check_close(out, want_out, parents, 1e-5, "reference O")
    check_close(u, want_u, parents, 1e-5, "reference U")


def test_ancestor_mask_matters():
    """Negative control: the kernel given the causal mask instead of the tree's misses the
    recurrence on a branching tree (so the comparisons above can fail)."""
    args, g, parents = make_case(4, 1, 1, 2, 16, 16)
    assert np.any(parents[0, 2:] != np.arange(1, 15))  # the tree branches
    want_out, _ = recurrence(args, g, parents)
    causal = np.broadcast_to(np.tril(np.ones((16, 16), bool)), args[5].shape)
    wrong = as32(args[:5] + (causal,) + args[6:])
    out, _ = tree_gdn_pallas(*wrong, interpret=True)
    assert np.max(np.abs(np.asarray(out, np.float64) - want_out)) > 1e-2


@pytest.mark.parametrize("block,block_v,share_keys", [(16, 64, False), (32, 16, False), (64, 32, False),
                                                      (32, 32, True), (64, 64, True)])
def test_tilings_agree(block, block_v, share_keys):
    """Row blocks, value-column splits and programs per key head are tiling choices: 64 nodes in
    4 blocks of 16, 2 of 32 or 1 of 64 (the block kernel alone), dv 64 whole or in programs of 16
    or 32 columns, the GQA pair of value heads in one program or two, give the same."""
    args, g, parents = make_case(5, 1, 2, 2, 64, 64, padding=2)
    out, u = tree_gdn_pallas(*as32(args), block=block, block_v=block_v, share_keys=share_keys, interpret=True)
    want_out, want_u = recurrence(args, g, parents)
    what = f"block {block}, block_v {block_v}, share_keys {share_keys}"
    check_close(out, want_out, parents, 1e-5, f"O at {what}")
    check_close(u, want_u, parents, 1e-5, f"U at {what}")


@pytest.mark.parametrize("block", [16, 64])
def test_aligned_keys_on_a_chain_stay_exact(block):
    """A 64-node chain (a causal chunk) whose keys nearly align, with beta near 1 and gates near 0:
    the block inverse's entries stay small while powers of A grow like binomials (the product of
    (I + (-A)^(2^m)) factors misses this chain's (I + A)^-1 by 1e9 in float32). The blockwise
    doubling inverse keeps the kernel within 1e-5 of the recurrence, in one block of 64 and in
    four of 16, and so does the reference's doubling solve."""
    rng = np.random.default_rng(12)
    width, dim = 64, 64
    (q, _, v, _, _, _, state0), _, _ = make_case(12, 1, 1, 2, width, dim)
    parents = np.arange(-1, width - 1)[None]
    visible = np.tril(np.ones((width, width), bool))[None]
    k = rng.standard_normal(dim) + 0.05 * rng.standard_normal((1, 1, width, dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.9, 1.0, (1, 2, width))
    g = -rng.uniform(0, 0.02, (1, 2, width))
    args = (q, k, v, beta, np.cumsum(g, axis=-1), visible, state0)
    out, u = tree_gdn_pallas(*as32(args), block=block, interpret=True)
    want_out, want_u = recurrence(args, g, parents)
    assert np.max(np.abs(want_u)) > 2  # the solve does amplify here
    check_close(out, want_out, parents, 1e-5, f"O in blocks of {block}")
    check_close(u, want_u, parents, 1e-5, f"U in blocks of {block}")
    out, u = tree_gdn_reference(*as32(args))
    check_close(out, want_out, parents, 1e-5, "reference O")
    check_close(u, want_u, parents, 1e-5, "reference U")


def test_tree_verify_interpret_equals_reference():
    """gdn.tree_verify (unnormalised [B, W, H, d] inputs, GQA 2) gives the same outputs and kept
    values through the kernel as through the reference."""
    rng = np.random.default_rng(6)
    batch, width, key_heads, value_heads, dim = 2, 24, 2, 4, 16
    parents = np.stack([random_tree(rng, width, 2) for _ in range(batch)])
    visible = jnp.asarray(np.stack([visible_of(p) for p in parents]))
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f32(batch, width, key_heads, dim), f32(batch, width, key_heads, dim), f32(batch, width, value_heads, dim)
    g, beta = gdn.gates(f32(batch, width, value_heads), f32(batch, width, value_heads),
                        f32(value_heads), f32(value_heads))
    s0 = f32(batch, value_heads, dim, dim)
    runs = {impl: gdn.tree_verify(q, k, v, g, beta, s0, visible, impl=impl) for impl in ("reference", "interpret")}
    (out_r, kept_r), (out_i, kept_i) = runs["reference"], runs["interpret"]
    real = jnp.asarray(parents != -2)
    np.testing.assert_allclose(jnp.where(real[:, :, None, None], out_i, 0),
                               jnp.where(real[:, :, None, None], out_r, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.where(real[:, None, :, None], kept_i.u, 0),
                               jnp.where(real[:, None, :, None], kept_r.u, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kept_i.k, kept_r.k)
    np.testing.assert_array_equal(kept_i.decay, kept_r.decay)


def test_auto_is_reference_on_every_backend():
    attention = ("auto", "pallas", "triton", "reference", "interpret")
    assert [impl_for_attention(a, 128, 128) for a in attention] == ["auto", "auto", "auto", "reference", "interpret"]
    assert [impl_for_attention(a, 8, 6) for a in attention] == ["auto", "auto", "auto", "reference", "reference"]
    assert resolve_impl("auto", "cpu") == "reference"
    assert resolve_impl("auto", "gpu") == "reference"  # the kernel still loses to XLA (BENCHMARKS.md)
    assert resolve_impl("pallas", "gpu") == "pallas"
    assert resolve_impl("interpret") == "interpret"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")


def test_bad_input_names_the_tensor():
    args = as32(make_case(7, 1, 1, 2, 16, 16)[0])
    with pytest.raises(ValueError, match="state0 must be"):
        tree_gdn(*args[:6], args[6][:, :1])
    with pytest.raises(ValueError, match="decay must be"):
        tree_gdn(*args[:4], args[4][:, :, :3], *args[5:])
    with pytest.raises(ValueError, match="block=24 must be a power of two"):
        tree_gdn_pallas(*args, block=24, interpret=True)
    with pytest.raises(ValueError, match="block_v=32 exceeds dv=16"):
        tree_gdn_pallas(*args, block_v=32, interpret=True)
    with pytest.raises(ValueError, match="precision must be one of ieee, tf32x3, got 'tf32'"):
        tree_gdn_pallas(*args, precision="tf32", interpret=True)
    wide = as32(make_case(7, 1, 1, 1, 300, 16)[0])
    with pytest.raises(ValueError, match="W=300 in blocks of 16 is 19 blocks, more than 17"):
        tree_gdn_pallas(*wide, block=16, interpret=True)
    odd = as32(make_case(7, 1, 1, 2, 16, 24)[0])
    with pytest.raises(ValueError, match="dk=24 must be a power of two"):
        tree_gdn_pallas(*odd, interpret=True)


def test_default_block_sizes_are_triton_blocks():
    """Powers of two >= 16 (Triton's dot), W padded no further than its next power of two, at most
    MAX_BLOCKS blocks up to W = 1 + 512, dv split until batch 1 at 48 value heads fills 128
    programs and until the substitution's U fits in registers."""
    for width in (1, 2, 16, 17, 64, 257, 288, 289, 513):
        for batch, heads in ((1, 48), (4, 48), (2, 4)):
            blocks = default_block_sizes(batch, heads, width, 128, 128)
            for size in (blocks.block, blocks.block_v):
                assert size >= 16 and size & (size - 1) == 0
            assert blocks.block <= max(16, 1 << (width - 1).bit_length())
            assert -(-width // blocks.block) <= MAX_BLOCKS
            assert 128 % blocks.block_v == 0
            assert blocks.precision in PRECISIONS
    # W = 257 in 17 blocks of 16 (in blocks of 32 the substitution spilled from registers).
    assert (default_block_sizes(1, 48, 257, 128, 128).block, default_block_sizes(1, 48, 257, 128, 128).block_v) == (16, 32)
    assert default_block_sizes(4, 48, 64, 128, 128).block_v == 128
    assert default_block_sizes(4, 48, 257, 128, 128).block_v == 32
    assert (default_block_sizes(1, 48, 513, 128, 128).block, default_block_sizes(1, 48, 513, 128, 128).block_v) == (32, 16)
    assert default_block_sizes(1, 48, 16, 128, 128).block == 16  # the block kernel alone


def shapes(batch: int, key_heads: int, value_heads: int, width: int, dim: int):
    spec = jax.ShapeDtypeStruct
    f32 = jnp.float32
    return (spec((batch, key_heads, width, dim), f32), spec((batch, key_heads, width, dim), f32),
            spec((batch, value_heads, width, dim), f32), spec((batch, value_heads, width), f32),
            spec((batch, value_heads, width), f32), spec((batch, width, width), jnp.bool_),
            spec((batch, value_heads, dim, dim), f32))


# The tilings to time against the defaults on a GPU (gdn_verify_bench --tilings "32,32,4,2,ieee
# 64,32,4,2,ieee 64,32,4,2 64,32,8,2 32,64,4,2 32,128,4,2 32,32,4,2,tf32x3,share
# 64,32,4,2,tf32x3,share"): each must at least lower.
VARIANTS = [dict(block=32, precision="ieee"), dict(block=64, precision="ieee"), dict(block=64),
            dict(block=64, num_warps=8), dict(block=32, block_v=64), dict(block=32, block_v=128),
            dict(block=32, share_keys=True), dict(block=64, share_keys=True)]


def lower_for_cuda(width: int, **tiling) -> str:
    fn = functools.partial(tree_gdn_pallas, **tiling)
    return jax.jit(fn).trace(*shapes(1, 16, 48, width, 128)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("width", [16, 64, 257, 513])
def test_kernel_lowers_for_cuda(width):
    """Qwen3.6-27B's GDN shape (16 key heads, 48 value heads of 128) at the default tiling: the
    block kernel alone for W = 16, the substitution after it beyond."""
    text = lower_for_cuda(width)
    assert text.count("__gpu$xla.gpu.triton") == (1 if width <= 16 else 2)


@pytest.mark.parametrize("tiling", VARIANTS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_variants_lower_for_cuda(tiling):
    assert lower_for_cuda(257, **tiling).count("__gpu$xla.gpu.triton") == 2


def test_precision_reaches_the_kernel():
    """ieee and tf32x3 lower to different Triton kernels (the dots' input precision is in them)."""
    assert lower_for_cuda(64, precision="ieee") != lower_for_cuda(64, precision="tf32x3")


GPU_CASES = [  # batch, key heads, group, W, dk = dv, padding nodes
    (1, 16, 3, 16, 128, 0),
    (1, 16, 3, 64, 128, 2),
    (1, 16, 3, 257, 128, 0),
    (2, 2, 2, 513, 128, 7),
    (2, 4, 2, 100, 64, 3),
]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch,key_heads,group,width,dim,padding", GPU_CASES)
def test_gpu_kernel_matches_reference_and_recurrence(batch, key_heads, group, width, dim, padding, precision):
    args, g, parents = make_case(width, batch, key_heads, group, width, dim, padding)
    out, u = jax.jit(functools.partial(tree_gdn_pallas, precision=precision))(*as32(args))
    want_out, want_u = recurrence(args, g, parents)
    check_close(out, want_out, parents, 2e-5, "GPU kernel O")
    check_close(u, want_u, parents, 2e-5, "GPU kernel U")
    ref_out, _ = jax.jit(tree_gdn_reference)(*as32(args))
    check_close(out, np.asarray(ref_out), parents, 2e-5, "GPU kernel O vs reference")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_auto_runs_what_resolve_impl_says():
    text = jax.jit(tree_gdn).lower(*shapes(1, 16, 48, 64, 128)).as_text()
    assert ("__gpu$xla.gpu.triton" in text) == (resolve_impl("auto", "gpu") == "pallas")


def test_hybrid_verify_through_the_interpreted_kernel():
    """The tiny hybrid's verify of a random tree from random committed states, with the kernels
    interpreted (attn_impl "interpret": the GDN chunk's kernel too), gives the logits and committed
    GDN states of the jnp path (attn_impl "reference")."""
    from dflash_jax import qwen3_5
    from dflash_jax.bench.common import SHAPES

    cfg = SHAPES["tiny-hybrid"]
    params = qwen3_5.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(11)
    batch, ctx, width = 2, 5, 12
    cache = qwen3_5.HybridCache.create(cfg, batch, 32)
    cache = dataclasses.replace(
        cache, lengths=jnp.full((batch,), ctx, jnp.int32),
        **{name: tuple(jnp.asarray(rng.standard_normal(x.shape) * 0.3, jnp.float32) for x in getattr(cache, name))
           for name in ("k", "v", "conv", "state")})
    parents = np.stack([random_tree(rng, width, 1) for _ in range(batch)])
    visible = np.stack([visible_of(p) for p in parents])
    depth = visible.sum(-1) - 1
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    args = (tokens, jnp.asarray(ctx + depth, jnp.int32), jnp.asarray(visible), jnp.asarray(np.maximum(parents, -1)),
            cache)
    # The accepted path: root..the last real node, slots by depth, padded with its last slot.
    nodes = [np.flatnonzero(visible[b, width - 2]) for b in range(batch)]
    path = jnp.asarray([np.pad(n, (0, MAX_DEPTH + 1 - len(n)), mode="edge") for n in nodes], jnp.int32)
    accepted = jnp.asarray([len(n) for n in nodes], jnp.int32)

    def run(attn_impl):
        logits, _, verified = jax.jit(functools.partial(qwen3_5.verify, params, cfg, attn_impl=attn_impl))(*args)
        return logits, qwen3_5.commit(verified, path, accepted).state

    want = run("reference")
    got = run("interpret")
    # The interpreted program holds the GDN kernel (and the reference one does not).
    programs = {impl: str(jax.make_jaxpr(functools.partial(qwen3_5.verify, params, cfg, attn_impl=impl))(*args))
                for impl in ("reference", "interpret")}
    assert "tree_gdn" in programs["interpret"] and "tree_gdn" not in programs["reference"]
    real = jnp.asarray(parents != -2)[:, :, None]
    np.testing.assert_allclose(jnp.where(real, got[0], 0), jnp.where(real, want[0], 0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_reference_tf32x3_lowers_for_cuda():
    """The reference's TF32x3 dots (its float32 default on a GPU) lower for cuda, with the
    algorithm in every dot; the IEEE reference has none."""
    def text(dots):
        fn = functools.partial(tree_gdn_reference, dots=dots)
        return jax.jit(fn).trace(*shapes(1, 16, 48, 65, 128)).lower(lowering_platforms=("cuda",)).as_text()
    fast, exact = text("tf32x3"), text("ieee")
    assert fast.count("dot_general") == exact.count("dot_general") > 0
    assert fast.count("tf32") >= fast.count("dot_general") and "tf32" not in exact


def test_default_dots():
    """TF32x3 for float32 on a GPU only: IEEE on the CPU (which refuses TF32) and for float64
    and bfloat16 on a GPU."""
    assert default_dots(jnp.float32, "gpu") == "tf32x3"
    assert default_dots(jnp.float32, "cpu") == "ieee"
    assert default_dots(jnp.float64, "gpu") == default_dots(jnp.bfloat16, "gpu") == "ieee"


def test_reference_refuses_unknown_dots():
    args, _, _ = make_case(1, 1, 1, 1, 4, 16)
    with pytest.raises(ValueError, match="dots must be one of"):
        tree_gdn_reference(*as32(args), dots="bf16")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("width", [16, 65, 257])
def test_gpu_reference_matches_recurrence(width):
    """The reference on the GPU at each dot precision (TF32x3 its default) within 2e-5 of the recurrence."""
    args, g, parents = make_case(width, 1, 4, 3, width, 128, padding=1)
    want_out, want_u = recurrence(args, g, parents)
    for dots in PRECISIONS:
        out, u = jax.jit(functools.partial(tree_gdn_reference, dots=dots))(*as32(args))
        check_close(out, want_out, parents, 2e-5, f"GPU reference O ({dots})")
        check_close(u, want_u, parents, 2e-5, f"GPU reference U ({dots})")
