"""Hugging Face safetensors checkpoints of Qwen3.5 / Qwen3.6 hybrids -> `(Qwen35Config, Qwen35Params)`.

Accepted inputs are those of `convert.hf_safetensors` (a directory with `model.safetensors` or a
sharded checkpoint with `model.safetensors.index.json`, a single file, an index file), holding
the tensor names either of transformers' classes loads:
- `Qwen3_5ForCausalLM`: `model.layers.{i}.…`, `model.embed_tokens.weight`, `model.norm.weight`;
- `Qwen3_5ForConditionalGeneration` (the published checkpoints): the same under
  `model.language_model.`;
and `lm_head.weight` at the top in both. The vision tower (`model.visual.*`, or `visual.*` in
older exports) and the multi-token-prediction head (`mtp.*`) are not part of the target: they are
skipped and counted in one line on stderr.

The mapping is a table (`LAYER_ROWS` and three top-level rows): each HF tensor, its stored
shape, and the slices of the per-layer decoding tensors (`dflash_jax.qwen3_5.model_specs`) it
fills. `checkpoint_layout` turns the table into a `ParamLayout`, so a `Builder` writes each
tensor straight into its slices as it streams in. Every decoding tensor belongs to one layer, so
it goes to its device(s) as soon as that layer's tensors have arrived (a fused one, e.g. gdn.qkv
from in_proj_qkv's three pieces, when all of its pieces have).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from convert.hf_safetensors import checkpoint_files, open_safetensors
from convert.layout import ConversionError
from dflash_jax.config import ConfigError
from dflash_jax.params import Builder, ParamLayout, Part, SlotIndex, Spec, is_spec, path_str
from dflash_jax.qwen3_5 import (FULL, LINEAR, Qwen35Config, Qwen35Params, check_tp, load_qwen35_config,
                                model_specs, qwen35_config_from_dict)
from dflash_jax.sharding import mesh_sizes, placement

# The text decoder's prefixes, the vision-language wrapper's first (it also starts with "model.").
TEXT_PREFIXES = ("model.language_model.", "model.")
# Stored-name prefixes of the weights that are not part of the target, and how the summary names them.
SKIPPED = (("model.visual.", "model.visual.*"), ("visual.", "visual.*"), ("mtp.", "mtp.*"))
LM_HEAD = "lm_head.weight"
EVERY_LAYER = "every layer"  # a `Row.kind`: the tensor is in every decoder layer (norms, MLP)


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF tensor of the text decoder and where it goes.

    name: its name after the text prefix (layer rows: after `layers.{i}.`), or `LM_HEAD`.
    kind: the layer kind it belongs to (FULL / LINEAR), EVERY_LAYER, or None (not in a layer).
    stored: its shape in the checkpoint, from the config.
    targets: (decoding path, "{i}" standing for the layer's index within its tuple, slot in that
        tensor) per piece.
    pieces: the stored array -> one array per target, element order already ours (the
        builder reshapes each into its slot).
    """

    name: str
    kind: str | None
    stored: Callable[[Qwen35Config], tuple[int, ...]]
    targets: tuple[tuple[str, Callable[[Qwen35Config], SlotIndex]], ...]
    pieces: Callable[[np.ndarray, Qwen35Config], tuple[np.ndarray, ...]]


def _whole(cfg: Qwen35Config) -> SlotIndex:
    return ()


def _same(x: np.ndarray, cfg: Qwen35Config) -> tuple[np.ndarray, ...]:
    return (x,)


def _transposed(x: np.ndarray, cfg: Qwen35Config) -> tuple[np.ndarray, ...]:
    """torch Linear [out, in] -> our [in, out...]: our einsums contract the first axis."""
    return (x.T,)


def _conv_pieces(cols: np.ndarray, cfg: Qwen35Config) -> tuple[np.ndarray, ...]:
    """[..., q | k | v] channels (HF's order: all q heads, all k heads, all v heads) -> q, k, v.

    Each becomes [..., key heads, its channels] in its slot of our key-head-major layout; v's
    value head j sits with key head j // group (transformers repeats each key head `group`
    times, repeat_interleave).
    """
    qk = cfg.gdn_key_heads * cfg.gdn_key_dim
    return cols[..., :qk], cols[..., qk:2 * qk], cols[..., 2 * qk:]


