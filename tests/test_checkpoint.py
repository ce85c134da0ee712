"""Orbax checkpoints of converted models: bitwise round trips, dispatch, and refusals."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from convert import ConversionError, convert_command, load_model, resolve_source
from convert.checkpoint import MARKER, load_checkpoint, save_checkpoint
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax import sharding as sh
from dflash_jax.model import checkpoint_specs, model_specs, param_layout
from dflash_jax.params import assemble, is_spec

CFG = ModelConfig("qwen3", vocab_size=61, hidden_size=24, intermediate_size=40, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False,
                  rope=RopeConfig(theta=5e5, rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
                  bos_token_id=3, eos_token_ids=(4, 5))


def init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32, tp: int = 1):
    """Random params in the decoding layout at `tp`, drawn with numpy (dflash_jax's jax.random
    init compiles per shape: seconds)."""
    rng = np.random.default_rng(seed)
    sources = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), checkpoint_specs(cfg), is_leaf=is_spec)
    return assemble(param_layout(cfg, tp), sources, dtype)


def assert_bitwise_equal(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_bitwise(tmp_path, dtype):
    params = init_params(CFG, 1, dtype)
    save_checkpoint(tmp_path / "ck", CFG, params)
    assert json.loads((tmp_path / "ck" / MARKER).read_text())["dtype"] == jnp.dtype(dtype).name
    cfg, restored = load_checkpoint(tmp_path / "ck")
    assert cfg == CFG  # every field, RoPE and eos tuple included
    assert_bitwise_equal(params, restored)


def test_tied_none_leaves_and_dtype_cast_and_mesh(tmp_path):
    cfg = ModelConfig("llama", 50, 16, 32, 1, 4, 4, 4, tie_word_embeddings=True, attention_bias=True)
    params = init_params(cfg, 2)
    save_checkpoint(tmp_path / "ck", cfg, params)
    mesh = sh.make_mesh(1, 2)
    got_cfg, restored = load_checkpoint(tmp_path / "ck", dtype=jnp.bfloat16, mesh=mesh)
    assert got_cfg == cfg and restored.lm_head is None and restored.layers[0].attn.q_norm is None
    declared = sh.specs_shardings(model_specs(cfg, 2), mesh)
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(declared)):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    assert_bitwise_equal(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), restored)


def test_a_checkpoint_saved_at_one_layout_loads_at_another(tmp_path):
    """Saved from the layout where kv heads are replicated over tp (q, k, v apart), restored on
    one device (qkv fused): the checkpoint stores the tensors as checkpoints do, not a layout."""
    replicated = init_params(CFG, 3, tp=4)
    assert replicated.layers[0].attn.qkv is None
    save_checkpoint(tmp_path / "ck", CFG, replicated)
    _, restored = load_checkpoint(tmp_path / "ck")
    assert_bitwise_equal(init_params(CFG, 3), restored)


def test_refuses_to_clobber(tmp_path):
    params = init_params(CFG, 0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="destination exists and is not empty"):
        save_checkpoint(tmp_path / "other", CFG, params)
    with pytest.raises(ConversionError, match="not a dflash-jax checkpoint; not overwriting"):
        save_checkpoint(tmp_path / "other", CFG, params, overwrite=True)
    save_checkpoint(tmp_path / "ck", CFG, params)
    save_checkpoint(tmp_path / "ck", CFG, params, overwrite=True)  # our own checkpoint: allowed


def test_refuses_params_in_no_layout_of_the_config(tmp_path):
    """Params of another config (here one layer short) are refused before anything is written."""
    params = init_params(CFG, 0)
    short = params.__class__(embed=params.embed, layers=params.layers[:1], final_norm=params.final_norm,
                             lm_head=params.lm_head)
    with pytest.raises(ConversionError, match="none of the target's decoding layouts"):
        save_checkpoint(tmp_path / "ck", CFG, short)
    assert not (tmp_path / "ck").exists()


def test_marker_is_required_and_checked(tmp_path):
    with pytest.raises(ConversionError, match=f"{MARKER} is missing"):
        load_checkpoint(tmp_path)
    params = init_params(CFG, 0)
    save_checkpoint(tmp_path / "ck", CFG, params)
    marker = tmp_path / "ck" / MARKER
    meta = json.loads(marker.read_text())
    meta["config"]["num_experts"] = 8
    marker.write_text(json.dumps(meta))
    with pytest.raises(ConversionError, match=r"unknown config fields \['num_experts'\]"):
        load_checkpoint(tmp_path / "ck")


def test_convert_command_from_hf(tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "hf")
    cfg, params, _ = load_model(tmp_path / "hf")
    out = convert_command(tmp_path / "hf", tmp_path / "ck", dtype="bfloat16")
    assert resolve_source(out) == ("checkpoint", out)
    cfg2, params2, tok = load_model(out, dtype=None)
    assert cfg2 == cfg and tok is None
    assert_bitwise_equal(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), params2)
