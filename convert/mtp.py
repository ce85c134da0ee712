"""Multi-token-prediction heads (`mtp.*` tensors) -> `dflash_jax.mtp.MTPParams`, and back.

The names are those of Qwen3.5 / Qwen3-Next checkpoints (vLLM's Qwen3-Next / Qwen3.5 MTP
loaders read them; they sit at the top level beside `model.*`):
  mtp.fc.weight                       [embed, 2 * embed]  (input: [embedding | hidden])
  mtp.pre_fc_norm_embedding.weight    [embed]
  mtp.pre_fc_norm_hidden.weight       [embed]
  mtp.layers.0.<decoder layer>        input_layernorm, post_attention_layernorm, self_attn.*, mlp.*
  mtp.norm.weight                     [embed]
For a hybrid target the layer is a gated full-attention layer (q_proj holds per head its query
and its output gate, q_norm / k_norm); for a dense target (a head exported by `export_mtp`) it is
a layer of the target's kind (Llama: no q/k norms; with attention_bias, q/k/v/o_proj.bias as the
target's layers store them). A Qwen3.5 checkpoint holds the head beside the target, so `load_mtp`
reads the same files as `convert.qwen3_5.load_qwen35` and keeps only `mtp.*`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from convert.hf_safetensors import checkpoint_files, open_safetensors
from convert.layout import ConversionError
from convert.shipped import MTP, resolve_shipped
from dflash_jax.config import ModelConfig
from dflash_jax.mtp import HIDDEN_SOURCES, MTPParams, is_hybrid, mtp_shardings, mtp_specs
from dflash_jax.params import is_spec
from dflash_jax.qwen3_5 import Qwen35Config

PREFIX = "mtp."
FILE = "mtp.safetensors"  # `export_mtp`'s file


def _t(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def _entries(cfg: ModelConfig | Qwen35Config) -> list[tuple[str, tuple[int, ...], tuple, Callable, Callable]]:
    """Every head tensor: (HF name after `mtp.`, stored shape, path of our leaf in MTPParams,
    stored -> ours (our leaf's shape), ours -> stored)."""
    e, m = cfg.hidden_size, cfg.intermediate_size
    qh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda x: x, lambda x: x)
    out = [
        ("fc.weight", (e, 2 * e), ("fc",),
         lambda x: np.stack([x[:, :e].T, x[:, e:].T]), lambda x: np.concatenate([x[0].T, x[1].T], 1)),
        ("pre_fc_norm_embedding.weight", (e,), ("norm_embed",)) + same,
        ("pre_fc_norm_hidden.weight", (e,), ("norm_hidden",)) + same,
        ("norm.weight", (e,), ("final_norm",)) + same,
    ]
    layer = "layers.0."
    if is_hybrid(cfg):
        out += [
            (layer + "input_layernorm.weight", (e,), ("layer", 0, "input_norm")) + same,
            (layer + "post_attention_layernorm.weight", (e,), ("layer", 0, "post_norm")) + same,
            (layer + "mlp.gate_proj.weight", (m, e), ("layer", 0, "gate_up", "gate"), None, None),
            (layer + "mlp.up_proj.weight", (m, e), ("layer", 0, "gate_up", "up"), None, None),
            (layer + "mlp.down_proj.weight", (e, m), ("layer", 0, "down"), _t, _t),
            (layer + "self_attn.q_proj.weight", (qh * 2 * hd, e), ("layer", 1, "q"),
             lambda x: x.T.reshape(e, qh, 2, hd), lambda x: x.reshape(e, -1).T),
            (layer + "self_attn.k_proj.weight", (kvh * hd, e), ("layer", 1, "k"),
             lambda x: x.T.reshape(e, kvh, hd), lambda x: x.reshape(e, -1).T),
            (layer + "self_attn.v_proj.weight", (kvh * hd, e), ("layer", 1, "v"),
             lambda x: x.T.reshape(e, kvh, hd), lambda x: x.reshape(e, -1).T),
            (layer + "self_attn.o_proj.weight", (e, qh * hd), ("layer", 1, "o"),
             lambda x: x.T.reshape(qh, hd, e), lambda x: x.reshape(-1, e).T),
            (layer + "self_attn.q_norm.weight", (hd,), ("layer", 1, "q_norm")) + same,
            (layer + "self_attn.k_norm.weight", (hd,), ("layer", 1, "k_norm")) + same,
        ]
        return out
    if cfg.mlp_bias:
        raise ConversionError("mlp_bias is true: MLP biases are supported neither in targets nor in their "
                              "MTP heads")
    out += [
        (layer + "input_layernorm.weight", (e,), ("layer", "attn_norm")) + same,
        (layer + "post_attention_layernorm.weight", (e,), ("layer", "mlp_norm")) + same,
        (layer + "mlp.gate_proj.weight", (m, e), ("layer", "mlp", "gate"), _t, _t),
        (layer + "mlp.up_proj.weight", (m, e), ("layer", "mlp", "up"), _t, _t),
        (layer + "mlp.down_proj.weight", (e, m), ("layer", "mlp", "down"), _t, _t),
        (layer + "self_attn.q_proj.weight", (qh * hd, e), ("layer", "attn", "q"),
         lambda x: x.T.reshape(e, qh, hd), lambda x: x.reshape(e, -1).T),
        (layer + "self_attn.k_proj.weight", (kvh * hd, e), ("layer", "attn", "k"),
         lambda x: x.T.reshape(e, kvh, hd), lambda x: x.reshape(e, -1).T),
        (layer + "self_attn.v_proj.weight", (kvh * hd, e), ("layer", "attn", "v"),
         lambda x: x.T.reshape(e, kvh, hd), lambda x: x.reshape(e, -1).T),
        (layer + "self_attn.o_proj.weight", (e, qh * hd), ("layer", "attn", "o"),
         lambda x: x.T.reshape(qh, hd, e), lambda x: x.reshape(-1, e).T),
    ]
    if cfg.qk_norm:
        out += [(layer + "self_attn.q_norm.weight", (hd,), ("layer", "attn", "q_norm")) + same,
                (layer + "self_attn.k_norm.weight", (hd,), ("layer", "attn", "k_norm")) + same]
    if cfg.attention_bias:  # stored flat, [heads * head_dim]; ours per head, as the target's
        def flat(x):
            return x.reshape(-1)
        out += [(layer + "self_attn.q_proj.bias", (qh * hd,), ("layer", "attn", "q_bias"),
                 lambda x: x.reshape(qh, hd), flat),
                (layer + "self_attn.k_proj.bias", (kvh * hd,), ("layer", "attn", "k_bias"),
                 lambda x: x.reshape(kvh, hd), flat),
                (layer + "self_attn.v_proj.bias", (kvh * hd,), ("layer", "attn", "v_bias"),
                 lambda x: x.reshape(kvh, hd), flat),
                (layer + "self_attn.o_proj.bias", (e,), ("layer", "attn", "o_bias")) + same]
    return out


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p] if isinstance(p, int) else getattr(tree, p)
    return tree


