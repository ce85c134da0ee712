"""The drafter's block-qkv layout (`drafter.fuse_draft_projections(block_qkv=True)`) and its
block pass on the target's fused path (`model.attend_fused`).

On CPU: the layout against the plain fused one (every other weight kept, qkv = q + kv), its
checks, the block pass with the fused path forced (the epilogue in interpret mode, the
attention on rows by the reference) against the plain fused layout's block pass, in float32
and bfloat16, and the lowering for cuda at the Qwen3-8B drafter's shape. On an H100/H200
(`JAX_PLATFORMS=cuda pytest tests/test_drafter_block_qkv.py`): the compiled block pass of both
layouts and the reference attention.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import drafter as dr
from dflash_jax import model as model_lib
from dflash_jax.bench.common import SHAPES
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.params import is_spec
from pallas_kernels import tree_attention_reference

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")
epilogue = importlib.import_module("pallas_kernels.qkv_epilogue")

ON_HOPPER = hopper.available()
VOCAB = 61
FULL, SLIDING = dr.FULL_ATTENTION, dr.SLIDING_ATTENTION


def draft_config(**kw) -> dr.DraftConfig:
    """A 3-layer drafter of group 4 (16 tokens x 4 heads = 64 rows, as Qwen3-8B's drafter)."""
    base = dict(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32,
                vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 1), num_target_layers=2,
                block_size=16, rope=RopeConfig(theta=1e4))
    return dr.DraftConfig(**{**base, **kw})


