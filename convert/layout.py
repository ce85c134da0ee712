"""Shared machinery of the converters: layout transforms, mapping tables, and the assembler.

Every converter is a *mapping table*: source tensor name (with `{i}` for the layer index) ->
our dotted param path + a `Layout` that turns the source layout into ours. Both HF
safetensors and GGUF store matrices as `[out_features, in_features]` (GGUF's numpy view
reverses ggml's dimension order, which lands on the same layout), so both tables share the
layouts below.

`Assembler` receives tensors one at a time, checks each against the layout's sources (the
checkpoint-layout declarations, e.g. `model.checkpoint_specs(cfg)`) BEFORE reading its data
(unexpected name, duplicate, wrong shape), converts it, and writes it straight into its slices
of the decoding layout (`params.ParamLayout`); a decoding tensor goes to its shards as soon as
its last part is in, so the host holds only the tensors still being filled.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy (safetensors' numpy reader needs it)
import numpy as np

from dflash_jax.params import Builder, ParamLayout, Spec


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message names the file and the tensor or field."""


# ----------------------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class Layout:
    """How a source tensor becomes ours.

    `source_shape(target_shape)` is the shape the source must have (checked before loading);
    `apply(x, target_shape)` converts a source-layout array of that shape.
    """

    name: str
    source_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    apply: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]


# Norm weights, embeddings, output biases: same layout on both sides.
IDENTITY = Layout("identity", lambda t: t, lambda x, t: x)

# [out, in] -> [in, out]: our einsums contract the first axis (x @ W), torch's Linear the last.
TRANSPOSE = Layout("transpose", lambda t: (t[1], t[0]), lambda x, t: x.T)

# q/k/v projections: [heads * head_dim, embed] -> [embed, heads, head_dim]. Rows are head-major
# (row = head * head_dim + j), so a reshape after the transpose splits heads correctly.
HEADS_IN = Layout("split_heads_in", lambda t: (t[1] * t[2], t[0]), lambda x, t: x.T.reshape(t))

# o projection: [embed, heads * head_dim] -> [heads, head_dim, embed].
HEADS_OUT = Layout("split_heads_out", lambda t: (t[2], t[0] * t[1]), lambda x, t: x.T.reshape(t))

