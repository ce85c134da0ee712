"""A tiny Qwen3 target and a z-lab DFlash drafter for it, as transformers/dflash models and ours."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from convert.dflash_drafter import load_drafter
from convert.hf_safetensors import load_hf

VOCAB = 24  # small, so that a random drafter's guesses are accepted often enough to matter


def target_model(seed: int = 0, vocab: int = VOCAB) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                      max_position_embeddings=512)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    return model


def drafter_model(block_size: int, seed: int = 1, vocab: int = VOCAB, sliding: bool = True):
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      layer_types=["sliding_attention", "full_attention"] if sliding else None,
                      sliding_window=6 if sliding else None, use_sliding_window=sliding,
                      num_target_layers=4, block_size=block_size,
                      dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, 2]})
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def convert_pair(target, drafter, directory: Path):
    target.save_pretrained(directory / "target")
    drafter.save_pretrained(directory / "draft")
    cfg, params = load_hf(directory / "target")
    dcfg, dparams = load_drafter(directory / "draft")
    return cfg, params, dcfg, dparams
