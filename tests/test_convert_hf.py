"""HF safetensors -> our params: every tensor lands where it should; bad inputs fail loudly.

Reference: tiny random transformers models saved with `save_pretrained`. The inverse layout
transforms below are written independently of convert/layout.py on purpose.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from convert import ConversionError, load_model
from convert.hf_safetensors import load_hf
from dflash_jax import sharding as sh
from dflash_jax.model import model_specs
from tests.hf_models import hf_state_from_params

COMMON = dict(vocab_size=97, intermediate_size=56, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # head_dim 12 != hidden 40 / 6 heads: the explicit head_dim must win.
    "qwen3_untied_sharded": (Qwen3ForCausalLM, Qwen3Config, dict(hidden_size=40, head_dim=12,
                                                                 tie_word_embeddings=False), "20KB"),
    "qwen3_tied": (Qwen3ForCausalLM, Qwen3Config, dict(hidden_size=40, head_dim=12, tie_word_embeddings=True), None),
    "llama_tied_bias": (LlamaForCausalLM, LlamaConfig, dict(hidden_size=48, attention_bias=True,
                                                            tie_word_embeddings=True), None),
    "llama_untied_sharded": (LlamaForCausalLM, LlamaConfig, dict(hidden_size=48, tie_word_embeddings=False,
                                                                 rope_theta=50000.0), "20KB"),
}


def _build(root: Path, name: str, dtype: torch.dtype = torch.float32) -> tuple[Path, dict[str, np.ndarray]]:
    model_cls, config_cls, extra, shard = VARIANTS[name]
    torch.manual_seed(len(name))
    model = model_cls(config_cls(**COMMON, **extra)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one cannot pass as ones/zeros
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    out = root / name
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return out, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("hf")
    return {name: _build(root, name) for name in VARIANTS}


def assert_matches_torch(cfg, params, state: dict[str, np.ndarray]) -> None:
    state = dict(state)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the same tensor as the embedding
    got = hf_state_from_params(cfg, params)
    assert sorted(got) == sorted(state)
    for name, ref in state.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_tensor_lands_in_place(saved, name):
    path, state = saved[name]
    cfg, params, tok = load_model(path)
    assert tok is None  # no tokenizer files in these checkpoints
    hf_cfg = json.loads((path / "config.json").read_text())
    assert cfg.model_type == hf_cfg["model_type"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (6, 2, hf_cfg["hidden_size"])
    assert cfg.head_dim == hf_cfg.get("head_dim", hf_cfg["hidden_size"] // 6)
    assert cfg.tie_word_embeddings == VARIANTS[name][2]["tie_word_embeddings"]
    assert (params.lm_head is None) == cfg.tie_word_embeddings
    assert cfg.attention_bias == VARIANTS[name][2].get("attention_bias", False)
    assert cfg.qk_norm == (cfg.model_type == "qwen3")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert_matches_torch(cfg, params, state)


def test_sharded_checkpoint_really_is_sharded(saved):
    path, _ = saved["qwen3_untied_sharded"]
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2


def test_bf16_source_and_bf16_target(tmp_path):
    path, state = _build(tmp_path, "llama_tied_bias", dtype=torch.bfloat16)
    cfg, params = load_hf(path)  # bf16 on disk -> float32, exactly
    assert_matches_torch(cfg, params, state)
    _, params16 = load_hf(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params16)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))


def test_single_file_with_config_argument(saved, tmp_path):
    path, state = saved["llama_tied_bias"]
    file = tmp_path / "weights.safetensors"
    shutil.copy(path / "model.safetensors", file)
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ConversionError, match="config.json: config file not found"):
        load_hf(file)
    cfg, params = load_hf(file, config=config)
    assert_matches_torch(cfg, params, state)


def test_mesh_places_each_tensor_on_its_declared_sharding(saved):
    path, state = saved["qwen3_tied"]
    cfg, _ = load_hf(path)
    mesh = sh.make_mesh(2, 2)
    _, params = load_hf(path, mesh=mesh)
    declared = sh.specs_shardings(model_specs(cfg, 2), mesh)
    for x, want in zip(jax.tree.leaves(params), jax.tree.leaves(declared)):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    assert not params.layers[0].attn.qkv.sharding.is_fully_replicated  # split by kv head
    assert_matches_torch(cfg, params, state)


# ----------------------------------------------------------------------------- bad inputs

def _copy(saved, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(saved[name][0], dst)
    return dst


def _edit_tensors(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_tensor(saved, tmp_path):
    path = _copy(saved, "llama_tied_bias", tmp_path)
    _edit_tensors(path / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        load_hf(path)


def test_untied_checkpoint_without_lm_head(saved, tmp_path):
    path = _copy(saved, "llama_untied_sharded", tmp_path)
    shard = _shard_of(path, "lm_head.weight")
    _edit_tensors(shard, lambda t: t.pop("lm_head.weight"))
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["lm_head.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=r"missing tensor 'lm_head\.weight'"):
        load_hf(path)


def test_unexpected_tensor(saved, tmp_path):
    path = _copy(saved, "llama_tied_bias", tmp_path)
    _edit_tensors(path / "model.safetensors",
                  lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": np.zeros((3, 3), np.float32)}))
    with pytest.raises(ConversionError, match=r"model\.safetensors: 'model\.layers\.0\.mlp\.extra_proj\.weight': "
                                              r"unexpected tensor"):
        load_hf(path)


def test_tensor_this_config_does_not_have(saved, tmp_path):
    # A qwen3-style q_norm in a llama checkpoint is mapped by the table but not declared.
    path = _copy(saved, "llama_tied_bias", tmp_path)
    _edit_tensors(path / "model.safetensors",
                  lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(ConversionError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight': unexpected tensor "
                                              r"\(it would fill layers\.0\.attn\.q_norm"):
        load_hf(path)


def test_misshaped_tensor(saved, tmp_path):
    path = _copy(saved, "llama_tied_bias", tmp_path)
    _edit_tensors(path / "model.safetensors",
                  lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.zeros((48, 48), np.float32)}))
    with pytest.raises(ConversionError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight': tensor has shape "
                                              r"\(48, 48\), expected \(16, 48\)"):
        load_hf(path)


def test_duplicate_tensor_across_shards(saved, tmp_path):
    path = _copy(saved, "qwen3_untied_sharded", tmp_path)
    name = "model.norm.weight"
    other = next(f for f in sorted(path.glob("model-*.safetensors")) if f != _shard_of(path, name))
    _edit_tensors(other, lambda t: t.update({name: np.ones(40, np.float32)}))
    with pytest.raises(ConversionError, match=r"duplicate tensor 'model\.norm\.weight'"):
        load_hf(path)


def test_index_points_to_missing_shard(saved, tmp_path):
    path = _copy(saved, "qwen3_untied_sharded", tmp_path)
    shard = _shard_of(path, "model.layers.1.mlp.up_proj.weight")
    shard.unlink()
    with pytest.raises(ConversionError,
                       match=rf"model\.safetensors\.index\.json: shard '{shard.name}'.*does not exist"):
        load_hf(path)


def test_index_lists_tensor_its_shard_lacks(saved, tmp_path):
    path = _copy(saved, "qwen3_untied_sharded", tmp_path)
    name = "model.layers.0.self_attn.k_norm.weight"
    _edit_tensors(_shard_of(path, name), lambda t: t.pop(name))
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"):
        load_hf(path)


def test_truncated_file(saved, tmp_path):
    path = _copy(saved, "llama_tied_bias", tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"model\.safetensors: cannot read safetensors file \(truncated"):
        load_hf(path)


def test_unknown_model_type(saved, tmp_path):
    path = _copy(saved, "llama_tied_bias", tmp_path)
    _edit_config(path, lambda c: c.update(model_type="gpt_neox"))
    with pytest.raises(ConversionError, match=r"config\.json: unknown model_type 'gpt_neox'"):
        load_hf(path)


def test_missing_config_field(saved, tmp_path):
    path = _copy(saved, "qwen3_tied", tmp_path)
    _edit_config(path, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ConversionError, match=r"config\.json: required field 'num_hidden_layers' is missing"):
        load_hf(path)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_hf(tmp_path)


def test_tied_checkpoint_with_lm_head_copy_is_accepted(saved, tmp_path):
    path = _copy(saved, "qwen3_tied", tmp_path)
    state = saved["qwen3_tied"][1]
    _edit_tensors(path / "model.safetensors",
                  lambda t: t.update({"lm_head.weight": state["model.embed_tokens.weight"].copy()}))
    cfg, params = load_hf(path)
    assert params.lm_head is None
    assert_matches_torch(cfg, params, state)


def test_unknown_source(tmp_path):
    with pytest.raises(ConversionError, match="no such file or directory"):
        load_model(tmp_path / "nothing.bin")