def target_for(dcfg: dr.DraftConfig, dtype) -> model_lib.ModelParams:
    """A target whose embedding (all the drafter reads of it) fits the drafter."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=dcfg.vocab_size, hidden_size=dcfg.hidden_size,
                      intermediate_size=96, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True)
    return model_lib.init_params(cfg, jax.random.key(7), dtype, fused=True)


def separate_params(dcfg: dr.DraftConfig, dtype) -> dr.DraftParams:
    """Random drafter weights with norms and biases away from their ones / zeros, so they matter."""
    base = dr.init_draft_params(dcfg, jax.random.key(3))
    leaves, treedef = jax.tree.flatten(base)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) if x.ndim < 2 else x for x, k in zip(leaves, keys)]
    return jax.tree.map(lambda x: x.astype(dtype), jax.tree.unflatten(treedef, noisy))


def force_fused_path(monkeypatch) -> list:
    """The fused path where the Hopper kernel cannot run: any shape gets a schedule, the
    epilogue runs in interpret mode and the attention on rows is the reference. Returns the
    list that gets one entry per epilogue launch."""
    calls = []
    real = epilogue.qkv_epilogue

    def rows_schedule(batch, width, q_heads, kv_heads, head_dim, max_len, dtype, impl="auto"):
        return hopper.schedule(batch, kv_heads, width * (q_heads // kv_heads), max_len)

    def attention_on_rows(q_rows, k, v, prefix_lens, visible, *, width, group, sched, scale=None):
        q = hopper.tokens_of(q_rows, width, group)
        return tree_attention_reference(q, k, v, prefix_lens, visible, scale=scale)

    monkeypatch.setattr(model_lib, "rows_schedule", rows_schedule)
    monkeypatch.setattr(model_lib, "tree_attention_rows", attention_on_rows)
    monkeypatch.setattr(epilogue, "qkv_epilogue", lambda *a, **kw: calls.append(1) or real(*a, **kw, interpret=True))
    return calls


def run_block(dparams, dcfg, target, dtype, block_len=None, attn_impl="reference"):
    """Context of 9 / 5 rows, then one block pass: (hidden, logits, the returned cache)."""
    batch, n = 2, 9
    taps = jax.random.normal(jax.random.key(1), (batch, n, dcfg.num_taps * dcfg.hidden_size)).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    cache = dr.DraftCache.create(dcfg, batch, 64, dtype)
    # Non-zero scratch, so a slot written by one path and not the other shows.
    cache = dataclasses.replace(cache, k=tuple(k + 0.5 for k in cache.k), v=tuple(v - 0.25 for v in cache.v))
    cache = dr.append_context(dparams, dcfg, cache, taps, positions, jnp.array([9, 5], jnp.int32))
    block = dr.make_block(dcfg, jnp.array([3, 5], jnp.int32))
    hidden, out = dr.draft_with_cache(dparams, dcfg, target, cache, block, cache.lengths, block_len,
                                      attn_impl=attn_impl)
    return hidden, dr.draft_logits(dparams, dcfg, target, hidden), out


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


VARIANTS = {
    "full": {},
    "sliding_and_causal": dict(layer_types=(FULL, SLIDING, FULL), sliding_window=5, is_causal=True),
    "bias": dict(attention_bias=True),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_pass_on_the_fused_path_matches_the_fused_layout(variant, dtype, monkeypatch):
    """Hidden states, logits and the returned cache (block K/V in the full layers' scratch
    slots) equal the plain fused layout's; the epilogue runs once per full layer; shortened
    blocks (block_len) too. Without the forced schedule (CPU), the layout's usual path gives the
    same values as well."""
    dcfg = draft_config(**VARIANTS[variant])
    target = target_for(dcfg, dtype)
    sep = separate_params(dcfg, dtype)
    fused = dr.fuse_draft_projections(sep, dcfg)
    joint = dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    block_len = jnp.array([16, 11], jnp.int32)
    # float32: the same ops in another order; bf16: one unit in the last place of the largest
    # value (2^-7 of it at most; bf16 keeps 8 significant bits). Both orders round, and which way
    # a value near a boundary goes depends on the CPU's code: on one machine they came out
    # equal, on another two of 1830 logits differed by one unit at 2.0.
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    usual = run_block(joint, dcfg, target, dtype, block_len)  # CPU: no schedule, the jnp path
    calls = force_fused_path(monkeypatch)
    want = run_block(fused, dcfg, target, dtype, block_len)
    assert not calls  # the plain fused layout has no qkv: its usual path
    got = run_block(joint, dcfg, target, dtype, block_len)
    full_layers = sum(dcfg.layer_window(i) is None for i in range(dcfg.num_layers))
    assert len(calls) == full_layers
    for other in (got, usual):
        for g, w in zip(jax.tree.leaves(other), jax.tree.leaves(want)):
            assert_close(g, w, tol)
    np.testing.assert_array_equal(np.asarray(got[2].lengths), np.asarray(want[2].lengths))


def test_fused_path_needs_the_cache_in_the_activation_dtype(monkeypatch):
    """A float32 cache under bf16 activations keeps the usual path (the schedule says no)."""
    dcfg = draft_config()
    calls = force_fused_path(monkeypatch)
    joint = dr.fuse_draft_projections(separate_params(dcfg, jnp.bfloat16), dcfg, block_qkv=True)
    cache = dr.DraftCache.create(dcfg, 1, 32, jnp.float32)
    block = dr.make_block(dcfg, jnp.array([3], jnp.int32))
    dr.draft_with_cache(joint, dcfg, target_for(dcfg, jnp.bfloat16), cache, block, cache.lengths)
    assert not calls


@pytest.mark.parametrize("bias", [False, True])
def test_block_qkv_layout_keeps_every_other_weight(bias):
    """qkv holds q then kv per kv head; context_kv every layer's kv, stacked; every other weight
    is the plain fused layout's own; the specs describe it; converting again is a no-op; from
    the fused layout it is the same."""
    dcfg = draft_config(attention_bias=bias)
    sep = separate_params(dcfg, jnp.float32)
    fused = dr.fuse_draft_projections(sep, dcfg)
    joint = dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    assert dr.draft_attention_layout(sep) == "separate"
    assert dr.draft_attention_layout(fused) == "fused" and not dr.is_draft_block_qkv(fused)
    assert dr.draft_attention_layout(joint) == "block-qkv"
    assert dr.is_draft_block_qkv(joint) and dr.is_draft_fused(joint)
    group = dcfg.num_heads // dcfg.num_kv_heads
    for f, j in zip(fused.layers, joint.layers):
        e = dcfg.hidden_size
        assert j.attn.q is None and j.attn.q_bias is None
        np.testing.assert_array_equal(np.asarray(j.attn.qkv[:, :, :group]),
                                      np.asarray(f.attn.q).reshape(e, dcfg.num_kv_heads, group, dcfg.head_dim))
        np.testing.assert_array_equal(np.asarray(j.attn.qkv[:, :, group:]), np.asarray(f.attn.kv))
        assert j.attn.kv is None and j.attn.kv_bias is None
        if bias:
            np.testing.assert_array_equal(np.asarray(j.attn.qkv_bias[:, :group]),
                                          np.asarray(f.attn.q_bias).reshape(dcfg.num_kv_heads, group, -1))
            np.testing.assert_array_equal(np.asarray(j.attn.qkv_bias[:, group:]), np.asarray(f.attn.kv_bias))
        else:
            assert j.attn.qkv_bias is None
    for i, f in enumerate(fused.layers):
        np.testing.assert_array_equal(np.asarray(joint.context_kv[:, i]), np.asarray(f.attn.kv))
        if bias:
            np.testing.assert_array_equal(np.asarray(joint.context_kv_bias[i]), np.asarray(f.attn.kv_bias))
    assert (joint.context_kv_bias is None) == (not bias)
    # Every weight but q / kv -> qkv / context_kv is the plain fused layout's, unchanged.
    strip = lambda dp: dataclasses.replace(dp, context_kv=None, context_kv_bias=None, layers=tuple(  # noqa: E731
        dataclasses.replace(lp, attn=dataclasses.replace(lp.attn, q=None, q_bias=None, qkv=None, qkv_bias=None,
                                                         kv=None, kv_bias=None))
        for lp in dp.layers))
    assert jax.tree.structure(strip(fused)) == jax.tree.structure(strip(joint))
    for a, b in zip(jax.tree.leaves(strip(fused)), jax.tree.leaves(strip(joint))):
        assert a is b or np.array_equal(np.asarray(a), np.asarray(b))
    # The specs describe the layout, leaf for leaf.
    specs = dr.fused_draft_specs(dcfg, block_qkv=True)
    shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=is_spec)
    assert shapes == jax.tree.map(lambda x: x.shape, joint)
    assert jax.tree.structure(dr.fused_draft_specs(dcfg), is_leaf=is_spec) == jax.tree.structure(fused)
    # Idempotent, and the same from the plain fused layout; block-qkv asked for the plain one stays.
    assert dr.fuse_draft_projections(joint, dcfg, block_qkv=True) is joint
    assert dr.fuse_draft_projections(joint, dcfg) is joint
    assert dr.fuse_draft_projections(fused, dcfg) is fused
    again = dr.fuse_draft_projections(fused, dcfg, block_qkv=True)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(joint)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_consume_frees_q_and_kv():
    dcfg = draft_config()
    fused = dr.fuse_draft_projections(separate_params(dcfg, jnp.float32), dcfg)
    q0, kv0 = fused.layers[0].attn.q, fused.layers[0].attn.kv
    joint = dr.fuse_draft_projections(fused, dcfg, consume=True, block_qkv=True)
    assert q0.is_deleted() and kv0.is_deleted() and not joint.context_kv.is_deleted()
    sep = separate_params(dcfg, jnp.float32)
    k0 = sep.layers[0].attn.k
    joint = dr.fuse_draft_projections(sep, dcfg, consume=True, block_qkv=True)
    assert k0.is_deleted() and dr.is_draft_block_qkv(joint)


def test_layouts_that_cannot_draft_are_refused():
    dcfg = draft_config()
    sep = separate_params(dcfg, jnp.float32)
    joint = dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    # The target's layout: qkv alone, no context_kv for the context pass.
    target_like = dataclasses.replace(joint, context_kv=None)
    with pytest.raises(ValueError, match=r"layer 0 holds the projections \['qkv'\] without a context_kv"):
        dr.fuse_draft_projections(target_like, dcfg, block_qkv=True)
    # A context_kv beside per-layer kv weights is no layout either.
    fused = dr.fuse_draft_projections(sep, dcfg)
    with pytest.raises(ValueError, match=r"\['q', 'kv'\] with a context_kv"):
        dr.draft_attention_layout(dataclasses.replace(fused, context_kv=joint.context_kv))
    mixed = dataclasses.replace(fused, layers=(sep.layers[0],) + fused.layers[1:])
    with pytest.raises(ValueError, match="mix layouts"):
        dr.draft_attention_layout(mixed)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest's CPU devices)")
def test_block_qkv_under_tp_is_sharded_by_kv_head_and_drafts_the_same():
    """At tp 2 (kv heads split) qkv is sharded by kv head as the target's and the block pass
    gives the unsharded values (the usual path: the fused one runs without a mesh); at tp 4
    (kv heads replicated) no qkv is made, as `model.can_fuse` says."""
    from dflash_jax import sharding as sh
    dcfg = draft_config()
    sep = separate_params(dcfg, jnp.float32)
    target = target_for(dcfg, jnp.float32)
    want = run_block(dr.fuse_draft_projections(sep, dcfg), dcfg, target, jnp.float32)
    mesh = sh.make_mesh(1, 2)
    placed = jax.device_put(sep, sh.draft_param_shardings(dcfg, mesh))
    joint = dr.fuse_draft_projections(placed, dcfg, block_qkv=True)
    group = dcfg.num_heads // dcfg.num_kv_heads
    assert {x.data.shape for x in joint.layers[0].attn.qkv.addressable_shards} == {
        (dcfg.hidden_size, dcfg.num_kv_heads // 2, group + 2, dcfg.head_dim)}
    with sh.use_mesh(mesh):  # jitted: op by op, each sharded op would compile on its own
        got = jax.jit(run_block, static_argnums=(1, 3))(joint, dcfg, target, jnp.float32)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 1e-5)
    mesh4 = sh.make_mesh(1, 4)
    replicated = dr.fuse_draft_projections(jax.device_put(sep, sh.draft_param_shardings(dcfg, mesh4)), dcfg,
                                           block_qkv=True)
    assert dr.draft_attention_layout(replicated) == "fused"


def abstract(tree, dtype):
    """A Spec tree -> ShapeDtypeStructs."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), tree, is_leaf=is_spec)


