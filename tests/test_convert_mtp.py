"""MTP heads from checkpoints (convert/mtp.py): a tiny `Qwen3_5ForCausalLM` checkpoint with `mtp.*`
tensors loads (the target beside it still loads, skipping them), an exported dense head loads
back, and a missing, mis-shaped or unknown `mtp.*` tensor is named with its file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from convert import ConversionError
from convert.hf_safetensors import load_hf
from convert.mtp import export_mtp, load_mtp
from convert.qwen3_5 import load_qwen35
from dflash_jax import cli, mtp
from dflash_jax import qwen3_5 as q35
from tests.spec_models import target_model
from tests.test_convert_qwen3_5 import build_causal

# The head's tensors in Qwen3.5 / Qwen3-Next checkpoints (the names vLLM's MTP loader reads).
QWEN35_MTP_NAMES = {
    "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
    "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
}


def _hf_head(e: int, m: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> dict[str, np.ndarray]:
    """Random `mtp.*` tensors in the stored (torch Linear [out, in]) shapes of a Qwen3.5 head."""
    rng = np.random.RandomState(seed)
    shapes = {
        "mtp.fc.weight": (e, 2 * e), "mtp.pre_fc_norm_embedding.weight": (e,), "mtp.pre_fc_norm_hidden.weight": (e,),
        "mtp.norm.weight": (e,), "mtp.layers.0.input_layernorm.weight": (e,),
        "mtp.layers.0.post_attention_layernorm.weight": (e,), "mtp.layers.0.mlp.gate_proj.weight": (m, e),
        "mtp.layers.0.mlp.up_proj.weight": (m, e), "mtp.layers.0.mlp.down_proj.weight": (e, m),
        "mtp.layers.0.self_attn.q_proj.weight": (heads * 2 * head_dim, e),
        "mtp.layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, e),
        "mtp.layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, e),
        "mtp.layers.0.self_attn.o_proj.weight": (e, heads * head_dim),
        "mtp.layers.0.self_attn.q_norm.weight": (head_dim,), "mtp.layers.0.self_attn.k_norm.weight": (head_dim,),
    }
    return {k: rng.randn(*s).astype(np.float32) for k, s in shapes.items()}


@pytest.fixture(scope="module")
def hybrid_with_head(tmp_path_factory):
    path, _ = build_causal(tmp_path_factory.mktemp("mtp"), "interval4")
    cfg, _ = load_qwen35(path)
    head = _hf_head(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 0)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(head)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, cfg, head


def test_qwen35_head_loads_into_our_layout(hybrid_with_head, capsys):
    path, cfg, head = hybrid_with_head
    assert set(head) == QWEN35_MTP_NAMES
    mp = load_mtp(path, cfg)
    e, hd, qh = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    fc = head["mtp.fc.weight"]
    np.testing.assert_array_equal(np.asarray(mp.fc[0]), fc[:, :e].T)  # the embedding's half first
    np.testing.assert_array_equal(np.asarray(mp.fc[1]), fc[:, e:].T)
    np.testing.assert_array_equal(np.asarray(mp.norm_hidden), head["mtp.pre_fc_norm_hidden.weight"])
    common, attn = mp.layer
    np.testing.assert_array_equal(np.asarray(common.gate_up[:, 0]), head["mtp.layers.0.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(common.gate_up[:, 1]), head["mtp.layers.0.mlp.up_proj.weight"].T)
    q = head["mtp.layers.0.self_attn.q_proj.weight"].reshape(qh, 2, hd, e)  # per head: query, then gate
    np.testing.assert_array_equal(np.asarray(attn.q[:, 1, 0]), q[1, 0].T)
    np.testing.assert_array_equal(np.asarray(attn.q[:, 2, 1]), q[2, 1].T)
    o = head["mtp.layers.0.self_attn.o_proj.weight"]
    np.testing.assert_array_equal(np.asarray(attn.o[3]), o[:, 3 * hd:4 * hd].T)
    # The target beside it still loads, with the head's tensors counted as skipped.
    load_qwen35(path)
    assert f"mtp.* ({len(QWEN35_MTP_NAMES)})" in capsys.readouterr().err


def _edited(path: Path, tmp_path: Path, edit) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_missing_head_tensor_is_named(hybrid_with_head, tmp_path):
    path, cfg, _ = hybrid_with_head
    bad = _edited(path, tmp_path, lambda t: t.pop("mtp.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ConversionError, match=r"model\.safetensors: missing MTP tensor "
                                              r"'mtp\.layers\.0\.self_attn\.k_norm\.weight'"):
        load_mtp(bad, cfg)


def test_misshaped_head_tensor_is_named(hybrid_with_head, tmp_path):
    path, cfg, _ = hybrid_with_head
    bad = _edited(path, tmp_path, lambda t: t.update({"mtp.fc.weight": t["mtp.fc.weight"][:, :32]}))
    with pytest.raises(ConversionError, match=r"model\.safetensors: 'mtp\.fc\.weight': MTP tensor has shape "
                                              r"\(32, 32\), expected \(32, 64\)"):
        load_mtp(bad, cfg)


def test_unknown_head_tensor_is_named(hybrid_with_head, tmp_path):
    path, cfg, _ = hybrid_with_head
    bad = _edited(path, tmp_path, lambda t: t.update({"mtp.layers.1.input_layernorm.weight": np.ones(32, np.float32)}))
    with pytest.raises(ConversionError, match=r"'mtp\.layers\.1\.input_layernorm\.weight': unexpected MTP tensor"):
        load_mtp(bad, cfg)


def test_checkpoint_without_a_head_says_so(tmp_path):
    path, _ = build_causal(tmp_path, "plain")
    cfg, _ = load_qwen35(path)
    with pytest.raises(ConversionError, match="missing MTP tensor 'mtp.fc.weight'"):
        load_mtp(path, cfg)


def test_dense_head_export_loads_back(tmp_path):
    target_model(vocab=16).save_pretrained(tmp_path / "target")
    cfg, _ = load_hf(tmp_path / "target")
    head = mtp.init_mtp_params(cfg, jax.random.key(5))
    file = export_mtp(head, cfg, tmp_path / "head")
    stored = load_file(str(file))
    assert stored["mtp.layers.0.self_attn.q_proj.weight"].shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    back = load_mtp(tmp_path / "head", cfg)
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert load_mtp(tmp_path / "head", cfg, jnp.bfloat16).fc.dtype == jnp.bfloat16
    assert {x.dtype for x in stored.values()} == {np.dtype(np.float32)}


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A tiny Llama target with attention_bias (a Qwen2-style layer), every tensor random, and the
    head started from its last layer, exported: (transformers model, cfg, params, head, head dir)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("biased")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                         max_position_embeddings=128)).eval()
    with torch.no_grad():  # biases start at zero: make every tensor one a misplaced copy cannot match
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "target")
    cfg, params = load_hf(root / "target")
    head = mtp.head_from_target(params, cfg, jax.random.key(1))
    export_mtp(head, cfg, root / "head")
    return model, cfg, params, head, root / "head"


def test_head_of_a_dense_target_with_attention_biases_exports_them_and_loads_back(biased_llama):
    """The head started from a biased target's last layer (fused q/k/v and biases in the decoding
    layout) is exported with that layer's tensors, biases included, name for name as transformers
    holds them, and loads back to the same head."""
    model, cfg, params, head, where = biased_llama
    assert cfg.attention_bias and params.layers[-1].attn.qkv_bias is not None
    stored = load_file(str(where / "mtp.safetensors"))
    last = {n: p.detach().numpy() for n, p in model.model.layers[-1].named_parameters()}
    assert len(last) == 13 and "self_attn.o_proj.bias" in last  # q, k, v, o and their biases, MLP, two norms
    assert {n for n in stored if n.startswith("mtp.layers.0.")} == {f"mtp.layers.0.{n}" for n in last}
    for name, value in last.items():
        np.testing.assert_array_equal(stored[f"mtp.layers.0.{name}"], value, err_msg=name)
    back = load_mtp(where, cfg)
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loaded_biased_head_step_matches_transformers_llama_layer(biased_llama):
    """The loaded head's step (biases in its attention) against transformers' Llama layer, final
    norm and LM head carrying the exported tensors; the fc input (w * x norms of the embedding and
    the hidden state, embedding first) is written out here in numpy."""
    import torch
    from transformers import LlamaForCausalLM

    model, cfg, params, _, where = biased_llama
    stored = load_file(str(where / "mtp.safetensors"))
    mp, mcfg = load_mtp(where, cfg), mtp.MTPConfig(cfg)
    rng = np.random.RandomState(3)
    width = 7
    tokens = rng.randint(0, cfg.vocab_size, (1, width))
    hidden = rng.randn(1, width, cfg.hidden_size).astype(np.float32)
    empty = mtp.MTPCache.create(cfg, 1, width)
    _, out, _, _ = mtp.step(mp, mcfg, params, jnp.asarray(tokens), jnp.asarray(hidden), jnp.arange(width)[None],
                            empty.k, empty.v, jnp.zeros((1,), jnp.int32))
    ours = np.asarray(mtp.logits(params, cfg, out))

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    embed = model.model.embed_tokens.weight.detach().numpy()[tokens]
    x = np.concatenate([norm(embed, stored["mtp.pre_fc_norm_embedding.weight"]),
                        norm(hidden, stored["mtp.pre_fc_norm_hidden.weight"])], -1) @ stored["mtp.fc.weight"].T
    one = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1})
    one._attn_implementation = "eager"
    ref_model = LlamaForCausalLM(one).eval()
    state = {"model." + k[len("mtp."):]: torch.from_numpy(v) for k, v in stored.items() if k.startswith("mtp.layers.")}
    state["model.norm.weight"] = torch.from_numpy(stored["mtp.norm.weight"])
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    missing, unexpected = ref_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"model.embed_tokens.weight"}
    with torch.no_grad():
        ref = ref_model(inputs_embeds=torch.from_numpy(x.astype(np.float32))).logits.numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_mlp_biases_are_refused_naming_the_field(tmp_path):
    target_model(vocab=16).save_pretrained(tmp_path / "target")
    cfg, _ = load_hf(tmp_path / "target")
    head = mtp.init_mtp_params(cfg, jax.random.key(5))
    export_mtp(head, cfg, tmp_path / "head")
    biased = dataclasses.replace(cfg, mlp_bias=True)
    with pytest.raises(ConversionError, match="^mlp_bias is true: MLP biases are supported neither"):
        export_mtp(head, biased, tmp_path / "other")
    with pytest.raises(ConversionError, match="^mlp_bias is true"):
        load_mtp(tmp_path / "head", biased)


def test_dense_head_export_keeps_a_bfloat16_heads_dtype(tmp_path):
    """`train --export-dtype bfloat16` hands export_mtp a bfloat16 head: it is stored as such
    (half the bytes), and loads back to the same values."""
    target_model(vocab=16).save_pretrained(tmp_path / "target")
    cfg, _ = load_hf(tmp_path / "target")
    head = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mtp.init_mtp_params(cfg, jax.random.key(5)))
    stored = load_file(str(export_mtp(head, cfg, tmp_path / "head")))
    assert {x.dtype.name for x in stored.values()} == {"bfloat16"}
    back = load_mtp(tmp_path / "head", cfg)
    for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))


def test_cli_generate_with_the_checkpoints_own_head_equals_ar(hybrid_with_head, capsys):
    path, _, _ = hybrid_with_head
    for extra in ([], ["--mtp-budget", "5"]):
        code = cli.main(["generate", "--model", str(path), "--method", "mtp", "--mtp-steps", "2", *extra,
                         "--max-new-tokens", "10", "--compare-ar", "--json", "--quiet", "hi"])
        out = capsys.readouterr()
        assert code == 0, out.err
        record = json.loads(out.out)
        assert record["method"] == "mtp" and record["tokens"] == 10 and record["ar"]["same_tokens"]


def test_cli_bench_reports_mtp_chains_and_trees_beside_ar(hybrid_with_head, tmp_path, capsys):
    path, _, _ = hybrid_with_head
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t], "category": "c"}) + "\n" for t in ("hi", "w1 w2", "hi w3")))
    code = cli.main(["bench", "--model", str(path), "--method", "mtp", "--mtp-steps", "1", "3", "--mtp-budget", "4",
                     "--prompts", str(prompts), "--max-new-tokens", "8", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    methods = json.loads(out.out)["methods"]
    assert list(methods) == ["ar", "mtp(k=1)", "mtp(k=3)", "mtp(k=3,budget=4)"]
    for name in list(methods)[1:]:
        assert methods[name]["matches_ar"] == 1.0 and methods[name]["tau"] >= 1.0


def test_cli_mtp_without_a_head_is_one_error_before_the_target_loads(tmp_path, capsys, monkeypatch):
    path, _ = build_causal(tmp_path, "plain")

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the checkpoint was found to hold no head")

    monkeypatch.setattr(cli, "_load_target", no_target)
    code = cli.main(["generate", "--model", str(path), "--method", "mtp", "--quiet", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "holds no mtp.* tensors" in err and "pass --draft" in err, err
    code = cli.main(["bench", "--model", str(path), "--method", "mtp", "--prompts", str(tmp_path / "p.jsonl")])
    assert code == 2  # the prompt file is missing: checked first, still before any load
    (tmp_path / "p.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    capsys.readouterr()
    code = cli.main(["bench", "--model", str(path), "--method", "mtp", "--prompts", str(tmp_path / "p.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "holds no mtp.* tensors" in err and "pass --mtp-head" in err, err


def test_loaded_head_step_matches_transformers_decoder_layer(hybrid_with_head):
    """The head's layer, norm and LM head against transformers' own Qwen3.5 full-attention layer
    and final norm carrying the `mtp.*` weights; the fc input (zero-centred norms of the
    embedding and the hidden state, embedding first) is written out here in numpy."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.test_convert_qwen3_5 import TEXT

    path, cfg, head = hybrid_with_head
    _, target = load_qwen35(path)
    mp = load_mtp(path, cfg)
    mcfg = mtp.MTPConfig(cfg)
    rng = np.random.RandomState(3)
    width = 7
    tokens = rng.randint(0, cfg.vocab_size, (1, width))
    hidden = rng.randn(1, width, cfg.hidden_size).astype(np.float32)
    positions = jnp.arange(width)[None]
    empty = mtp.MTPCache.create(cfg, 1, width)
    _, out, _, _ = mtp.step(mp, mcfg, target, jnp.asarray(tokens), jnp.asarray(hidden), positions, empty.k, empty.v,
                            jnp.zeros((1,), jnp.int32))
    ours = np.asarray(q35.logits_from_hidden(target, out))

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * (1 + w)

    embed = np.asarray(target.embed)[tokens]
    x = np.concatenate([norm(embed, head["mtp.pre_fc_norm_embedding.weight"]),
                        norm(hidden, head["mtp.pre_fc_norm_hidden.weight"])], -1) @ head["mtp.fc.weight"].T
    tcfg = Qwen3_5TextConfig(**{**TEXT, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    tcfg._attn_implementation = "eager"
    ref_model = Qwen3_5ForCausalLM(tcfg).eval()
    state = {"model." + k[len("mtp."):]: torch.from_numpy(v) for k, v in head.items() if k.startswith("mtp.layers.")}
    state["model.norm.weight"] = torch.from_numpy(head["mtp.norm.weight"])
    lm_head = np.array(q35.logits_from_hidden(target, jnp.eye(cfg.hidden_size))).T.copy()  # [vocab, embed]
    state["lm_head.weight"] = torch.from_numpy(lm_head)
    missing, unexpected = ref_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"model.embed_tokens.weight"}
    with torch.no_grad():
        ref = ref_model(inputs_embeds=torch.from_numpy(x.astype(np.float32))).logits.numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--method", "mtp", "--mtp-head", "no/such/head", "--prompts", "PROMPTS"], "--mtp-head"),
    (["generate", "--method", "mtp", "--draft", "no/such/head", "hi"], "--draft"),
    (["generate", "--method", "mtp", "--model", "smollm2", "hi"], "--model"),
])
def test_cli_mtp_head_path_is_checked_before_the_target_loads(argv, flag, tmp_path, monkeypatch, capsys):
    """A wrong head path (or a target that cannot hold a head) is one error naming the flag that
    gave it, before minutes of target loading."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "hi"}) + "\n")
    argv = [str(prompts) if a == "PROMPTS" else a for a in argv]
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the MTP head's path was checked")

    monkeypatch.setattr(cli, "_load_target", no_target)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: {flag} " in err or f"error: {flag}:" in err, err


def test_shipped_head_is_found_by_its_short_name():
    """`--mtp-head smollm2` / `--draft smollm2` name the head shipped in the package, before any
    target loads; a name that is neither shipped nor a path is one error naming the flag and the
    shipped names."""
    from convert.mtp import FILE, hidden_source_of
    from dflash_jax.cli import _mtp_head_source

    where = _mtp_head_source("smollm2", "unused-target")
    assert (where / FILE).is_file() and hidden_source_of(where) == "post_norm"
    with pytest.raises(ValueError, match=r"--draft smollm3: .*shipped MTP head \(known: smollm2\)"):
        _mtp_head_source("smollm3", "unused-target")
    with pytest.raises(ValueError, match=r"--mtp-head smollm3: "):
        _mtp_head_source("smollm3", "unused-target", "--mtp-head")