def _key_major(cfg: Qwen35Config) -> tuple[tuple[int, int], ...]:
    dk = cfg.gdn_key_dim
    return (0, dk), (dk, 2 * dk), (2 * dk, cfg.conv_head_channels)


def _layer_rows() -> list[Row]:
    def e(c: Qwen35Config) -> int:
        return c.hidden_size

    L = EVERY_LAYER
    qkv_slots = tuple(("gdn.{i}.qkv", (lambda c, n=n: (None, None, _key_major(c)[n]))) for n in range(3))
    conv_slots = tuple(("gdn.{i}.conv", (lambda c, n=n: (None, None, _key_major(c)[n]))) for n in range(3))
    return [
        Row("input_layernorm.weight", L, lambda c: (e(c),), (("layers.{i}.input_norm", _whole),), _same),
        Row("post_attention_layernorm.weight", L, lambda c: (e(c),), (("layers.{i}.post_norm", _whole),), _same),
        Row("mlp.gate_proj.weight", L, lambda c: (c.intermediate_size, e(c)),
            (("layers.{i}.gate_up", lambda c: (None, 0)),), _transposed),
        Row("mlp.up_proj.weight", L, lambda c: (c.intermediate_size, e(c)),
            (("layers.{i}.gate_up", lambda c: (None, 1)),), _transposed),
        Row("mlp.down_proj.weight", L, lambda c: (e(c), c.intermediate_size), (("layers.{i}.down", _whole),), _transposed),
        # q_proj's rows are per head [its query (head_dim), its output gate (head_dim)]: our [embed, q_heads, 2, hd].
        Row("self_attn.q_proj.weight", FULL, lambda c: (c.num_heads * 2 * c.head_dim, e(c)),
            (("attn.{i}.q", _whole),), _transposed),
        Row("self_attn.k_proj.weight", FULL, lambda c: (c.num_kv_heads * c.head_dim, e(c)),
            (("attn.{i}.k", _whole),), _transposed),
        Row("self_attn.v_proj.weight", FULL, lambda c: (c.num_kv_heads * c.head_dim, e(c)),
            (("attn.{i}.v", _whole),), _transposed),
        Row("self_attn.o_proj.weight", FULL, lambda c: (e(c), c.num_heads * c.head_dim),
            (("attn.{i}.o", _whole),), _transposed),
        Row("self_attn.q_norm.weight", FULL, lambda c: (c.head_dim,), (("attn.{i}.q_norm", _whole),), _same),
        Row("self_attn.k_norm.weight", FULL, lambda c: (c.head_dim,), (("attn.{i}.k_norm", _whole),), _same),
        Row("linear_attn.in_proj_qkv.weight", LINEAR, lambda c: (c.conv_channels, e(c)), qkv_slots,
            lambda x, c: _conv_pieces(x.T, c)),
        # conv1d is depthwise: [channels, 1, kernel] -> our [kernel, channels], then split like in_proj_qkv.
        Row("linear_attn.conv1d.weight", LINEAR, lambda c: (c.conv_channels, 1, c.conv_kernel), conv_slots,
            lambda x, c: _conv_pieces(x[:, 0].T, c)),
        Row("linear_attn.in_proj_z.weight", LINEAR, lambda c: (c.gdn_value_heads * c.gdn_value_dim, e(c)),
            (("gdn.{i}.zba", lambda c: (None, None, (0, c.gdn_value_dim))),), _transposed),
        Row("linear_attn.in_proj_b.weight", LINEAR, lambda c: (c.gdn_value_heads, e(c)),
            (("gdn.{i}.zba", lambda c: (None, None, c.gdn_value_dim)),), _transposed),
        Row("linear_attn.in_proj_a.weight", LINEAR, lambda c: (c.gdn_value_heads, e(c)),
            (("gdn.{i}.zba", lambda c: (None, None, c.gdn_value_dim + 1)),), _transposed),
        Row("linear_attn.A_log", LINEAR, lambda c: (c.gdn_value_heads,), (("gdn.{i}.a_log", _whole),), _same),
        Row("linear_attn.dt_bias", LINEAR, lambda c: (c.gdn_value_heads,), (("gdn.{i}.dt_bias", _whole),), _same),
        Row("linear_attn.norm.weight", LINEAR, lambda c: (c.gdn_value_dim,), (("gdn.{i}.norm", _whole),), _same),
        Row("linear_attn.out_proj.weight", LINEAR, lambda c: (e(c), c.gdn_value_heads * c.gdn_value_dim),
            (("gdn.{i}.out", _whole),), _transposed),
    ]


