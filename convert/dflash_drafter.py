"""z-lab DFlash drafter checkpoints <-> (DraftConfig, DraftParams).

A drafter directory holds `config.json` (a Qwen3Config with `dflash_config` extras) and
`model.safetensors` (or a sharded `model.safetensors.index.json`) with PyTorch-layout weights:
`fc.weight`, `hidden_norm.weight`, `norm.weight` and `layers.N.*` Qwen3 layers, optionally
under a `model.` prefix. It has no embedding or LM head: the target's are used.

Every tensor is mapped by one row of `tensor_table`, which also drives the export back to
that layout (`export_drafter`), so loading and exporting cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_jax.drafter import (DraftConfig, DraftParams, draft_config_to_dict, draft_specs,
                                load_draft_config)
from dflash_jax.params import path_str, tree_from_mapping

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PREFIX = "model."


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One checkpoint tensor: its name, its PyTorch shape, and where it lives in DraftParams."""

    name: str  # checkpoint name, without the optional "model." prefix
    path: str  # dotted path in DraftParams
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def tensor_table(dcfg: DraftConfig) -> list[TensorRule]:
    """The full mapping of a drafter checkpoint for `dcfg` (every row must be present)."""
    e, m = dcfg.hidden_size, dcfg.intermediate_size
    qh, kvh, hd = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim

    def heads_in(h: int) -> tuple[Callable, Callable]:
        # nn.Linear [h*d, e] -> our [e, h, d] (and back)
        return (lambda x: np.ascontiguousarray(x.T.reshape(e, h, hd)),
                lambda x: np.ascontiguousarray(x.reshape(e, h * hd).T))

    def heads_bias(h: int) -> tuple[Callable, Callable]:
        return lambda x: x.reshape(h, hd), lambda x: x.reshape(h * hd)

    heads_out = (lambda x: np.ascontiguousarray(x.T.reshape(qh, hd, e)),
                 lambda x: np.ascontiguousarray(x.reshape(qh * hd, e).T))

    rows = [
        TensorRule("fc.weight", "fc", (e, dcfg.num_taps * e), _transpose, _transpose),
        TensorRule("hidden_norm.weight", "hidden_norm", (e,), _same, _same),
        TensorRule("norm.weight", "final_norm", (e,), _same, _same),
    ]
    for i in range(dcfg.num_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        rows += [
            TensorRule(hf + "input_layernorm.weight", ours + "attn_norm", (e,), _same, _same),
            TensorRule(hf + "post_attention_layernorm.weight", ours + "mlp_norm", (e,), _same, _same),
            TensorRule(hf + "self_attn.q_proj.weight", ours + "attn.q", (qh * hd, e), *heads_in(qh)),
            TensorRule(hf + "self_attn.k_proj.weight", ours + "attn.k", (kvh * hd, e), *heads_in(kvh)),
            TensorRule(hf + "self_attn.v_proj.weight", ours + "attn.v", (kvh * hd, e), *heads_in(kvh)),
            TensorRule(hf + "self_attn.o_proj.weight", ours + "attn.o", (e, qh * hd), *heads_out),
            TensorRule(hf + "self_attn.q_norm.weight", ours + "attn.q_norm", (hd,), _same, _same),
            TensorRule(hf + "self_attn.k_norm.weight", ours + "attn.k_norm", (hd,), _same, _same),
            TensorRule(hf + "mlp.gate_proj.weight", ours + "mlp.gate", (m, e), _transpose, _transpose),
            TensorRule(hf + "mlp.up_proj.weight", ours + "mlp.up", (m, e), _transpose, _transpose),
            TensorRule(hf + "mlp.down_proj.weight", ours + "mlp.down", (e, m), _transpose, _transpose),
        ]
        if dcfg.attention_bias:
            rows += [
                TensorRule(hf + "self_attn.q_proj.bias", ours + "attn.q_bias", (qh * hd,), *heads_bias(qh)),
                TensorRule(hf + "self_attn.k_proj.bias", ours + "attn.k_bias", (kvh * hd,), *heads_bias(kvh)),
                TensorRule(hf + "self_attn.v_proj.bias", ours + "attn.v_bias", (kvh * hd,), *heads_bias(kvh)),
                TensorRule(hf + "self_attn.o_proj.bias", ours + "attn.o_bias", (e,), _same, _same),
            ]
    return rows


# ----------------------------------------------------------------------------- reading

def _weight_files(directory: Path) -> list[Path]:
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.exists():
        return [single]
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: no 'weight_map'")
        return [directory / f for f in sorted(set(weight_map.values()))]
    raise ValueError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")


def read_tensors(directory: str | Path) -> dict[str, tuple[np.ndarray, str]]:
    """{name without "model." prefix: (array, file it came from)} for every tensor in the checkpoint."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    for file in _weight_files(Path(directory)):
        if not file.exists():
            raise ValueError(f"{file}: weight file listed in {INDEX_FILE} is missing")
        with safe_open(str(file), framework="numpy") as f:
            for raw in f.keys():
                name = raw[len(_PREFIX):] if raw.startswith(_PREFIX) else raw
                if name in out:
                    raise ValueError(f"{file}: tensor {raw!r} duplicates {name!r} from {out[name][1]}")
                out[name] = (f.get_tensor(raw), str(file))
    return out


def params_from_tensors(dcfg: DraftConfig, tensors: Mapping[str, tuple[np.ndarray, str]],
                        source: str, dtype: Any = None) -> DraftParams:
    """Maps checkpoint tensors ({name: (array, file)}) to DraftParams, loudly.

    Errors name the tensor and file: a missing tensor, an unexpected one (e.g. an embedding,
    or DFlash2 convolutions), or one whose shape disagrees with config.json.
    dtype: cast floating weights to it; None keeps the stored dtype.
    """
    table = tensor_table(dcfg)
    expected = {r.name for r in table}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {unexpected} (not part of a DFlashDraftModel "
                         f"for this config; embeddings and LM head come from the target)")
    values = {}
    for rule in table:
        if rule.name not in tensors:
            raise ValueError(f"{source}: tensor {rule.name!r} is missing "
                             f"(expected shape {rule.hf_shape})")
        array, file = tensors[rule.name]
        if tuple(array.shape) != rule.hf_shape:
            raise ValueError(f"{file}: tensor {rule.name!r} has shape {tuple(array.shape)}, "
                             f"expected {rule.hf_shape} from config.json")
        ours = rule.to_ours(np.asarray(array))
        values[rule.path] = jnp.asarray(ours, dtype=dtype or ours.dtype)
    return tree_from_mapping(draft_specs(dcfg), values, source)


def load_drafter(path: str | Path, dtype: Any = None) -> tuple[DraftConfig, DraftParams]:
    """Reads a z-lab drafter directory (config.json + safetensors) -> (DraftConfig, DraftParams)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: expected a drafter directory (config.json + {WEIGHTS_FILE})")
    dcfg = load_draft_config(path)
    return dcfg, params_from_tensors(dcfg, read_tensors(path), str(path), dtype)


# ----------------------------------------------------------------------------- writing

def params_to_tensors(dcfg: DraftConfig, dparams: DraftParams) -> dict[str, np.ndarray]:
    """DraftParams -> {checkpoint name: PyTorch-layout array} (no prefix)."""
    flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(dparams)[0]}
    out = {}
    for rule in tensor_table(dcfg):
        if rule.path not in flat:
            raise ValueError(f"DraftParams has no tensor {rule.path} (for {rule.name})")
        out[rule.name] = np.ascontiguousarray(rule.to_hf(np.asarray(flat[rule.path])))
    return out


def export_drafter(dcfg: DraftConfig, dparams: DraftParams, out_dir: str | Path) -> Path:
    """Writes z-lab's layout (config.json + model.safetensors) that
    `dflash.model.DFlashDraftModel.from_pretrained(out_dir)` loads. Returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = params_to_tensors(dcfg, dparams)
    dtype = np.dtype(next(iter(tensors.values())).dtype).name
    config = draft_config_to_dict(dcfg, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir
