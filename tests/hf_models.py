"""Tiny random transformers models (the PyTorch reference) and their conversion to our params."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from convert.hf_safetensors import load_hf

TINY = {
    # GQA with an odd number of heads, explicit head_dim != hidden / heads, untied.
    "qwen3": dict(cls=(Qwen3Config, Qwen3ForCausalLM), vocab_size=131, hidden_size=40, intermediate_size=72,
                  num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
                  tie_word_embeddings=False, rope_theta=10000.0),
    # Tied embeddings, llama3 RoPE scaling, 3 q heads per kv head.
    "llama": dict(cls=(LlamaConfig, LlamaForCausalLM), vocab_size=127, hidden_size=48, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                  rope_theta=50000.0),
    # YaRN, untied, multi-query.
    "llama_yarn": dict(cls=(LlamaConfig, LlamaForCausalLM), vocab_size=101, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                       max_position_embeddings=64),
}


def tiny_hf_model(kind: str, seed: int = 0):
    spec = dict(TINY[kind])
    config_cls, model_cls = spec.pop("cls")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1; random values make them matter
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(3.0)  # larger weights give peakier, more informative distributions
    return model


def save_and_convert(model, directory: Path):
    model.save_pretrained(directory)
    return load_hf(directory)


def hf_state_from_params(cfg, params) -> dict[str, np.ndarray]:
    """Our params (the decoding layout: qkv and gate_up, or q/k/v apart) -> HF names and layouts
    (the inverse transforms, written independently)."""
    e, qh, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": a(params.embed), "model.norm.weight": a(params.final_norm)}
    if params.lm_head is not None:
        out["lm_head.weight"] = a(params.lm_head).T
    for i, lp in enumerate(params.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = a(lp.attn_norm)
        out[p + "post_attention_layernorm.weight"] = a(lp.mlp_norm)
        q, k, v, q_bias, k_bias, v_bias = (lp.attn.q, lp.attn.k, lp.attn.v, lp.attn.q_bias, lp.attn.k_bias,
                                           lp.attn.v_bias)
        if lp.attn.qkv is not None:  # [embed, kv_heads, group + 2, head_dim]: q heads, k, v per kv head
            g = qh // kvh
            qkv = a(lp.attn.qkv)
            q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
            if lp.attn.qkv_bias is not None:
                b = a(lp.attn.qkv_bias)
                q_bias, k_bias, v_bias = b[:, :g], b[:, g], b[:, g + 1]
        out[p + "self_attn.q_proj.weight"] = a(q).reshape(e, qh * hd).T
        out[p + "self_attn.k_proj.weight"] = a(k).reshape(e, kvh * hd).T
        out[p + "self_attn.v_proj.weight"] = a(v).reshape(e, kvh * hd).T
        out[p + "self_attn.o_proj.weight"] = a(lp.attn.o).reshape(qh * hd, e).T
        if lp.attn.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = a(lp.attn.q_norm)
            out[p + "self_attn.k_norm.weight"] = a(lp.attn.k_norm)
        if q_bias is not None:
            out[p + "self_attn.q_proj.bias"] = a(q_bias).reshape(qh * hd)
            out[p + "self_attn.k_proj.bias"] = a(k_bias).reshape(kvh * hd)
            out[p + "self_attn.v_proj.bias"] = a(v_bias).reshape(kvh * hd)
            out[p + "self_attn.o_proj.bias"] = a(lp.attn.o_bias)
        gate, up = (lp.mlp.gate, lp.mlp.up) if lp.mlp.gate_up is None else (a(lp.mlp.gate_up)[:, 0],
                                                                             a(lp.mlp.gate_up)[:, 1])
        out[p + "mlp.gate_proj.weight"] = a(gate).T
        out[p + "mlp.up_proj.weight"] = a(up).T
        out[p + "mlp.down_proj.weight"] = a(lp.mlp.down).T
    return out
