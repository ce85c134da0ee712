"""The decoding layout (`model.model_specs`): q/k/v as one weight, gate/up as one, filled by the
loaders straight from the checkpoint (`params.ParamLayout`).

Checked against transformers (float32 logits, and the HF tensors themselves, slice by slice),
against the checkpoint layout's forward, for losslessness (greedy speculative equals greedy AR
with the target and both drafter layouts), and under tensor parallelism (sharded by kv head;
q, k, v apart when kv heads are replicated). The assembly itself: random init equals the
assembled checkpoint-layout draw, extract inverts assemble, and a missing or repeated tensor
is named.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from convert.dflash_drafter import load_drafter
from convert.hf_safetensors import load_hf
from dflash_jax import drafter as dr
from dflash_jax import params as P
from dflash_jax import sharding as sh
from dflash_jax.bench.common import SHAPES
from dflash_jax.generate import generate_ar
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import checkpoint_specs, forward_jit as forward
from dflash_jax.model import init_params, is_fused, model_specs, param_layout, project_qkv
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


def checkpoint_layout(cfg, params):
    """The same weights as checkpoints store them (q, k, v, gate, up apart)."""
    sources = checkpoint_specs(cfg)
    return P.assemble(P.ParamLayout(sources, sources), P.extract(param_layout(cfg), params))


def test_decoding_logits_match_transformers(hf_pair):
    model, _, cfg, params = hf_pair
    assert is_fused(params)
    check_against_specs(params, model_specs(cfg), "loaded params")
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    cache = KVCache.create(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    got = forward(params, cfg, jnp.asarray(tokens), positions, cache).logits
    assert rel_err(got, ref) <= 1e-5
    separate = checkpoint_layout(cfg, params)
    assert not is_fused(separate) and separate.layers[0].mlp.gate is not None
    assert rel_err(got, forward(separate, cfg, jnp.asarray(tokens), positions, cache).logits) <= 1e-6


def test_decoding_weights_are_the_hf_tensors_in_place(hf_pair):
    model, _, cfg, params = hf_pair
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    e, hd = cfg.hidden_size, cfg.head_dim
    g = cfg.num_heads // cfg.num_kv_heads
    for i, lp in enumerate(params.layers):
        hf = f"model.layers.{i}."
        qkv = np.asarray(lp.attn.qkv)  # [embed, kv_heads, g + 2, head_dim]
        q = state[hf + "self_attn.q_proj.weight"].T.reshape(e, cfg.num_heads, hd)
        for h in range(cfg.num_heads):  # q head h belongs to kv head h // g
            np.testing.assert_array_equal(qkv[:, h // g, h % g], q[:, h])
        np.testing.assert_array_equal(qkv[:, :, g], state[hf + "self_attn.k_proj.weight"].T.reshape(e, -1, hd))
        np.testing.assert_array_equal(qkv[:, :, g + 1], state[hf + "self_attn.v_proj.weight"].T.reshape(e, -1, hd))
        np.testing.assert_array_equal(np.asarray(lp.mlp.gate_up)[:, 0], state[hf + "mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(lp.mlp.gate_up)[:, 1], state[hf + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(lp.mlp.down), state[hf + "mlp.down_proj.weight"].T)
        if cfg.attention_bias:
            b = np.asarray(lp.attn.qkv_bias)
            np.testing.assert_array_equal(b[:, g], state[hf + "self_attn.k_proj.bias"].reshape(-1, hd))
            np.testing.assert_array_equal(b[:, g + 1], state[hf + "self_attn.v_proj.bias"].reshape(-1, hd))
            qb = state[hf + "self_attn.q_proj.bias"].reshape(cfg.num_heads, hd)
            for h in range(cfg.num_heads):
                np.testing.assert_array_equal(b[h // g, h % g], qb[h])
        assert lp.attn.q is None and lp.attn.k is None and lp.attn.v is None
        assert lp.mlp.gate is None and lp.mlp.up is None


def test_fused_qkv_refuses_separate_key_rows():
    tiny = SHAPES["tiny"]
    fused = init_params(tiny, jax.random.key(0))
    x = jnp.ones((1, 3, tiny.hidden_size))
    with pytest.raises(ValueError, match="kv_input"):
        project_qkv(fused.layers[0].attn, tiny, x, kv_input=x)


# ----------------------------------------------------------------------------- the assembly

def test_init_is_the_assembled_checkpoint_layout_draw():
    """Random init in the decoding layout draws each checkpoint tensor with its own key, so it
    equals drawing the checkpoint layout and assembling it (target, and drafter with its k, v
    held twice)."""
    tiny = SHAPES["tiny"]
    key = jax.random.key(4)
    sources = checkpoint_specs(tiny)
    want = P.assemble(param_layout(tiny), P.init_from_specs(sources, key))
    for a, b in zip(jax.tree.leaves(init_params(tiny, key)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dcfg = dr.DraftConfig(hidden_size=tiny.hidden_size, intermediate_size=24, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, vocab_size=tiny.vocab_size, mask_token_id=0,
                          target_layer_ids=(0,), num_target_layers=tiny.num_layers)
    got = dr.init_draft_params(dcfg, key)
    want = P.assemble(dr.draft_param_layout(dcfg), dr.init_draft_params(dcfg, key, training=True))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got.context_kv[:, 1, :, 0]), np.asarray(got.layers[1].attn.qkv[:, :, 2]))


def test_extract_inverts_assemble_and_errors_name_the_tensor():
    tiny = SHAPES["tiny"]
    layout = param_layout(tiny)
    sources = {p: np.asarray(x) for p, x in P.extract(layout, init_params(tiny, jax.random.key(1))).items()}
    again = P.extract(layout, P.assemble(layout, sources))
    assert list(again) == list(sources)
    for name in sources:
        np.testing.assert_array_equal(again[name], sources[name])
    with pytest.raises(ValueError, match="layers.1.mlp.up is missing"):
        P.assemble(layout, {k: v for k, v in sources.items() if k != "layers.1.mlp.up"})
    with pytest.raises(ValueError, match=r"layers.0.attn.k has shape \(1, 2\)"):
        P.assemble(layout, {**sources, "layers.0.attn.k": np.zeros((1, 2), np.float32)})
    builder = P.Builder(layout, np.float32)
    builder.put("embed", sources["embed"])
    with pytest.raises(ValueError, match="embed was given twice"):
        builder.put("embed", sources["embed"])
    with pytest.raises(ValueError, match="layers.0.attn_norm is missing"):
        builder.finish()


def test_a_layout_whose_parts_do_not_fit_is_refused():
    src = {"a": P.Spec((4, 3), (None, None)), "b": P.Spec((4, 2), (None, None))}
    joined = P.Spec((4, 2, 3), (None, None, None),
                    parts=(P.Part("a", P.slot(3, {1: 0})), P.Part("b", P.slot(3, {1: 1}))))
    with pytest.raises(ValueError, match=r"b \(4, 2\) does not fit its slot \(4, 3\)"):
        P.ParamLayout({"ab": joined}, src).plan
    with pytest.raises(ValueError, match="go into no decoding tensor"):
        P.ParamLayout({"a": src["a"]}, src).plan


# ----------------------------------------------------------------------------- lossless

@pytest.fixture(scope="module")
def decoding_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pair")
    cfg, params, dcfg, dparams = convert_pair(target_model(vocab=SMALL_VOCAB), drafter_model(16, vocab=SMALL_VOCAB),
                                              directory)
    return cfg, params, dcfg, dparams, directory


@pytest.mark.parametrize("method,size,draft_layout", [("dflash", 4, "block-qkv"), ("ddtree", 16, "block-qkv"),
                                                      ("ddtree", 16, "q-kv"), ("ddtree", 16, "checkpoint")])
def test_greedy_speculative_on_the_decoding_layouts_equals_greedy_ar(decoding_pair, method, size, draft_layout):
    """The target and the drafter as the loaders give them (the drafter also in its q + kv
    layout, and in the checkpoint layout training uses)."""
    cfg, params, dcfg, dparams, directory = decoding_pair
    if draft_layout != "block-qkv":
        _, sep = load_drafter(directory / "draft", training=True)
        dparams = sep if draft_layout == "checkpoint" else P.assemble(
            dr.draft_param_layout(dcfg, 2 * dcfg.num_kv_heads), sep)
    assert (dparams.context_kv is not None) == (draft_layout == "block-qkv")
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
def test_drafter_decoding_layouts_match_the_checkpoint_layout(decoding_pair, bias):
    """The block pass (both layer kinds: sliding and full) and the context K/V from either
    decoding layout equal those from the checkpoint layout (which the drafter tests hold to
    z-lab's `dflash` 0.1.0); with attention biases, made non-zero."""
    cfg, params, dcfg, _, directory = decoding_pair
    _, sep = load_drafter(directory / "draft", training=True)
    if bias:
        dcfg = dataclasses.replace(dcfg, attention_bias=True)
        base = dr.init_draft_params(dcfg, jax.random.key(5), training=True)
        sep = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(x.size), x.shape), base)
    taps = jax.random.normal(jax.random.key(1), (2, 7, dcfg.num_taps * dcfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    counts = jnp.array([7, 4], jnp.int32)
    block = dr.make_block(dcfg, jnp.array([3, 5], jnp.int32))
    out = {}
    for name, tp in (("checkpoint", None), ("block-qkv", 1), ("q-kv", 2 * dcfg.num_kv_heads)):
        dp = sep if tp is None else P.assemble(dr.draft_param_layout(dcfg, tp), sep)
        cache = dr.DraftCache.create(dcfg, 2, 64)
        cache = dr.append_context(dp, dcfg, cache, taps, positions, counts)
        hidden = dr.draft(dp, dcfg, params, cache, block, cache.lengths)
        out[name] = (cache.k, cache.v, hidden)
    for name in ("block-qkv", "q-kv"):
        for got, want in zip(jax.tree.leaves(out[name]), jax.tree.leaves(out["checkpoint"])):
            assert rel_err(got, want) <= 1e-5


# ----------------------------------------------------------------------------- tensor parallel

def test_decoding_layout_under_tp_is_sharded_by_kv_head_and_gives_the_same_logits(tmp_path):
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
    _, sharded = load_hf(tmp_path, mesh=mesh)
    lp = sharded.layers[0]
    # One kv head per device, with its two q heads, its k and its v; half of gate and of up.
    assert {s.data.shape for s in lp.attn.qkv.addressable_shards} == {(32, 1, 4, 8)}
    assert {s.data.shape for s in lp.mlp.gate_up.addressable_shards} == {(32, 2, 24)}
    declared = sh.specs_shardings(model_specs(cfg, 2), mesh).layers[0]
    assert lp.attn.qkv.sharding.is_equivalent_to(declared.attn.qkv, 4)
    assert lp.mlp.gate_up.sharding.is_equivalent_to(declared.mlp.gate_up, 3)
    with sh.use_mesh(mesh):
        got = jax.jit(forward, static_argnums=1)(sharded, cfg, tokens, positions, cache).logits
    assert rel_err(got, ref) <= 1e-5


def test_replicated_kv_heads_keep_q_k_v_apart(tmp_path):
    # 2 kv heads at tp = 4: k and v are replicated while q is split, so they cannot share a weight.
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    mesh = sh.make_mesh(1, 4)
    _, sharded = load_hf(tmp_path, mesh=mesh)
    attn = sharded.layers[0].attn
    assert attn.qkv is None and attn.k.sharding.is_fully_replicated
    assert {s.data.shape for s in attn.q.addressable_shards} == {(32, 1, 8)}
    assert sharded.layers[0].mlp.gate_up is not None
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, 64, (1, 7)))
    positions = jnp.broadcast_to(jnp.arange(7), (1, 7))
    cache = KVCache.create(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim)
    ref = forward(params, cfg, tokens, positions, cache).logits
    with sh.use_mesh(mesh):
        got = jax.jit(forward, static_argnums=1)(sharded, cfg, tokens, positions, cache).logits
    assert rel_err(got, ref) <= 1e-5