def load_mtp(path: str | Path, cfg: ModelConfig | Qwen35Config, dtype: Any = jnp.float32, *,
             mesh: Any = None) -> MTPParams:
    """Reads the `mtp.*` tensors of a checkpoint (a Qwen3.5 / Qwen3.6 one, a directory written
    by `export_mtp`, or the short name of a shipped head, "smollm2", `convert.shipped`) into the
    head for target `cfg`; other tensors are ignored.

    mesh: None (the default device) or a ("dp", "tp") mesh: each tensor goes straight to its
        tensor-parallel shards, laid out by `mtp_specs`' logical axes like the target's layers
        (a ShardingError naming the numbers, before anything is read, when tp does not fit).
    Raises ConversionError naming the tensor and the file for a missing, unexpected, duplicate or
    mis-shaped `mtp.*` tensor (one error, the first found).
    """
    shardings = None if mesh is None else mtp_shardings(cfg, mesh)  # raises before anything is read
    files, source = checkpoint_files(resolve_shipped(path, MTP))
    entries = {PREFIX + name: rest for name, *rest in _entries(cfg)}
    arrays: dict[str, np.ndarray] = {}
    seen: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                if not stored.startswith(PREFIX):
                    continue
                if stored not in entries:
                    raise ConversionError(f"{file}: {stored!r}: unexpected MTP tensor (a head for this target has "
                                          f"{len(entries)} tensors, e.g. {next(iter(entries))!r})")
                if stored in seen:
                    raise ConversionError(f"{file}: {stored!r}: duplicate tensor; also in {seen[stored]}")
                seen[stored] = file
                want = entries[stored][0]
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != want:
                    raise ConversionError(f"{file}: {stored!r}: MTP tensor has shape {shape}, expected {want} "
                                          "for this target")
                arrays[stored] = np.asarray(f.get_tensor(stored), np.float32)
    missing = [n for n in entries if n not in arrays]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{source}: missing MTP tensor {missing[0]!r}{more}; "
                              "--method mtp needs a checkpoint with the head's `mtp.*` tensors")
    specs = mtp_specs(cfg)
    leaves: dict[tuple, np.ndarray] = {}
    for name, (_, where, to_ours, _) in entries.items():
        if to_ours is None:  # gate / up: halves of our fused gate_up [embed, 2, mlp]
            continue
        leaves[where] = to_ours(arrays[name])
    if is_hybrid(cfg):
        gate, up = arrays[PREFIX + "layers.0.mlp.gate_proj.weight"], arrays[PREFIX + "layers.0.mlp.up_proj.weight"]
        leaves[("layer", 0, "gate_up")] = np.stack([gate.T, up.T], 1)

    def build(path: tuple, spec: Any) -> np.ndarray:
        key = tuple(p.idx if hasattr(p, "idx") else p.name for p in path)
        x = leaves[key]
        if x.shape != spec.shape:
            raise ConversionError(f"{source}: MTP tensor for {key} assembles to {x.shape}, expected {spec.shape}")
        return np.asarray(x, jnp.dtype(dtype))

    host = jax.tree_util.tree_map_with_path(build, specs, is_leaf=is_spec)
    return jax.device_put(host, shardings)  # each device receives only its shards (None: the default device)