@pytest.mark.parametrize("block_qkv", [True, False])
def test_block_pass_lowers_for_cuda_at_the_qwen3_8b_shape(block_qkv, monkeypatch):
    """The jitted block pass of a 2-layer drafter of Qwen3-8B's shape (16 tokens x group 4) with
    the Hopper dispatch as on an H200: in the block-qkv layout one qkv product, one epilogue
    kernel and one Mosaic attention kernel a layer, the caches updated in place, no XLA cache
    writes; in the plain fused layout no epilogue."""
    from dflash_jax.bench.spec_round import drafter_config
    monkeypatch.setattr(hopper, "available", lambda: True)
    cfg = SHAPES["qwen3-8b"]
    dcfg = drafter_config(cfg, layers=2)
    bf16 = jnp.bfloat16
    dparams = abstract(dr.fused_draft_specs(dcfg, block_qkv=block_qkv), bf16)
    target = abstract(model_lib.model_specs(cfg, fused=True), bf16)
    buf = jax.ShapeDtypeStruct((1, 5120, dcfg.num_kv_heads, dcfg.head_dim), bf16)
    cache = dr.DraftCache(k=(buf,) * 2, v=(buf,) * 2, lengths=jax.ShapeDtypeStruct((1,), jnp.int32))
    block = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    start = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = jax.jit(functools.partial(dr.draft_with_cache, dcfg=dcfg, attn_impl="pallas"), donate_argnames=("cache",))
    text = fn.trace(dparams, target_params=target, cache=cache, block_tokens=block, block_start=start
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2  # the Hopper kernel in both layouts
    # Per layer: qkv (block-qkv) or q and kv (plain fused), then o, gate_up and down.
    assert text.count("stablehlo.dot_general") == 2 * (4 if block_qkv else 5)
    if block_qkv:
        assert text.count('name = "qkv_epilogue"') == 2
        assert "stablehlo.scatter" not in text  # the epilogue writes the block's K/V in place
        assert text.count("tf.aliasing_output") == 5  # both layers' K and V caches, and the lengths
    else:
        assert "qkv_epilogue" not in text
        assert text.count("stablehlo.scatter") >= 4  # `write_rows`, K and V of both layers


# ----------------------------------------------------------------------------- H100 / H200

@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["full", "sliding_and_causal"])
def test_gpu_block_pass_on_the_fused_path_matches_the_fused_layout(variant):
    """bf16 on the GPU: the block-qkv layout takes the fused path (epilogue + Hopper kernel) and
    gives the plain fused layout's hidden states, logits and caches (which take the same Hopper
    kernel), and both are near the reference attention."""
    dcfg = draft_config(hidden_size=256, num_heads=16, num_kv_heads=4, head_dim=128, **VARIANTS[variant])
    bf16 = jnp.bfloat16
    target = target_for(dcfg, bf16)
    sep = separate_params(dcfg, bf16)
    fused = dr.fuse_draft_projections(sep, dcfg)
    joint = dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    cache = dr.DraftCache.create(dcfg, 2, 64, bf16)
    assert model_lib.epilogue_schedule(joint, dcfg.layer_config(), 2, 16, cache, bf16, "pallas") is not None
    assert model_lib.epilogue_schedule(fused, dcfg.layer_config(), 2, 16, cache, bf16, "pallas") is None
    run = jax.jit(run_block, static_argnames=("dcfg", "dtype", "attn_impl"))
    block_len = jnp.array([16, 11], jnp.int32)
    got = run(joint, dcfg, target, bf16, block_len, attn_impl="pallas")
    want = run(fused, dcfg, target, bf16, block_len, attn_impl="pallas")
    ref = run(fused, dcfg, target, bf16, block_len, attn_impl="reference")
    for g, w, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(ref)):
        assert_close(g, w, 2 ** -6)
        assert_close(g, r, 0.05)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_block_pass_compiles_the_epilogue_at_the_qwen3_8b_shape():
    """The block pass of a 2-layer drafter of Qwen3-8B's shape (context 4000 of 5120 slots) in
    the block-qkv layout dispatches to the epilogue on this GPU, and its compiled values match
    the plain fused layout's."""
    from dflash_jax.bench.spec_round import drafter_config
    cfg = SHAPES["qwen3-8b"]
    dcfg = drafter_config(cfg, layers=2)
    bf16 = jnp.bfloat16
    sep = dr.init_draft_params(dcfg, jax.random.key(1), bf16)
    fused = dr.fuse_draft_projections(sep, dcfg)
    joint = dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    embed = jax.random.normal(jax.random.key(2), (cfg.vocab_size, cfg.hidden_size), bf16)
    target = model_lib.ModelParams(embed=embed, layers=(), final_norm=jnp.ones((cfg.hidden_size,), bf16))
    cache = dr.DraftCache.create(dcfg, 1, 5120, bf16)
    k = jax.random.normal(jax.random.key(3), cache.k[0].shape, bf16)
    cache = dataclasses.replace(cache, k=(k, k), v=(k * 0.5, k * 0.5), lengths=jnp.array([4000], jnp.int32))
    block = dr.make_block(dcfg, jnp.array([11], jnp.int32))
    fn = jax.jit(dr.draft_with_cache, static_argnames=("dcfg", "attn_impl"))
    assert 'name = "qkv_epilogue"' in fn.lower(joint, dcfg, target, cache, block, cache.lengths).as_text()
    assert "qkv_epilogue" not in fn.lower(fused, dcfg, target, cache, block, cache.lengths).as_text()
    got = fn(joint, dcfg, target, cache, block, cache.lengths)
    want = fn(fused, dcfg, target, cache, block, cache.lengths)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 2 ** -6)


