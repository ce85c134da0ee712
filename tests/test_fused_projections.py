"""The decoding layout (`model.fuse_projections`): q/k/v as one weight, gate/up as one.

Checked against transformers (float32 logits), against the separate weights they come from,
for losslessness (greedy speculative equals greedy AR on the fused target and drafter), and
under tensor parallelism (shards by kv head; unchanged when kv heads are replicated). The
drafter's fused layout (`drafter.fuse_draft_projections`) against its separate weights, which
the drafter tests hold to z-lab's `dflash` 0.1.0.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from convert.hf_safetensors import load_hf
from dflash_jax import drafter as dr
from dflash_jax import sharding as sh
from dflash_jax.bench.common import SHAPES
from dflash_jax.generate import generate_ar
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward_jit as forward
from dflash_jax.model import fuse_projections, init_params, is_fused, model_specs, project_qkv
from dflash_jax.params import check_against_specs
from dflash_jax.speculative import SpecSettings, generate_speculative
from tests.spec_models import convert_pair, drafter_model, target_model
from tests.test_speculative import NEW, SMALL_VOCAB, prompts_20, run_batches

# GQA groups 3 and 1, q/k norms (qwen3), attention biases (llama), tied and untied heads.
HF = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
                                            num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                                            tie_word_embeddings=False)),
    "llama_bias_mqa": (LlamaForCausalLM, LlamaConfig(vocab_size=89, hidden_size=48, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                     attention_bias=True, tie_word_embeddings=True)),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=sorted(HF))
def hf_pair(request, tmp_path_factory):
    model_cls, config = HF[request.param]
    torch.manual_seed(3)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one cannot pass as ones/zeros
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    cfg, params = load_hf(directory)
    return model, directory, cfg, params


def test_fused_logits_match_transformers(hf_pair):
    model, _, cfg, params = hf_pair
    fused = fuse_projections(params, cfg)
    assert is_fused(fused) and not is_fused(params)
    check_against_specs(fused, model_specs(cfg, fused=True), "fused params")
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    cache = KVCache.create(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    got = forward(fused, cfg, jnp.asarray(tokens), positions, cache).logits
    assert rel_err(got, ref) <= 1e-5
    separate = forward(params, cfg, jnp.asarray(tokens), positions, cache).logits
    assert rel_err(got, separate) <= 1e-6


def test_fused_weights_are_the_separate_ones_in_place(hf_pair):
    _, _, cfg, params = hf_pair
    fused = fuse_projections(params, cfg)
    g = cfg.num_heads // cfg.num_kv_heads
    for sep, fu in zip(params.layers, fused.layers):
        qkv = np.asarray(fu.attn.qkv)  # [embed, kv_heads, g + 2, head_dim]
        q = np.asarray(sep.attn.q)  # [embed, q_heads, head_dim]; q head h belongs to kv head h // g
        for h in range(cfg.num_heads):
            np.testing.assert_array_equal(qkv[:, h // g, h % g], q[:, h])
        np.testing.assert_array_equal(qkv[:, :, g], np.asarray(sep.attn.k))
        np.testing.assert_array_equal(qkv[:, :, g + 1], np.asarray(sep.attn.v))
        np.testing.assert_array_equal(np.asarray(fu.mlp.gate_up)[:, 0], np.asarray(sep.mlp.gate))
        np.testing.assert_array_equal(np.asarray(fu.mlp.gate_up)[:, 1], np.asarray(sep.mlp.up))
        assert fu.attn.o is sep.attn.o and fu.mlp.down is sep.mlp.down  # untouched, not copied
        if cfg.attention_bias:
            b = np.asarray(fu.attn.qkv_bias)
            np.testing.assert_array_equal(b[:, g], np.asarray(sep.attn.k_bias))
            np.testing.assert_array_equal(b[:, g + 1], np.asarray(sep.attn.v_bias))
            for h in range(cfg.num_heads):
                np.testing.assert_array_equal(b[h // g, h % g], np.asarray(sep.attn.q_bias)[h])
        assert fu.attn.q is fu.attn.k is fu.attn.v is fu.mlp.gate is fu.mlp.up is None


def test_fuse_again_is_a_no_op_and_consume_frees_the_separate_weights(hf_pair):
    _, directory, cfg, _ = hf_pair
    _, params = load_hf(directory)
    q0 = params.layers[0].attn.q
    fused = fuse_projections(params, cfg, consume=True)
    assert q0.is_deleted() and not fused.layers[0].attn.qkv.is_deleted()
    assert fuse_projections(fused, cfg) is fused


def test_fused_qkv_refuses_separate_key_rows():
    tiny = SHAPES["tiny"]
    fused = init_params(tiny, jax.random.key(0), fused=True)
    x = jnp.ones((1, 3, tiny.hidden_size))
    with pytest.raises(ValueError, match="kv_input"):
        project_qkv(fused.layers[0].attn, tiny, x, kv_input=x)


# ----------------------------------------------------------------------------- lossless

@pytest.fixture(scope="module")
def fused_pair(tmp_path_factory):
    cfg, params, dcfg, dparams = convert_pair(target_model(vocab=SMALL_VOCAB), drafter_model(16, vocab=SMALL_VOCAB),
                                              tmp_path_factory.mktemp("pair"))
    return cfg, fuse_projections(params, cfg, consume=True), dcfg, dparams


@pytest.mark.parametrize("method,size,draft_fused", [("dflash", 4, False), ("ddtree", 16, False),
                                                     ("ddtree", 16, True), ("ddtree", 16, "block-qkv")])
def test_greedy_speculative_on_the_fused_target_equals_greedy_ar(fused_pair, method, size, draft_fused):
    cfg, params, dcfg, dparams = fused_pair
    if draft_fused:  # the drafter in the decoding layout too, as the CLI loads it (or the block-qkv one)
        dparams = dr.fuse_draft_projections(dparams, dcfg, block_qkv=draft_fused == "block-qkv")
        assert dr.is_draft_fused(dparams) and dr.is_draft_block_qkv(dparams) == (draft_fused == "block-qkv")
    prompts = prompts_20(SMALL_VOCAB)
    ar = run_batches(lambda a, l: generate_ar(params, cfg, a, l, jax.random.key(0), max_new_tokens=NEW,
                                              max_len=256), prompts, 20)
    s = (SpecSettings(method="dflash", block_size=size, max_new_tokens=NEW) if method == "dflash"
         else SpecSettings(method="ddtree", block_size=16, budget=size, max_new_tokens=NEW))
    got = run_batches(lambda a, l: generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0),
                                                        settings=s, max_len=256), prompts, 3)
    assert got == ar


# ----------------------------------------------------------------------------- the drafter

@pytest.mark.parametrize("bias", [False, True])
def test_fused_drafter_matches_its_separate_weights(fused_pair, bias):
    """The block pass (both layer kinds: sliding and full) and the context K/V from fused
    weights (either decoding layout) equal those from the separate ones; with attention biases,
    made non-zero."""
    cfg, params, dcfg, dparams = fused_pair
    if bias:
        dcfg = dataclasses.replace(dcfg, attention_bias=True)
        base = dr.init_draft_params(dcfg, jax.random.key(5))
        dparams = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(x.size), x.shape), base)
    fused = dr.fuse_draft_projections(dparams, dcfg)
    assert dr.is_draft_fused(fused) and not dr.is_draft_fused(dparams)
    assert dr.fuse_draft_projections(fused, dcfg) is fused
    taps = jax.random.normal(jax.random.key(1), (2, 7, dcfg.num_taps * dcfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    counts = jnp.array([7, 4], jnp.int32)
    block = dr.make_block(dcfg, jnp.array([3, 5], jnp.int32))
    joint = dr.fuse_draft_projections(dparams, dcfg, block_qkv=True)  # qkv for the block, context_kv for the context
    out = {}
    for name, dp in (("separate", dparams), ("fused", fused), ("block-qkv", joint)):
        cache = dr.DraftCache.create(dcfg, 2, 64)
        cache = dr.append_context(dp, dcfg, cache, taps, positions, counts)
        hidden = dr.draft(dp, dcfg, params, cache, block, cache.lengths)
        out[name] = (cache.k, cache.v, hidden)
    for name in ("fused", "block-qkv"):
        for got, want in zip(jax.tree.leaves(out[name]), jax.tree.leaves(out["separate"])):
            assert rel_err(got, want) <= 1e-5


# ----------------------------------------------------------------------------- tensor parallel

def test_fused_under_tp_is_sharded_by_kv_head_and_gives_the_same_logits(tmp_path):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 64, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    cache = KVCache.create(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    ref = forward(params, cfg, tokens, positions, cache).logits

    mesh = sh.make_mesh(2, 2)
    _, sharded = load_hf(tmp_path, shardings=sh.placement(mesh))
    fused = fuse_projections(sharded, cfg, consume=True)
    lp = fused.layers[0]
    # One kv head per device, with its two q heads, its k and its v; half of gate and of up.
    assert {s.data.shape for s in lp.attn.qkv.addressable_shards} == {(32, 1, 4, 8)}
    assert {s.data.shape for s in lp.mlp.gate_up.addressable_shards} == {(32, 2, 24)}
    declared = sh.param_shardings(cfg, mesh, fused=True).layers[0]
    assert lp.attn.qkv.sharding.is_equivalent_to(declared.attn.qkv, 4)
    assert lp.mlp.gate_up.sharding.is_equivalent_to(declared.mlp.gate_up, 3)
    with sh.use_mesh(mesh):
        got = jax.jit(forward, static_argnums=1)(fused, cfg, tokens, positions, cache).logits
    assert rel_err(got, ref) <= 1e-5


def test_fuse_leaves_replicated_kv_heads_separate(tmp_path):
    # 2 kv heads at tp = 4: k and v are replicated while q is split, so they cannot share a weight.
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(tmp_path)
    mesh = sh.make_mesh(1, 4)
    cfg, sharded = load_hf(tmp_path, shardings=sh.placement(mesh))
    assert fuse_projections(sharded, cfg) is sharded