EMBED_ROW = Row("embed_tokens.weight", None, lambda c: (c.vocab_size, c.hidden_size), (("embed", _whole),), _same)
NORM_ROW = Row("norm.weight", None, lambda c: (c.hidden_size,), (("final_norm", _whole),), _same)
LM_HEAD_ROW = Row(LM_HEAD, None, lambda c: (c.vocab_size, c.hidden_size), (("lm_head", _whole),), _transposed)
LAYER_ROWS = tuple(_layer_rows())
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def expected_tensors(cfg: Qwen35Config) -> dict[str, tuple[Row, int | None]]:
    """Every tensor this config needs, by its name after the text prefix (`lm_head.weight` as
    stored), in checkpoint order -> (its row, its layer's index in its params tuple; None at the top)."""
    out: dict[str, tuple[Row, int | None]] = {EMBED_ROW.name: (EMBED_ROW, None), NORM_ROW.name: (NORM_ROW, None)}
    kind_index = {FULL: {l: n for n, l in enumerate(cfg.attn_layers)},
                  LINEAR: {l: n for n, l in enumerate(cfg.gdn_layers)}}
    for i, kind in enumerate(cfg.layer_types):
        for row in LAYER_ROWS:
            if row.kind == EVERY_LAYER:
                out[f"layers.{i}.{row.name}"] = (row, i)
            elif row.kind == kind:
                out[f"layers.{i}.{row.name}"] = (row, kind_index[kind][i])
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (LM_HEAD_ROW, None)
    return out


def _piece_key(name: str, n: int, count: int) -> str:
    return name if count == 1 else f"{name}[{n}]"


def checkpoint_layout(cfg: Qwen35Config) -> ParamLayout:
    """The decoding layout (`model_specs`) declared over the checkpoint's tensors.

    Sources are keyed by HF name (after the text prefix; "name[n]" for the n-th piece of a
    tensor split over several slots) and hold the piece in our axis order.
    """
    specs = model_specs(cfg)
    decl = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
    sources: dict[str, Spec] = {}
    parts: dict[str, list[Part]] = collections.defaultdict(list)
    for name, (row, layer) in expected_tensors(cfg).items():
        for n, (template, tail) in enumerate(row.targets):
            target = template if layer is None else template.format(i=layer)
            spec = decl[target]
            part = Part(_piece_key(name, n, len(row.targets)), tuple(tail(cfg)))
            index = part.index + (None,) * (len(spec.shape) - len(part.index))
            axes = tuple(a for a, i in zip(spec.axes, index) if not isinstance(i, int))
            sources[part.source] = Spec(part.slot_shape(spec.shape), axes, spec.init, spec.fan_in)
            parts[target].append(part)

    def with_parts(path: tuple, spec: Spec) -> Spec:
        return dataclasses.replace(spec, parts=tuple(parts[path_str(path)]))

    return ParamLayout(jax.tree_util.tree_map_with_path(with_parts, specs, is_leaf=is_spec), sources)


def _skipped_kind(stored: str) -> str | None:
    for prefix, label in SKIPPED:
        if stored.startswith(prefix):
            return label
    return None


def _text_name(stored: str) -> tuple[str, str] | None:
    """stored name -> (text prefix, name after it), or None when it is not a text-decoder name."""
    if stored == LM_HEAD:
        return "", LM_HEAD
    for prefix in TEXT_PREFIXES:
        if stored.startswith(prefix):
            return prefix, stored[len(prefix):]
    return None