# ----------------------------------------------------------------------------- the context rows

@pytest.mark.parametrize("layout", ["fused", "block-qkv"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_context_rows_through_the_kv_epilogue_match_xla(layout, dtype):
    """`append_context` with one `kv_epilogue` launch a layer (interpret mode) writes the same
    caches as XLA's path: every slot, the scratch rows past `counts` included, and the lengths."""
    dcfg = draft_config()
    dparams = dr.fuse_draft_projections(separate_params(dcfg, dtype), dcfg, block_qkv=layout == "block-qkv")
    batch, n = 2, 11
    taps = jax.random.normal(jax.random.key(5), (batch, n, dcfg.num_taps * dcfg.hidden_size)).astype(dtype)
    cache = dr.DraftCache.create(dcfg, batch, 64, dtype)
    cache = dataclasses.replace(cache, k=tuple(k + 0.5 for k in cache.k), v=tuple(v - 0.25 for v in cache.v),
                                lengths=jnp.array([3, 20], jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
    counts = jnp.array([11, 4], jnp.int32)
    got = dr.append_context(dparams, dcfg, cache, taps, positions, counts, epilogue="interpret")
    want = dr.append_context(dparams, dcfg, cache, taps, positions, counts, epilogue="xla")
    np.testing.assert_array_equal(np.asarray(got.lengths), [14, 24])
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    for g, w in zip(got.k + got.v, want.k + want.v):
        assert_close(g, w, tol)


@pytest.mark.parametrize("epilogue", ["xla", "interpret"])
def test_stacked_context_kv_writes_what_each_layers_kv_writes(epilogue):
    """The block-qkv layout's one product for every layer's context rows (`context_kv`) fills the
    caches as the plain fused layout's per-layer `kv` products do, bias included."""
    dcfg = draft_config(attention_bias=True)
    sep = separate_params(dcfg, jnp.float32)
    fused, joint = dr.fuse_draft_projections(sep, dcfg), dr.fuse_draft_projections(sep, dcfg, block_qkv=True)
    batch, n = 2, 9
    taps = jax.random.normal(jax.random.key(7), (batch, n, dcfg.num_taps * dcfg.hidden_size))
    cache = dr.DraftCache.create(dcfg, batch, 48, jnp.float32)
    cache = dataclasses.replace(cache, lengths=jnp.array([5, 17], jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
    counts = jnp.array([9, 2], jnp.int32)
    got = dr.append_context(joint, dcfg, cache, taps, positions, counts, epilogue=epilogue)
    want = dr.append_context(fused, dcfg, cache, taps, positions, counts, epilogue=epilogue)
    for g, w in zip(got.k + got.v, want.k + want.v):
        assert_close(g, w, 1e-6)


def test_kv_epilogue_layer_must_name_one_of_the_stack():
    from pallas_kernels.qkv_epilogue import kv_epilogue
    kv = jnp.zeros((1, 4, 3, 2, 2, 32))
    cache = jnp.zeros((1, 16, 2, 32))
    cos = jnp.ones((1, 4, 32))
    with pytest.raises(ValueError, match="layer=3"):
        kv_epilogue(kv, None, cos, cos, cache, cache, jnp.zeros((1,), jnp.int32), eps=1e-6, layer=3)
    with pytest.raises(ValueError, match="layer=0"):
        kv_epilogue(kv[:, :, 0], None, cos, cos, cache, cache, jnp.zeros((1,), jnp.int32), eps=1e-6, layer=0)


def test_context_epilogue_choices(monkeypatch):
    """"auto" takes the launch only on a GPU, without a mesh, with fused kv weights and a k norm;
    a name outside CONTEXT_EPILOGUES is refused by name."""
    dcfg = draft_config()
    separate = separate_params(dcfg, jnp.bfloat16)
    fused = dr.fuse_draft_projections(separate, dcfg)
    cache = dr.DraftCache.create(dcfg, 1, 64, jnp.bfloat16)
    assert dr.context_epilogue_applies(fused, cache, jnp.bfloat16, backend="gpu")
    assert not dr.context_epilogue_applies(fused, cache, jnp.bfloat16, backend="cpu")
    assert not dr.context_epilogue_applies(separate, cache, jnp.bfloat16, backend="gpu")  # no kv weight
    assert not dr.context_epilogue_applies(fused, cache, jnp.float32, backend="gpu")  # cache dtype differs
    taps = jnp.zeros((1, 2, dcfg.num_taps * dcfg.hidden_size), jnp.bfloat16)
    pos = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        dr.append_context(fused, dcfg, cache, taps, pos, jnp.ones((1,), jnp.int32), epilogue="triton")


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_context_rows_kernel_matches_xla():
    """On the GPU "auto" takes the `kv_epilogue` launch (head_dim 128, 8 kv heads, as Qwen3-8B's
    drafter) and writes what XLA's path writes, 16 context rows after 4000 committed slots."""
    dcfg = draft_config(hidden_size=256, num_heads=32, num_kv_heads=8, head_dim=128, num_layers=2)
    dparams = dr.fuse_draft_projections(separate_params(dcfg, jnp.bfloat16), dcfg, block_qkv=True)
    cache = dr.DraftCache.create(dcfg, 1, 5120, jnp.bfloat16)
    cache = dataclasses.replace(cache, lengths=jnp.array([4000], jnp.int32))
    assert dr.context_epilogue_applies(dparams, cache, jnp.bfloat16)
    taps = jax.random.normal(jax.random.key(6), (1, 16, dcfg.num_taps * dcfg.hidden_size)).astype(jnp.bfloat16)
    positions = cache.lengths[:, None] + jnp.arange(16, dtype=jnp.int32)
    counts = jnp.array([7], jnp.int32)
    run = jax.jit(dr.append_context, static_argnames=("dcfg", "epilogue"))
    got = run(dparams, dcfg, cache, taps, positions, counts, epilogue="auto")
    want = run(dparams, dcfg, cache, taps, positions, counts, epilogue="xla")
    for g, w in zip(got.k + got.v, want.k + want.v):
        assert_close(g[:, 4000:4016], w[:, 4000:4016], 2 ** -7)
        assert not np.any(np.asarray(g[:, :4000], np.float32)) and not np.any(np.asarray(g[:, 4016:], np.float32))
