"""The drafter's decoding layouts (`drafter.draft_specs`) and the block pass of the block-qkv one
on the target's fused path (`model.attend_fused`).

The block-qkv layout (kv heads split over tp) holds q, k and v as one `qkv` and every layer's
k and v stacked in `context_kv`; the q + kv layout (kv heads replicated over tp) holds q apart
and k, v as one `kv`. On CPU: the block-qkv layout against the checkpoint tensors it is made of,
the block pass with the fused path forced (the epilogue in interpret mode, the attention on rows
by the reference) against the q + kv layout's block pass, in float32 and bfloat16, and the
lowering for cuda at the Qwen3-8B drafter's shape. On an H100/H200
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
from dflash_jax.params import assemble, is_spec
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
    return model_lib.init_params(cfg, jax.random.key(7), dtype)


def separate_params(dcfg: dr.DraftConfig, dtype) -> dr.DraftParams:
    """Random drafter weights in the checkpoint layout with norms and biases away from their
    ones / zeros, so they matter."""
    base = dr.init_draft_params(dcfg, jax.random.key(3), training=True)
    leaves, treedef = jax.tree.flatten(base)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) if x.ndim < 2 else x for x, k in zip(leaves, keys)]
    return jax.tree.map(lambda x: x.astype(dtype), jax.tree.unflatten(treedef, noisy))


def block_qkv_layout(sep: dr.DraftParams, dcfg: dr.DraftConfig) -> dr.DraftParams:
    """The decoding layout where kv heads are split over tp (one device: tp 1)."""
    return assemble(dr.draft_param_layout(dcfg), sep)


def q_kv_layout(sep: dr.DraftParams, dcfg: dr.DraftConfig) -> dr.DraftParams:
    """The decoding layout where kv heads are replicated over tp (laid out here on one device)."""
    return assemble(dr.draft_param_layout(dcfg, 2 * dcfg.num_kv_heads), sep)


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
def test_block_pass_on_the_fused_path_matches_the_q_kv_layout(variant, dtype, monkeypatch):
    """Hidden states, logits and the returned cache (block K/V in the full layers' scratch
    slots) equal the q + kv layout's; the epilogue runs once per full layer; shortened
    blocks (block_len) too. Without the forced schedule (CPU), the layout's usual path gives the
    same values as well."""
    dcfg = draft_config(**VARIANTS[variant])
    target = target_for(dcfg, dtype)
    sep = separate_params(dcfg, dtype)
    fused = q_kv_layout(sep, dcfg)
    joint = block_qkv_layout(sep, dcfg)
    block_len = jnp.array([16, 11], jnp.int32)
    # float32: the same ops in another order; bf16: one unit in the last place of the largest
    # value (2^-7 of it at most; bf16 keeps 8 significant bits). Both orders round, and which way
    # a value near a boundary goes depends on the CPU's code: on one CPU they came out equal,
    # on another two of 1830 logits differed by one unit at 2.0.
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    usual = run_block(joint, dcfg, target, dtype, block_len)  # CPU: no schedule, the jnp path
    calls = force_fused_path(monkeypatch)
    want = run_block(fused, dcfg, target, dtype, block_len)
    assert not calls  # the q + kv layout has no qkv: its usual path
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
    joint = block_qkv_layout(separate_params(dcfg, jnp.bfloat16), dcfg)
    cache = dr.DraftCache.create(dcfg, 1, 32, jnp.float32)
    block = dr.make_block(dcfg, jnp.array([3], jnp.int32))
    dr.draft_with_cache(joint, dcfg, target_for(dcfg, jnp.bfloat16), cache, block, cache.lengths)
    assert not calls


@pytest.mark.parametrize("bias", [False, True])
def test_decoding_layouts_hold_the_checkpoint_tensors_in_place(bias):
    """block-qkv: qkv holds, per kv head, its q heads, then k, then v; context_kv every layer's
    k and v, stacked; q + kv: q apart, kv = k then v; gate_up = gate then up in both; every
    other weight is the checkpoint's own; the specs give the shapes."""
    dcfg = draft_config(attention_bias=bias)
    sep = separate_params(dcfg, jnp.float32)
    joint, fused = block_qkv_layout(sep, dcfg), q_kv_layout(sep, dcfg)
    e, kvh, hd = dcfg.hidden_size, dcfg.num_kv_heads, dcfg.head_dim
    group = dcfg.num_heads // kvh
    a = np.asarray
    for i, (s_, j, f) in enumerate(zip(sep.layers, joint.layers, fused.layers)):
        q = a(s_.attn.q).reshape(e, kvh, group, hd)  # q head h belongs to kv head h // group
        np.testing.assert_array_equal(a(j.attn.qkv[:, :, :group]), q)
        np.testing.assert_array_equal(a(j.attn.qkv[:, :, group]), a(s_.attn.k))
        np.testing.assert_array_equal(a(j.attn.qkv[:, :, group + 1]), a(s_.attn.v))
        np.testing.assert_array_equal(a(joint.context_kv[:, i, :, 0]), a(s_.attn.k))
        np.testing.assert_array_equal(a(joint.context_kv[:, i, :, 1]), a(s_.attn.v))
        np.testing.assert_array_equal(a(f.attn.q), a(s_.attn.q))
        np.testing.assert_array_equal(a(f.attn.kv[:, :, 0]), a(s_.attn.k))
        np.testing.assert_array_equal(a(f.attn.kv[:, :, 1]), a(s_.attn.v))
        for lp in (j, f):
            np.testing.assert_array_equal(a(lp.mlp.gate_up[:, 0]), a(s_.mlp.gate))
            np.testing.assert_array_equal(a(lp.mlp.gate_up[:, 1]), a(s_.mlp.up))
            for name in ("o", "q_norm", "k_norm"):
                np.testing.assert_array_equal(a(getattr(lp.attn, name)), a(getattr(s_.attn, name)))
            np.testing.assert_array_equal(a(lp.mlp.down), a(s_.mlp.down))
            assert lp.attn.k is None and lp.attn.v is None and lp.mlp.gate is None and lp.mlp.up is None
        assert j.attn.q is None and j.attn.kv is None and f.attn.qkv is None
        if bias:
            np.testing.assert_array_equal(a(j.attn.qkv_bias[:, :group]), a(s_.attn.q_bias).reshape(kvh, group, hd))
            np.testing.assert_array_equal(a(j.attn.qkv_bias[:, group]), a(s_.attn.k_bias))
            np.testing.assert_array_equal(a(j.attn.qkv_bias[:, group + 1]), a(s_.attn.v_bias))
            np.testing.assert_array_equal(a(joint.context_kv_bias[i, :, 1]), a(s_.attn.v_bias))
            np.testing.assert_array_equal(a(f.attn.kv_bias[:, 0]), a(s_.attn.k_bias))
            np.testing.assert_array_equal(a(f.attn.o_bias), a(s_.attn.o_bias))
        else:
            assert j.attn.qkv_bias is None and joint.context_kv_bias is None
    assert fused.context_kv is None
    for params, specs in ((joint, dr.draft_specs(dcfg)), (fused, dr.draft_specs(dcfg, 2 * kvh))):
        assert jax.tree.map(lambda s: s.shape, specs, is_leaf=is_spec) == jax.tree.map(lambda x: x.shape, params)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest's CPU devices)")