def _why_unexpected(name: str, cfg: Qwen35Config) -> str:
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return "not a Qwen3.5 text-decoder tensor"
    layer, rest = int(match.group(1)), match.group(2)
    if layer >= cfg.num_layers:
        return f"layer {layer} is past the config's num_hidden_layers ({cfg.num_layers})"
    for row in LAYER_ROWS:
        if row.name == rest and row.kind not in (EVERY_LAYER, cfg.layer_types[layer]):
            return f"layer {layer} is {cfg.layer_types[layer]!r} in the config's layer_types"
    return "not a Qwen3.5 decoder-layer tensor"


def _config(path: Path, config: Any) -> Qwen35Config:
    """config: None (config.json beside the weights), a path, a parsed dict, or a Qwen35Config."""
    if isinstance(config, Qwen35Config):
        return config
    try:
        if isinstance(config, Mapping):
            return qwen35_config_from_dict(config, "config")
        if config is None:
            config = path if path.is_dir() else path.parent
        return load_qwen35_config(config)
    except ConfigError as err:
        raise ConversionError(str(err)) from err


def load_qwen35(path: str | Path, *, config: Any = None, dtype: Any = jnp.float32, mesh: Any = None,
                log: TextIO | None = None) -> tuple[Qwen35Config, Qwen35Params]:
    """Loads a Qwen3.5 / Qwen3.6 safetensors checkpoint (text model or vision-language wrapper).

    dtype: floating dtype of the params (float32 default; bfloat16 for GPU).
    mesh: None (the default device) or a ("dp", "tp") mesh (`dflash_jax.sharding.make_mesh`): each
        decoding tensor then goes straight onto its tensor-parallel shards (`qwen3_5.check_tp`
        says which tp a config allows, before anything is read).
    log: where the one-line summary of skipped tensors goes (default stderr).
    Raises ConversionError naming the file and tensor for a missing, unexpected, duplicate or
    mis-shaped tensor.
    """
    path = Path(path)
    files, source = checkpoint_files(path)
    cfg = _config(path, config)
    if mesh is not None:
        check_tp(cfg, mesh_sizes(mesh)[1])
    expected = expected_tensors(cfg)
    builder = Builder(checkpoint_layout(cfg), dtype, None if mesh is None else placement(mesh))
    seen: dict[str, str] = {}  # name after the prefix -> "file: stored name"
    prefixes: list[str] = []
    skipped: collections.Counter[str] = collections.Counter()
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                origin = f"{file}: {stored!r}"
                label = _skipped_kind(stored)
                if label is not None:
                    skipped[label] += 1
                    continue
                split = _text_name(stored)
                if split is None:
                    raise ConversionError(f"{origin}: unexpected tensor (not a Qwen3.5 text-decoder, vision or "
                                          "mtp tensor)")
                prefix, name = split
                if name == LM_HEAD and cfg.tie_word_embeddings:
                    continue  # some exporters write the tied copy too; the embedding is the weight
                if name not in expected:
                    raise ConversionError(f"{origin}: unexpected tensor ({_why_unexpected(name, cfg)})")
                if name in seen:
                    raise ConversionError(f"{origin}: duplicate tensor; it was already loaded from {seen[name]}")
                seen[name] = origin
                if prefix:
                    prefixes.append(prefix)
                row, _ = expected[name]
                shape, want = tuple(f.get_slice(stored).get_shape()), tuple(row.stored(cfg))
                if shape != want:
                    raise ConversionError(f"{origin}: tensor has shape {shape}, expected {want} for this config")
                try:
                    x = f.get_tensor(stored)
                except Exception as err:  # safetensors raises its own error types
                    raise ConversionError(f"{origin}: cannot read tensor: {err}") from None
                for n, piece in enumerate(row.pieces(x, cfg)):
                    builder.put(_piece_key(name, n, len(row.targets)), piece)
    missing = [n for n in expected if n not in seen]
    if missing:
        prefix = "" if missing[0] == LM_HEAD else (prefixes[0] if prefixes else TEXT_PREFIXES[1])
        raise ConversionError(f"{source}: missing tensor {prefix + missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if skipped:
        counts = ", ".join(f"{label} ({n})" for label, n in skipped.items())
        print(f"{source}: skipped {sum(skipped.values())} tensors: {counts}", file=log or sys.stderr)
    return cfg, builder.finish()