def export_mtp(mparams: MTPParams, cfg: ModelConfig | Qwen35Config, directory: str | Path,
               hidden_source: str = "post_norm") -> Path:
    """Writes the head as `mtp.*` tensors in `directory/mtp.safetensors` (what `load_mtp` and
    `--draft` read for a dense target's head), in the head's own floating dtype (float32, or
    bfloat16 after `train --export-dtype bfloat16`), its hidden source in the file's metadata
    (`hidden_source_of`). Returns the file."""
    from safetensors.numpy import save_file

    if hidden_source not in HIDDEN_SOURCES:
        raise ValueError(f"hidden_source must be one of {HIDDEN_SOURCES}, got {hidden_source!r}")
    out = {}
    for name, _, where, _, to_stored in _entries(cfg):
        if to_stored is None:
            gate_up = np.asarray(_get(mparams, where[:-1]))  # [embed, 2, mlp]
            out[PREFIX + name] = np.ascontiguousarray(gate_up[:, 0 if where[-1] == "gate" else 1].T)
            continue
        out[PREFIX + name] = np.ascontiguousarray(to_stored(np.asarray(_get(mparams, where))))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, str(directory / FILE), metadata={"hidden_source": hidden_source})
    return directory / FILE


def hidden_source_of(path: str | Path) -> str:
    """The hidden source a head was trained with: `export_mtp`'s metadata in path/mtp.safetensors
    (or path itself; a shipped head's short name), else "post_norm" (Qwen3.5 / Qwen3.6 checkpoints;
    `dflash_jax.mtp`'s docstring)."""
    path = resolve_shipped(path, MTP)
    file = path / FILE if path.is_dir() else path
    if file.name != FILE or not file.is_file():
        return "post_norm"
    with open_safetensors(file) as f:
        source = (f.metadata() or {}).get("hidden_source", "post_norm")
    if source not in HIDDEN_SOURCES:
        raise ConversionError(f"{file}: metadata hidden_source {source!r}, expected one of {HIDDEN_SOURCES}")
    return source
