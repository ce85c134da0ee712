"""Hugging Face safetensors checkpoints (Qwen3, Llama) -> `(ModelConfig, ModelParams)`.

Accepted inputs:
- a directory with `config.json` and `model.safetensors`, or with sharded
  `model-0000x-of-0000y.safetensors` files and `model.safetensors.index.json`;
- a single `.safetensors` file (config from `config=` or a `config.json` beside it);
- a `*.safetensors.index.json` file.

Tensors stream one at a time: read (memory-mapped by safetensors), cast, and written into
their slices of the decoding layout, each decoding tensor placed on device (optionally
straight into its tensor-parallel shards) once filled, so a checkpoint never needs two full
host copies.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
from safetensors import safe_open

from convert.layout import (IDENTITY, TRANSPOSE, Assembler, ConversionError, MappingTable, Rule,
                            decoder_layer_rules)
from dflash_jax.config import ConfigError, ModelConfig, load_json, model_config_from_dict
from dflash_jax.model import ModelParams, param_layout
from dflash_jax.sharding import check_model, mesh_sizes, placement

# HF name -> our path. Shapes: HF Linear weights are [out, in]; ours are [in, ...out] (see layout.py).
HF_TABLE = MappingTable([
    Rule("model.embed_tokens.weight", "embed", IDENTITY),  # [vocab, embed]
    Rule("model.norm.weight", "final_norm", IDENTITY),  # [embed]
    Rule("lm_head.weight", "lm_head", TRANSPOSE),  # [vocab, embed] -> [embed, vocab]
    *decoder_layer_rules("model.layers.{i}."),
])

# Older checkpoints store RoPE's inverse frequencies as a buffer; we recompute them from config.
_IGNORED_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _resolve_files(path: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """-> (shard files in order, index weight_map or None, the index file or None)."""
    if path.is_dir():
        if (path / INDEX_NAME).exists():
            return _read_index(path / INDEX_NAME)
        if (path / SINGLE_NAME).exists():
            return [path / SINGLE_NAME], None, None
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            return found, None, None
        raise ConversionError(
            f"{path}: no {SINGLE_NAME} or {INDEX_NAME} found"
            + (f" (and {len(found)} other .safetensors files, which is ambiguous)" if found else ""))
    if path.name.endswith(".index.json"):
        return _read_index(path)
    if path.suffix == ".safetensors":
        if not path.exists():
            raise ConversionError(f"{path}: file not found")
        return [path], None, None
    raise ConversionError(f"{path}: not a safetensors checkpoint (expected a directory, a "
                          f".safetensors file or a .safetensors.index.json file)")


def _read_index(index: Path) -> tuple[list[Path], dict[str, str], Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConversionError(f"{index}: not a valid safetensors index ({err!r})") from None
    files: list[Path] = []
    for name, file in weight_map.items():
        shard = index.parent / file
        if shard not in files:
            if not shard.exists():
                raise ConversionError(f"{index}: shard {file!r} (holding {name!r}) does not exist")
            files.append(shard)
    return files, weight_map, index


def open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except Exception as err:  # SafetensorError does not subclass anything more specific
        raise ConversionError(f"{file}: cannot read safetensors file (truncated or corrupt?): "
                              f"{err}") from None


def _check_shard_keys(files: list[Path], weight_map: dict[str, str] | None, index: Path | None
                      ) -> None:
    """Reads only headers: every tensor in exactly one shard, and where the index says."""
    where: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in where:
                    raise ConversionError(f"{file}: duplicate tensor {name!r}, also in {where[name]}")
                where[name] = file
    if weight_map is None:
        return
    for name, file in weight_map.items():
        if name not in where:
            raise ConversionError(f"{index}: missing tensor {name!r}: listed in shard {file!r}, "
                                  f"which does not contain it")
        if where[name].name != Path(file).name:
            raise ConversionError(f"{where[name]}: tensor {name!r} is here, but {index} puts it in "
                                  f"{file!r}")
    for name, file in where.items():
        if name not in weight_map:
            raise ConversionError(f"{file}: tensor {name!r} is not listed in {index}")


def _config(path: Path, config: Any) -> ModelConfig:
    """config: None (find config.json), a path, a parsed dict, or a ModelConfig."""
    if isinstance(config, ModelConfig):
        return config
    try:
        if isinstance(config, Mapping):
            return model_config_from_dict(config, source="config")
        if config is None:
            base = path if path.is_dir() else path.parent
            config = base / "config.json"
        config = Path(config)
        return model_config_from_dict(load_json(config), source=str(config))
    except ConfigError as err:
        raise ConversionError(str(err)) from err


def load_hf(path: str | Path, *, config: Any = None, dtype: Any = jnp.float32,
            mesh: Any = None) -> tuple[ModelConfig, ModelParams]:
    """Loads an HF Qwen3/Llama safetensors checkpoint, in the decoding layout (`model.model_specs`).

    dtype: floating dtype of the result (float32 default; bfloat16 for GPU).
    mesh: None (the default device) or a ("dp", "tp") mesh (`dflash_jax.sharding.make_mesh`):
    each tensor is then written into its tensor-parallel shards as it streams in.
    """
    path = Path(path)
    files, source = checkpoint_files(path)
    cfg = _config(path, config)

    def rename(name: str) -> str | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # some exporters write the tied copy too; the embedding is the weight
        return name

    layout, sharding = target_layout(cfg, mesh)
    asm = Assembler(layout, HF_TABLE, dtype, sharding)
    stream_tensors(files, asm, HF_TABLE, rename, "no mapping for this name")
    return cfg, asm.finish(source)


def target_layout(cfg: ModelConfig, mesh: Any) -> tuple[Any, Any]:
    """(the target's decoding layout at the mesh's tp, where each tensor goes) for an `Assembler`."""
    if mesh is None:
        return param_layout(cfg), None
    tp = mesh_sizes(mesh)[1]
    check_model(cfg, tp)
    return param_layout(cfg, tp), placement(mesh)


def checkpoint_files(path: Path) -> tuple[list[Path], str]:
    """-> (safetensors files, a name for the checkpoint in messages), after checking that every
    tensor is in exactly one shard and where the index says."""
    files, weight_map, index = _resolve_files(path)
    _check_shard_keys(files, weight_map, index)
    return files, str(index or (files[0] if len(files) == 1 else path))


def stream_tensors(files: list[Path], asm: Assembler, table: MappingTable,
                   rename: Callable[[str], str | None], unexpected: str) -> None:
    """Reads every tensor of `files` into `asm`, one at a time.

    rename: stored name -> the table's name, or None to skip the tensor.
    unexpected: why a name with no rule is an error (said in the message).
    Each tensor's shape is checked from the header before its data is read.
    """
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                name = rename(stored)
                if name is None:
                    continue
                origin = f"{file}: {stored!r}"
                found = table.lookup(name)
                if found is None:
                    raise ConversionError(f"{origin}: unexpected tensor ({unexpected})")
                rule, target = found
                asm.claim(target, rule, tuple(f.get_slice(stored).get_shape()), origin)
                try:
                    x = f.get_tensor(stored)
                except Exception as err:
                    raise ConversionError(f"{origin}: cannot read tensor: {err}") from None
                asm.put(target, rule, x)
