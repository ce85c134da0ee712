"""Qwen3.5 / Qwen3.6 HF safetensors -> our hybrid params (convert/qwen3_5.py), and the CLI on them.

Reference: tiny random transformers models saved with `save_pretrained`, in both name layouts
(`Qwen3_5ForCausalLM`: `model.layers.*`; `Qwen3_5ForConditionalGeneration`:
`model.language_model.*` beside `model.visual.*`). A load is right when our forward's logits
equal transformers' on the same ids; bad checkpoints must fail naming the tensor and the file.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import (PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForCausalLM,
                          Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig)

from convert import ConversionError, convert_command, load_model
from convert.dflash_drafter import export_drafter
from convert.qwen3_5 import load_qwen35
from dflash_jax import cli
from dflash_jax import qwen3_5 as q35
from dflash_jax.drafter import DraftConfig, init_draft_params
from dflash_jax.sharding import make_mesh
from tests.test_qwen3_5 import perturb_hf_weights

L, F = "linear_attention", "full_attention"
VOCAB = 97
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
              num_position_embeddings=16, patch_size=2)
REL = 1e-4
WORDS = ["<unk>", "hi"] + [f"w{i}" for i in range(VOCAB - 2)]


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`test_qwen3_5.perturb_hf_weights` from `seed`."""
    torch.manual_seed(seed)
    perturb_hf_weights(model)
    return model.eval()


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary ("hi" is id 1), so the CLI has text to encode."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def build_causal(root: Path, name: str, shard: str | None = None, **over) -> tuple[Path, Qwen3_5ForCausalLM]:
    torch.manual_seed(1)
    cfg = Qwen3_5TextConfig(**{**TEXT, **over})
    cfg._attn_implementation = "eager"
    model = _perturb(Qwen3_5ForCausalLM(cfg), 2)
    out = root / name
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    _tokenizer().save_pretrained(out)
    return out, model