# q/k/v biases: [heads * head_dim] -> [heads, head_dim].
HEADS_BIAS = Layout("split_heads_bias", lambda t: (t[0] * t[1],), lambda x, t: x.reshape(t))


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a mapping table: a source name template and where its tensor goes."""

    source: str  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
    target: str  # e.g. "layers.{i}.attn.q"
    layout: Layout
    tag: str | None = None  # format-specific extra step (GGUF: "rope_q" / "rope_k" un-permutation)


def decoder_layer_rules(prefix: str) -> list[Rule]:
    """The HF/PyTorch names of one Qwen3/Llama decoder layer (`prefix` ends in "layers.{i}.").

    Targets and drafters share this layer, so their tables share these rows.
    """
    t = "layers.{i}."
    return [
        Rule(prefix + "input_layernorm.weight", t + "attn_norm", IDENTITY),
        Rule(prefix + "post_attention_layernorm.weight", t + "mlp_norm", IDENTITY),
        Rule(prefix + "self_attn.q_proj.weight", t + "attn.q", HEADS_IN),  # [qh*hd, e] -> [e, qh, hd]
        Rule(prefix + "self_attn.k_proj.weight", t + "attn.k", HEADS_IN),  # [kvh*hd, e] -> [e, kvh, hd]
        Rule(prefix + "self_attn.v_proj.weight", t + "attn.v", HEADS_IN),
        Rule(prefix + "self_attn.o_proj.weight", t + "attn.o", HEADS_OUT),  # [e, qh*hd] -> [qh, hd, e]
        Rule(prefix + "self_attn.q_norm.weight", t + "attn.q_norm", IDENTITY),  # [hd] (qwen3)
        Rule(prefix + "self_attn.k_norm.weight", t + "attn.k_norm", IDENTITY),
        Rule(prefix + "self_attn.q_proj.bias", t + "attn.q_bias", HEADS_BIAS),  # [qh*hd] -> [qh, hd]
        Rule(prefix + "self_attn.k_proj.bias", t + "attn.k_bias", HEADS_BIAS),
        Rule(prefix + "self_attn.v_proj.bias", t + "attn.v_bias", HEADS_BIAS),
        Rule(prefix + "self_attn.o_proj.bias", t + "attn.o_bias", IDENTITY),  # [e]
        Rule(prefix + "mlp.gate_proj.weight", t + "mlp.gate", TRANSPOSE),  # [mlp, e] -> [e, mlp]
        Rule(prefix + "mlp.up_proj.weight", t + "mlp.up", TRANSPOSE),
        Rule(prefix + "mlp.down_proj.weight", t + "mlp.down", TRANSPOSE),  # [e, mlp] -> [mlp, e]
    ]


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class MappingTable:
    """Looks up source names in a table of `Rule`s, and maps our paths back to source names."""

    def __init__(self, rules: Iterable[Rule]):
        self.rules = tuple(rules)
        self._by_source = {r.source: r for r in self.rules}
        self._by_target = {r.target: r for r in self.rules}
        if len(self._by_source) != len(self.rules) or len(self._by_target) != len(self.rules):
            raise ValueError("mapping table has a repeated source or target")  # programming error

    def lookup(self, name: str) -> tuple[Rule, str] | None:
        """source tensor name -> (rule, our dotted path), or None when no rule matches."""
        template, layer = _template(name)
        rule = self._by_source.get(template) or self._by_source.get(name)
        if rule is None:
            return None
        return rule, (rule.target.replace("{i}", layer) if rule.source == template else rule.target)

    def source_name(self, path: str) -> str:
        """Our dotted path -> the source tensor name that provides it (for 'missing' errors)."""
        template, layer = _template(path)
        rule = self._by_target.get(template)
        if rule is not None:
            return rule.source.replace("{i}", layer)
        rule = self._by_target.get(path)
        return rule.source if rule is not None else path


def _template(name: str) -> tuple[str, str]:
    """'model.layers.3.mlp.up_proj.weight' -> ('model.layers.{i}.mlp.up_proj.weight', '3').

    Only the first `.<digits>.` is replaced: that is the layer index in both formats.
    """
    match = _LAYER_INDEX.search(name)
    if match is None:
        return name, ""
    return name[:match.start()] + ".{i}." + name[match.end():], match.group(1)


# ----------------------------------------------------------------------------- assembling

class Assembler:
    """Fills a `ParamLayout`'s decoding tensors from checkpoint tensors given one at a time.

    Call `claim` with the source shape before reading a tensor (cheap checks against the
    layout's sources), then `put` with its host array: it is cast, laid out (`Rule.layout`) and
    written into its slices of the decoding tensors, each placed on `sharding(path, spec)` (None:
    the default device) once its last part is in. `finish` builds the tree and reports missing
    tensors by their checkpoint names.
    """

    def __init__(self, layout: ParamLayout, table: MappingTable, dtype: Any,
                 sharding: Callable[[str, Spec], Any] | None = None):
        self.table = table
        self.dtype = np.dtype(dtype)
        self._spec = layout.source_specs
        self._builder = Builder(layout, self.dtype, sharding)
        self._origin: dict[str, str] = {}

    def claim(self, path: str, rule: Rule, source_shape: tuple[int, ...], origin: str) -> Spec:
        """Checks a source tensor before it is read; returns our Spec for it.

        origin: "file: tensor" for messages.
        """
        spec = self._spec.get(path)
        if spec is None:
            # The name is in the table but this config declares no such weight, e.g. q_norm in a
            # llama checkpoint or a bias when attention_bias is false.
            raise ConversionError(f"{origin}: unexpected tensor (it would fill {path}, which this "
                                  f"model config does not have)")
        if path in self._origin:
            raise ConversionError(f"{origin}: duplicate tensor; {path} was already loaded from "
                                  f"{self._origin[path]}")
        expected = tuple(rule.layout.source_shape(spec.shape))
        if tuple(source_shape) != expected:
            raise ConversionError(f"{origin}: tensor has shape {tuple(source_shape)}, expected "
                                  f"{expected} (for {path} {spec.shape})")
        self._origin[path] = origin
        return spec

    def put(self, path: str, rule: Rule, x: np.ndarray) -> None:
        """Converts one claimed source-layout host array into its slices of the decoding tensors."""
        # The layout is a view (transpose, reshape); the builder's one copy casts it, so nothing
        # aliases a memory-mapped file after this returns.
        self._builder.put(path, rule.layout.apply(x, self._spec[path].shape))

    def finish(self, source: str) -> Any:
        """Builds the param tree; raises naming the first missing source tensor."""
        missing = self._builder.missing()
        if missing:
            raise ConversionError(f"{source}: missing tensor {self.table.source_name(missing[0])!r} "
                                  f"(needed for {missing[0]})")
        return self._builder.finish()