def test_block_qkv_under_tp_is_sharded_by_kv_head_and_drafts_the_same():
    """At tp 2 (kv heads split) qkv is sharded by kv head as the target's and the block pass
    gives the unsharded values (the usual path: the fused one runs without a mesh); at tp 4
    (kv heads replicated) the layout has no qkv, as `model.can_fuse` says."""
    from dflash_jax import sharding as sh
    dcfg = draft_config()
    sep = separate_params(dcfg, jnp.float32)
    target = target_for(dcfg, jnp.float32)
    want = run_block(q_kv_layout(sep, dcfg), dcfg, target, jnp.float32)
    mesh = sh.make_mesh(1, 2)
    joint = assemble(dr.draft_param_layout(dcfg, 2), sep, sharding=sh.placement(mesh))
    group = dcfg.num_heads // dcfg.num_kv_heads
    assert {x.data.shape for x in joint.layers[0].attn.qkv.addressable_shards} == {
        (dcfg.hidden_size, dcfg.num_kv_heads // 2, group + 2, dcfg.head_dim)}
    with sh.use_mesh(mesh):  # jitted: op by op, each sharded op would compile on its own
        got = jax.jit(run_block, static_argnums=(1, 3))(joint, dcfg, target, jnp.float32)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, 1e-5)
    replicated = dr.init_draft_params(dcfg, jax.random.key(0), mesh=sh.make_mesh(1, 4))
    assert replicated.layers[0].attn.qkv is None and replicated.context_kv is None
    assert replicated.layers[0].attn.kv.sharding.is_fully_replicated


def abstract(tree, dtype):
    """A Spec tree -> ShapeDtypeStructs."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), tree, is_leaf=is_spec)


@pytest.mark.parametrize("block_qkv", [True, False])
def test_block_pass_lowers_for_cuda_at_the_qwen3_8b_shape(block_qkv, monkeypatch):
    """The jitted block pass of a 2-layer drafter of Qwen3-8B's shape (16 tokens x group 4) with
    the Hopper dispatch as on an H200: in the block-qkv layout one qkv product, one epilogue
    kernel and one Mosaic attention kernel a layer, the caches updated in place, no XLA cache
    writes; in the q + kv layout no epilogue."""
    from dflash_jax.bench.spec_round import drafter_config
    monkeypatch.setattr(hopper, "available", lambda: True)
    cfg = SHAPES["qwen3-8b"]
    dcfg = drafter_config(cfg, layers=2)
    bf16 = jnp.bfloat16
    dparams = abstract(dr.draft_specs(dcfg, 1 if block_qkv else 2 * dcfg.num_kv_heads), bf16)
    target = abstract(model_lib.model_specs(cfg), bf16)
    buf = jax.ShapeDtypeStruct((1, 5120, dcfg.num_kv_heads, dcfg.head_dim), bf16)
    cache = dr.DraftCache(k=(buf,) * 2, v=(buf,) * 2, lengths=jax.ShapeDtypeStruct((1,), jnp.int32))
    block = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    start = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = jax.jit(functools.partial(dr.draft_with_cache, dcfg=dcfg, attn_impl="pallas"), donate_argnames=("cache",))
    text = fn.trace(dparams, target_params=target, cache=cache, block_tokens=block, block_start=start
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2  # the Hopper kernel in both layouts
    # Per layer: qkv (block-qkv) or q and kv (q + kv), then o, gate_up and down.
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
def test_gpu_block_pass_on_the_fused_path_matches_the_q_kv_layout(variant):
    """bf16 on the GPU: the block-qkv layout takes the fused path (epilogue + Hopper kernel) and
    gives the q + kv layout's hidden states, logits and caches (which take the same Hopper
    kernel), and both are near the reference attention."""
    dcfg = draft_config(hidden_size=256, num_heads=16, num_kv_heads=4, head_dim=128, **VARIANTS[variant])
    bf16 = jnp.bfloat16
    target = target_for(dcfg, bf16)
    sep = separate_params(dcfg, bf16)
    fused = q_kv_layout(sep, dcfg)
    joint = block_qkv_layout(sep, dcfg)
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
    the q + kv layout's."""
    from dflash_jax.bench.spec_round import drafter_config
    cfg = SHAPES["qwen3-8b"]
    dcfg = drafter_config(cfg, layers=2)
    bf16 = jnp.bfloat16
    sep = dr.init_draft_params(dcfg, jax.random.key(1), bf16, training=True)
    fused = q_kv_layout(sep, dcfg)
    joint = block_qkv_layout(sep, dcfg)
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

@pytest.mark.parametrize("layout", ["q-kv", "block-qkv"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_context_rows_through_the_kv_epilogue_match_xla(layout, dtype):
    """`append_context` with one `kv_epilogue` launch a layer (interpret mode) writes the same
    caches as XLA's path: every slot, the scratch rows past `counts` included, and the lengths."""
    dcfg = draft_config()
    make = block_qkv_layout if layout == "block-qkv" else q_kv_layout
    dparams = make(separate_params(dcfg, dtype), dcfg)
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
    caches as the q + kv layout's per-layer `kv` products do, bias included."""
    dcfg = draft_config(attention_bias=True)
    sep = separate_params(dcfg, jnp.float32)
    fused, joint = q_kv_layout(sep, dcfg), block_qkv_layout(sep, dcfg)
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
    fused = q_kv_layout(separate, dcfg)
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
    dparams = block_qkv_layout(separate_params(dcfg, jnp.bfloat16), dcfg)
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
