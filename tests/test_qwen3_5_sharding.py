"""Tensor and data parallelism for the Qwen3.5 / Qwen3.6 hybrid on 4 fake CPU devices (float32).

GDN key/value heads, conv channels and recurrent states, the gated attention's heads, the MLP and
the vocabulary split over tp; sequences over dp. The sharded program must give the single-device
tokens exactly (greedy AR with `qwen3_5.generate`, greedy DFlash with a random drafter) and the
same logits within float32 rounding; its compiled HLO must all-reduce once per row-parallel
projection and gather no weight.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import drafter as dr
from dflash_jax import qwen3_5 as q35
from dflash_jax import sharding as sh
from dflash_jax.params import spec_leaves_with_paths
from dflash_jax.pipeline import pad_prompts
from dflash_jax.speculative import SpecSettings, generate_speculative

L_, F_ = q35.LINEAR, q35.FULL
VOCAB = 8  # divides by 4: the vocabulary is split at tp = 4 too
NEW = 16
MAX_LEN = 64
# tp = 4 splits 4 GDN key heads (2 value heads each) and 4 q heads, and replicates the 2 kv heads.
MESHES = [(1, 2), (2, 2), (1, 4)]


def tiny_config(tied: bool = False) -> q35.Qwen35Config:
    return q35.Qwen35Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                            layer_types=(L_, L_, L_, F_) * 2, num_heads=4, num_kv_heads=2, head_dim=16,
                            rotary_dim=4, gdn_key_heads=4, gdn_value_heads=8, gdn_key_dim=8, gdn_value_dim=6,
                            rope=q35.RopeConfig(theta=10000.0), tie_word_embeddings=tied)


def perturbed(params: q35.Qwen35Params, seed: int) -> q35.Qwen35Params:
    """Non-trivial norm weights (the default draw has them all 0 or 1), so a misplaced shard of a
    norm would change the output."""
    leaves, treedef = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                        if "norm" in jax.tree_util.keystr(p) else x
                                        for (p, x), k in zip(leaves, keys)])


@functools.lru_cache(maxsize=None)
def target() -> tuple[q35.Qwen35Config, q35.Qwen35Params]:
    cfg = tiny_config()
    return cfg, perturbed(q35.init_params(cfg, jax.random.key(1)), 2)


def placed(params: q35.Qwen35Params, cfg: q35.Qwen35Config, mesh) -> q35.Qwen35Params:
    return jax.device_put(params, sh.specs_shardings(q35.model_specs(cfg), mesh))


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[jax.Array, jax.Array]:
    rng = np.random.RandomState(5)
    arr, lens = pad_prompts([rng.randint(0, VOCAB, rng.randint(2, 12)).tolist() for _ in range(4)], 12)
    return jnp.asarray(arr), jnp.asarray(lens)


def token_lists(tokens, num_tokens) -> list:
    toks, n = np.asarray(tokens), np.asarray(num_tokens)
    return [toks[b, :n[b]].tolist() for b in range(toks.shape[0])]


@functools.lru_cache(maxsize=None)
def ar_tokens() -> list:
    cfg, params = target()
    return token_lists(*q35.generate(params, cfg, *prompts(), jax.random.key(0), max_new_tokens=NEW,
                                     max_len=MAX_LEN))


def prefill_logits(params, cfg, arr, lens) -> jax.Array:
    batch, width = arr.shape
    cache = q35.HybridCache.create(cfg, batch, MAX_LEN)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    return q35.forward(params, cfg, arr, positions, cache, lens).logits


def local_shapes(x: jax.Array) -> set:
    return {s.data.shape for s in x.addressable_shards}


@pytest.mark.parametrize("dp,tp", MESHES)
def test_ar_and_prefill_equal_single_device(dp, tp):
    cfg, params = target()
    arr, lens = prompts()
    ref_logits = jax.jit(prefill_logits, static_argnums=1)(params, cfg, arr, lens)
    mesh = sh.make_mesh(dp, tp)
    sharded = placed(params, cfg, mesh)
    g = cfg.gdn_key_heads // tp
    assert len(sharded.gdn) == 6
    for mixer in sharded.gdn:
        assert local_shapes(mixer.qkv) == {(32, g, cfg.conv_head_channels)}
        assert local_shapes(mixer.out) == {(2 * g, cfg.gdn_value_dim, 32)}
    with sh.use_mesh(mesh):
        logits = jax.jit(prefill_logits, static_argnums=1)(sharded, cfg, arr, lens)
        got = token_lists(*q35.generate(sharded, cfg, arr, lens, jax.random.key(0), max_new_tokens=NEW,
                                        max_len=MAX_LEN))
    valid = np.arange(arr.shape[1])[None, :] < np.asarray(lens)[:, None]
    err = np.abs(np.asarray(logits) - np.asarray(ref_logits))[valid].max()
    # Summation order differs in the row-parallel dots: float32 rounding, as the numerics tests allow.
    assert err <= 1e-4 * np.abs(np.asarray(ref_logits)[valid]).max(), err
    assert got == ar_tokens()


@pytest.mark.parametrize("dp,tp,method", [(1, 2, "dflash"), (2, 2, "dflash"), (1, 2, "ddtree")])
def test_speculative_on_a_mesh_equals_ar(dp, tp, method):
    cfg, params = target()
    n = cfg.num_layers
    dcfg = dr.DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=48, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                          target_layer_ids=(1, n - 2), num_target_layers=n, block_size=4)
    dr.validate_pair(dcfg, cfg)
    s = SpecSettings(method=method, block_size=4, budget=6, max_new_tokens=NEW)
    mesh = sh.make_mesh(dp, tp)
    sharded = placed(params, cfg, mesh)
    dparams = dr.init_draft_params(dcfg, jax.random.key(5), mesh=mesh)
    arr, lens = prompts()
    with sh.use_mesh(mesh):
        g = generate_speculative(sharded, cfg, dparams, dcfg, arr, lens, jax.random.key(0), settings=s,
                                 max_len=MAX_LEN + s.cache_slack())
    assert token_lists(g.tokens, g.num_tokens) == ar_tokens()
    assert np.asarray(g.accepted).max() >= 2  # drafted tokens were accepted, so commits rolled back partly


def test_one_all_reduce_per_row_parallel_projection_and_no_gather():
    """At tp = 2 a prefill all-reduces once after each GDN out_proj / attention o_proj and once
    after each MLP down, plus once for the vocab-parallel embedding; nothing is gathered."""
    cfg, params = target()
    arr, lens = prompts()
    mesh = sh.make_mesh(1, 2)
    sharded = placed(params, cfg, mesh)
    with sh.use_mesh(mesh):
        hlo = jax.jit(prefill_logits, static_argnums=1).lower(sharded, cfg, arr, lens).compile().as_text()
    counts = sh.collectives(hlo)
    # 2 all-reduces per layer, + 1 for the embedding.
    assert counts["all-reduce"] == 2 * cfg.num_layers + 1, counts
    assert sum(counts.values()) == counts["all-reduce"], counts


def test_init_and_cache_shardings():
    cfg = tiny_config(tied=True)
    mesh = sh.make_mesh(2, 2)
    params = q35.init_params(cfg, jax.random.key(0), mesh=mesh)
    ref = q35.init_params(cfg, jax.random.key(0))
    for (path, spec), a, b in zip(spec_leaves_with_paths(q35.model_specs(cfg)), jax.tree.leaves(params),
                                  jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    assert local_shapes(params.embed) == {(VOCAB // 2, 32)}
    assert [local_shapes(m.conv) for m in params.gdn] == [{(cfg.conv_kernel, 2, cfg.conv_head_channels)}] * 6
    shard = q35.cache_shardings(cfg, 4, MAX_LEN, mesh)
    cache = q35.HybridCache.create(cfg, 4, MAX_LEN)
    shapes = {name: [s.shard_shape(x.shape) for s, x in zip(getattr(shard, name), getattr(cache, name))]
              for name in ("k", "v", "conv", "state")}
    assert shapes == {"k": [(2, MAX_LEN, 1, 16)] * 2, "v": [(2, MAX_LEN, 1, 16)] * 2,
                      "conv": [(2, 3, cfg.conv_channels // 2)] * 6, "state": [(2, 4, 8, 6)] * 6}
    assert shard.lengths.shard_shape(cache.lengths.shape) == (2,)


def test_heads_that_do_not_divide_are_errors():
    cfg = tiny_config()
    with pytest.raises(sh.ShardingError, match=r"gdn key heads .* 4 are not divisible by tp=3"):
        q35.check_tp(cfg, 3)
    with pytest.raises(sh.ShardingError, match="gdn key heads"):
        q35.init_params(cfg, jax.random.key(0), mesh=sh.make_mesh(1, 3))
    odd_mlp = dataclasses.replace(cfg, intermediate_size=50)
    with pytest.raises(sh.ShardingError, match="intermediate_size=50 is not divisible by tp=4"):
        q35.check_tp(odd_mlp, 4)


def test_memory_table_of_the_27b_shape_against_hand_counts():
    """The computed table (shapes x shard shapes) against the sizes counted by hand from the
    Qwen3.6-27B config, bf16 weights, 32K caches, batch 1."""
    from dflash_jax.bench import memory

    cfg = q35.QWEN36_27B
    e, m, v, ctx = 5120, 17408, 248320, 32768
    nv = 48  # GDN value heads of 128, 3 to each of the 16 key heads
    per_key = 128 + 128 + 3 * 128  # a key head's conv channels: its q, its k, the v of its 3 value heads
    replicated = 64 * 2 * e + e + 16 * 2 * 256 + 48 * 128  # norms
    split = (2 * v * e + 64 * 3 * e * m
             + 16 * (e * 24 * 2 * 256 + 2 * e * 4 * 256 + 24 * 256 * e)
             + 48 * (e * 16 * per_key + 4 * 16 * per_key + e * nv * 130 + 2 * nv + nv * 128 * e))
    dcfg = memory.drafter_config(cfg)
    for tp in (1, 2):
        got = memory.memory_table(cfg, dcfg, ctx, tp)
        assert got["target weights"] == 2 * (split // tp + replicated), tp
        assert got["KV cache"] == 16 * 2 * ctx * (4 // tp) * 256 * 2
        assert got["GDN states"] == 48 * (3 * 16 * per_key // tp * 2 + nv // tp * 128 * 128 * 4)
        assert got["drafter cache"] == 5 * 2 * ctx * (4 // tp) * 256 * 2
    assert sum(memory.memory_table(cfg, dcfg, ctx, 2).values()) <= 44e9  # issue 48's goal for two 48 GB cards
    with pytest.raises(sh.ShardingError, match="gdn key heads .* 16 are not divisible by tp=3"):
        memory.memory_table(cfg, dcfg, ctx, 3)