def build_wrapper(root: Path) -> tuple[Path, Qwen3_5ForConditionalGeneration, int]:
    """The vision-language wrapper (untied), with 3 mtp.* tensors added as the published checkpoints
    carry them. Returns (dir, model, number of model.visual.* tensors)."""
    torch.manual_seed(3)
    cfg = Qwen3_5Config(text_config={**TEXT, "num_hidden_layers": 4}, vision_config=VISION,
                        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = _perturb(Qwen3_5ForConditionalGeneration(cfg), 4)
    out = root / "wrapper"
    model.save_pretrained(out)
    file = out / "model.safetensors"
    tensors = load_file(str(file))
    visual = sum(1 for k in tensors if k.startswith("model.visual."))
    assert visual > 0 and any(k.startswith("model.language_model.layers.") for k in tensors)
    e = TEXT["hidden_size"]
    tensors.update({"mtp.fc.weight": np.ones((e, 2 * e), np.float32), "mtp.norm.weight": np.ones(e, np.float32),
                    "mtp.layers.0.input_layernorm.weight": np.ones(e, np.float32)})
    save_file(tensors, str(file), metadata={"format": "pt"})
    return out, model, visual


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen35")
    return {
        # 3 GDN : 1 attention twice, untied, sharded with an index.
        "interval4": build_causal(root, "interval4", "20KB", num_hidden_layers=8, tie_word_embeddings=False),
        # Aperiodic, starting with attention, tied, one file.
        "aperiodic": build_causal(root, "aperiodic", num_hidden_layers=5, layer_types=[F, L, F, L, L],
                                  tie_word_embeddings=True),
        "wrapper": build_wrapper(root),
    }


def our_logits(cfg: q35.Qwen35Config, params: q35.Qwen35Params, ids: np.ndarray) -> np.ndarray:
    n = ids.shape[1]
    out = q35.forward_jit(params, cfg, jnp.asarray(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                          q35.HybridCache.create(cfg, 1, n))
    return np.asarray(out.logits[0])


def hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits[0].float().numpy()


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


PROMPT = np.random.default_rng(0).integers(0, VOCAB, (1, 13))


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("name", ["interval4", "aperiodic"])
def test_causal_lm_round_trip(saved, name, capsys):
    path, model = saved[name]
    if name == "interval4":
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    cfg, params, tok = load_model(path)
    assert isinstance(cfg, q35.Qwen35Config) and tok is not None
    assert cfg == q35.qwen35_config_from_dict(json.loads(model.config.to_json_string()))
    assert (params.lm_head is None) == cfg.tie_word_embeddings
    assert rel_err(our_logits(cfg, params, PROMPT), hf_logits(model, PROMPT)) < REL
    assert "skipped" not in capsys.readouterr().err  # nothing to skip, nothing said


def test_wrapper_round_trip_skips_vision_and_mtp_in_one_line(saved, capsys):
    path, model, visual = saved["wrapper"]
    cfg, params, _ = load_model(path, tokenizer=False)
    assert cfg.layer_types == (L, L, L, F) and params.lm_head is not None
    # Text-only ids: the wrapper's mRoPE positions are 1-D, so its logits are the text model's.
    assert rel_err(our_logits(cfg, params, PROMPT), hf_logits(model, PROMPT)) < REL
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"{path / 'model.safetensors'}: skipped {visual + 3} tensors: "
                     f"model.visual.* ({visual}), mtp.* (3)"]


def test_bfloat16_load(saved):
    path, model = saved["aperiodic"]
    cfg, params = load_qwen35(path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    ref = torch.from_numpy(load_file(str(path / "model.safetensors"))["model.layers.1.linear_attn.A_log"])
    np.testing.assert_array_equal(np.asarray(params.gdn[0].a_log, np.float32), ref.bfloat16().float().numpy())


def test_index_file_path_and_tied_lm_head_copy(saved, tmp_path):
    """The index file names the checkpoint as well as its directory; a tied checkpoint that also
    stores lm_head.weight (some exporters write the copy) loads, the embedding being the weight."""
    path, _ = saved["interval4"]
    _, by_dir = load_qwen35(path)
    _, by_index = load_qwen35(path / "model.safetensors.index.json")
    for a, b in zip(jax.tree.leaves(by_dir), jax.tree.leaves(by_index)):
        np.testing.assert_array_equal(a, b)
    tied = _copy(saved, "aperiodic", tmp_path)
    _edit(tied / "model.safetensors", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    cfg, params = load_qwen35(tied)
    assert cfg.tie_word_embeddings and params.lm_head is None


# ----------------------------------------------------------------------------- bad checkpoints

def _copy(saved, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(saved[name][0], dst)
    return dst


def _edit(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _error(path: Path) -> str:
    with pytest.raises(ConversionError) as err:
        load_qwen35(path)
    return str(err.value)


def test_missing_tensor_is_named_with_its_layout(saved, tmp_path):
    path = _copy(saved, "aperiodic", tmp_path)
    _edit(path / "model.safetensors", lambda t: t.pop("model.layers.3.linear_attn.A_log"))
    msg = _error(path)
    assert "missing tensor 'model.layers.3.linear_attn.A_log'" in msg and str(path / "model.safetensors") in msg
    wrapper = _copy(saved, "wrapper", tmp_path)
    _edit(wrapper / "model.safetensors", lambda t: t.pop("model.language_model.layers.3.self_attn.q_norm.weight"))
    assert "missing tensor 'model.language_model.layers.3.self_attn.q_norm.weight'" in _error(wrapper)
    untied = _copy(saved, "wrapper", tmp_path / "untied")
    _edit(untied / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    assert "missing tensor 'lm_head.weight'" in _error(untied)


@pytest.mark.parametrize("extra, why", [
    ("model.layers.0.linear_attn.A_log", "layer 0 is 'full_attention'"),
    ("model.layers.1.linear_attn.in_proj_qkvz.weight", "not a Qwen3.5 decoder-layer tensor"),
    ("model.layers.7.mlp.up_proj.weight", "past the config's num_hidden_layers (5)"),
    ("model.rotary_emb.inv_freq", "not a Qwen3.5 text-decoder tensor"),
    ("vision_tower.patch_embed.weight", "not a Qwen3.5 text-decoder, vision or mtp tensor"),
])
def test_extra_tensor_is_named(saved, tmp_path, extra, why):
    path = _copy(saved, "aperiodic", tmp_path)
    _edit(path / "model.safetensors", lambda t: t.update({extra: np.zeros((3,), np.float32)}))
    msg = _error(path)
    assert f"{path / 'model.safetensors'}: {extra!r}: unexpected tensor" in msg and why in msg


def test_extra_tensor_in_a_layer_of_the_other_kind(saved, tmp_path):
    path = _copy(saved, "aperiodic", tmp_path)
    name = "model.layers.1.self_attn.q_norm.weight"  # layer 1 is a GDN layer
    _edit(path / "model.safetensors", lambda t: t.update({name: np.zeros((16,), np.float32)}))
    assert f"{name!r}: unexpected tensor (layer 1 is 'linear_attention'" in _error(path)


def test_misshaped_tensor_is_named_before_it_is_read(saved, tmp_path):
    path = _copy(saved, "aperiodic", tmp_path)
    name = "model.layers.4.linear_attn.in_proj_qkv.weight"
    _edit(path / "model.safetensors", lambda t: t.update({name: t[name][:-1]}))
    msg = _error(path)
    assert f"{path / 'model.safetensors'}: {name!r}: tensor has shape (55, 32), expected (56, 32)" in msg


def test_both_layouts_at_once_is_a_duplicate(saved, tmp_path):
    path = _copy(saved, "aperiodic", tmp_path)
    _edit(path / "model.safetensors",
          lambda t: t.update({"model.language_model.norm.weight": t["model.norm.weight"]}))
    assert "duplicate tensor" in _error(path)


def test_conversion_says_not_supported(saved, tmp_path):
    path, _ = saved["aperiodic"]
    with pytest.raises(ConversionError, match="qwen3_5 checkpoint is not supported yet"):
        convert_command(path, tmp_path / "out")


@pytest.mark.parametrize("name", ["interval4", "aperiodic"])
def test_loading_onto_a_mesh_places_the_same_params(saved, name):
    """Each tensor goes straight onto its shards; gathered back, the params are those of a plain load."""
    path, _ = saved[name]
    cfg, ref = load_qwen35(path)
    for dp, tp in ((1, 2), (2, 2)):
        _, got = load_qwen35(path, mesh=make_mesh(dp, tp))
        for (where, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(where))
        hk = cfg.gdn_key_heads // tp
        assert len(got.gdn) == len(cfg.gdn_layers) and len(got.attn) == len(cfg.attn_layers)
        for mixer in got.gdn:
            assert {x.data.shape for x in mixer.qkv.addressable_shards} == {
                (cfg.hidden_size, hk, cfg.conv_head_channels)}
        for mixer in got.attn:
            assert {x.data.shape for x in mixer.q.addressable_shards} == {
                (cfg.hidden_size, cfg.num_heads // tp, 2, cfg.head_dim)}


def test_a_mesh_the_gdn_heads_do_not_divide_is_named(saved):
    path, _ = saved["aperiodic"]
    with pytest.raises(ValueError, match="gdn key heads .* 2 are not divisible by tp=4"):
        load_model(path, mesh=make_mesh(1, 4))


def test_moe_checkpoint_says_not_supported(saved, tmp_path):
    path = _copy(saved, "aperiodic", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe"}))
    with pytest.raises(ConversionError, match="model_type.*not supported yet"):
        load_model(path)


# ----------------------------------------------------------------------------- CLI

def test_cli_generate_runs_ar_on_the_hybrid(saved, capsys):
    path, model = saved["interval4"]
    ids = _tokenizer()("hi")["input_ids"]
    assert ids == [1]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = ref[0, len(ids):].tolist()
    assert len(ref) == 8  # no eos in this config: all 8 tokens are compared
    code = cli.main(["generate", "--model", str(path), "--max-new-tokens", "8", "--json", "--quiet", "hi"])
    out = capsys.readouterr()
    assert code == 0, out.err
    record = json.loads(out.out)
    assert record["method"] == "ar" and record["tokens"] == 8
    assert record["texts"] == [_tokenizer().decode(ref, skip_special_tokens=True)]




@pytest.fixture(scope="module")
def hybrid_drafter(saved, tmp_path_factory) -> Path:
    """A random DFlash drafter for the "interval4" hybrid, saved in z-lab's layout; it taps a GDN
    layer and the attention layer that ends the first period."""
    path, _ = saved["interval4"]
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    dcfg = DraftConfig(hidden_size=TEXT["hidden_size"], intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                       target_layer_ids=(1, 3), num_target_layers=n, block_size=4,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    dparams = init_draft_params(dcfg, jax.random.key(7), training=True)
    return export_drafter(dcfg, dparams, tmp_path_factory.mktemp("drafter") / "interval4")


def _hf_greedy(model: torch.nn.Module, text: str, new: int) -> str:
    """transformers' greedy continuation of `text`, decoded: what lossless decoding must print."""
    ids = _tokenizer()(text)["input_ids"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    ref = ref[0, len(ids):].tolist()
    assert len(ref) == new  # no eos in this config: every token is compared
    return _tokenizer().decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("method, extra", [("dflash", ["--stage-times"]), ("ddtree", ["--budget", "8"])])
def test_cli_generate_speculative_on_the_hybrid_matches_ar(saved, hybrid_drafter, capsys, method, extra):
    path, model = saved["interval4"]
    prompts = ["hi w3 w7", "w5"]
    code = cli.main(["generate", "--model", str(path), "--method", method, "--draft", str(hybrid_drafter),
                     "--compare-ar", "--max-new-tokens", "12", "--quiet", *extra, *prompts])
    out = capsys.readouterr()
    assert code == 0, out.err
    answers = re.findall(r"^>>> (.*)\n(.*)\n", out.out, re.M)
    assert answers == [(p, _hf_greedy(model, p, 12)) for p in prompts], out.out
    spec = re.search(rf"^{method}: (\d+) tokens in .* tau ([\d.]+) tokens per round", out.out, re.M)
    ar = re.search(r"^ar: +(\d+) tokens in ", out.out, re.M)
    assert spec and ar, out.out
    assert spec.group(1) == ar.group(1) == "24"
    assert 1.0 <= float(spec.group(2)) <= 4.0  # at least the bonus token, at most the block
    assert re.search(rf"^{method} is [\d.]+x as fast as ar; the same tokens as ar \(lossless\)$", out.out, re.M)
    if "--stage-times" in extra:
        assert re.search(r"^stages: median ms over [1-9]\d* rounds", out.out, re.M), out.out
        assert re.search(r", verify [\d.]+ \(attention [\d.]+, gdn [\d.]+, rest [\d.]+\), accept ", out.out), out.out


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--method", "dflash", "--dp", "2", "--tp", "2"]])
def test_cli_generate_on_a_mesh_matches_transformers(saved, hybrid_drafter, capsys, argv):
    path, model = saved["interval4"]
    prompts = ["hi w3 w7", "w5"]
    draft = ["--draft", str(hybrid_drafter)] if "dflash" in argv else []
    code = cli.main(["generate", "--model", str(path), *argv, *draft, "--max-new-tokens", "12", "--quiet", *prompts])
    out = capsys.readouterr()
    assert code == 0, out.err
    answers = re.findall(r"^>>> (.*)\n(.*)\n", out.out, re.M)
    assert answers == [(p, _hf_greedy(model, p, 12)) for p in prompts], out.out


def test_cli_generate_names_a_drafter_tap_past_the_hybrid(saved, hybrid_drafter, capsys, tmp_path):
    path, _ = saved["interval4"]
    bad = tmp_path / "drafter"
    shutil.copytree(hybrid_drafter, bad)
    config = json.loads((bad / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 8]
    (bad / "config.json").write_text(json.dumps(config))
    code = cli.main(["generate", "--model", str(path), "--method", "dflash", "--draft", str(bad), "--quiet", "hi"])
    assert code == 2 and "target_layer_ids [1, 8] include [8], outside the target's 8 layers" in capsys.readouterr().err
