"""z-lab DFlash drafter checkpoints <-> (DraftConfig, DraftParams).

A drafter directory holds `config.json` (a Qwen3Config with `dflash_config` extras) and
`model.safetensors` (or sharded files with `model.safetensors.index.json`) in PyTorch layout:
`fc.weight`, `hidden_norm.weight`, `norm.weight` and Qwen3 layers `layers.N.*`, optionally
under a `model.` prefix. There is no embedding or LM head: the drafter uses the target's.

One mapping table (`DRAFT_TABLE`, in `convert.layout`'s format) drives both the import and
the export back to that layout (`export_drafter`), so the two cannot drift apart.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from convert.hf_safetensors import checkpoint_files, stream_tensors
from convert.layout import (HEADS_IN, HEADS_OUT, IDENTITY, TRANSPOSE, Assembler, ConversionError, Layout,
                            MappingTable, Rule, decoder_layer_rules)
from convert.shipped import DFLASH, resolve_shipped
from dflash_jax.config import ConfigError
from dflash_jax.drafter import (DraftConfig, DraftParams, draft_config_to_dict, draft_param_layout,
                                load_draft_config)
from dflash_jax.params import extract, layout_of, path_str
from dflash_jax.sharding import check_model, mesh_sizes, placement

WEIGHTS_FILE = "model.safetensors"
_PREFIX = "model."  # some exports nest the drafter under `model.`
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older exports saved; recomputed from config

DRAFT_TABLE = MappingTable([
    Rule("fc.weight", "fc", TRANSPOSE),  # [embed, taps*embed] -> [taps*embed, embed]
    Rule("hidden_norm.weight", "hidden_norm", IDENTITY),
    Rule("norm.weight", "final_norm", IDENTITY),
    *decoder_layer_rules("layers.{i}."),  # attention biases only with attention_bias
])

# Layouts whose source is the transpose of ours (up to a reshape of the head axes).
_TRANSPOSED_LAYOUTS = {TRANSPOSE.name, HEADS_IN.name, HEADS_OUT.name}


# ----------------------------------------------------------------------------- reading

def load_drafter(path: str | Path, dtype: Any = jnp.float32, *, mesh: Any = None, training: bool = False
                 ) -> tuple[DraftConfig, DraftParams]:
    """Reads a z-lab drafter directory -> (DraftConfig, DraftParams) in the decoding layout
    (`drafter.draft_specs` at the mesh's tp), each tensor written straight into its slices.

    path: the directory, or the short name of a shipped drafter ("smollm2", `convert.shipped`).
    dtype: floating dtype of the params (float32 default; bfloat16 for GPU).
    mesh: None (the default device) or a ("dp", "tp") mesh: each decoding tensor goes straight
        to its tensor-parallel shards.
    training: the checkpoint layout instead (`drafter.draft_checkpoint_specs`), which training
        optimises and `export_drafter` writes.
    Errors (ConversionError, a ValueError) name the file and the tensor: missing, unexpected
    (e.g. an embedding, or DFlash2's convolutions), duplicated, or mis-shaped for config.json.
    """
    path = resolve_shipped(path, DFLASH)
    if not path.is_dir():
        raise ConversionError(f"{path}: expected a drafter directory (config.json + {WEIGHTS_FILE})")
    try:
        dcfg = load_draft_config(path)
    except ConfigError as err:
        raise ConversionError(str(err)) from err
    files, source = checkpoint_files(path)

    def rename(stored: str) -> str | None:
        if stored.endswith(_IGNORED_SUFFIXES):
            return None
        return stored[len(_PREFIX):] if stored.startswith(_PREFIX) else stored

    tp = 1 if mesh is None else mesh_sizes(mesh)[1]
    check_model(dcfg, tp)
    asm = Assembler(draft_param_layout(dcfg, tp, training=training), DRAFT_TABLE, dtype,
                    None if mesh is None else placement(mesh))
    stream_tensors(files, asm, DRAFT_TABLE, rename,
                   "not part of a DFlashDraftModel; embeddings and LM head come from the target")
    return dcfg, asm.finish(source)


# ----------------------------------------------------------------------------- writing

def _to_source(layout: Layout, x: np.ndarray, source_shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `layout.apply`: our array -> the PyTorch-layout array of `source_shape`."""
    if layout.name in _TRANSPOSED_LAYOUTS:
        return np.ascontiguousarray(x.reshape(source_shape[::-1]).T)
    return np.ascontiguousarray(x.reshape(source_shape))


def params_to_tensors(dcfg: DraftConfig, dparams: DraftParams) -> dict[str, np.ndarray]:
    """DraftParams in the training layout or a decoding one -> {checkpoint name (no prefix):
    PyTorch-layout array}."""
    layout = _layout_of(dcfg, dparams)
    out = {}
    for path, x in extract(layout, dparams).items():
        name = DRAFT_TABLE.source_name(path)
        rule, _ = DRAFT_TABLE.lookup(name)
        out[name] = _to_source(rule.layout, x, tuple(rule.layout.source_shape(x.shape)))
    return out


def _layout_of(dcfg: DraftConfig, dparams: DraftParams) -> Any:
    """The layout `dparams` is in: the training one, or a decoding one (kv heads split over tp,
    or replicated)."""
    layout = layout_of(dparams, [draft_param_layout(dcfg, training=True), draft_param_layout(dcfg),
                                 draft_param_layout(dcfg, 2 * dcfg.num_kv_heads)])
    if layout is None:
        names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(dparams)[0]]
        raise ConversionError(f"DraftParams holds none of the drafter's layouts for this config: {names[:8]}")
    return layout


def export_drafter(dcfg: DraftConfig, dparams: DraftParams, out_dir: str | Path) -> Path:
    """Writes z-lab's layout (config.json + model.safetensors) for
    `dflash.model.DFlashDraftModel.from_pretrained(out_dir)`. Returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = params_to_tensors(dcfg, dparams)
    dtype = np.dtype(next(iter(tensors.values())).dtype).name
    config = draft_config_to_dict(dcfg, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir
