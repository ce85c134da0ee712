"""The DFlash block-diffusion drafter as pure functions.

The drafter is a small stack of Qwen3 decoder layers that proposes a whole block in one pass.
Its queries are the block `[root, MASK, ..., MASK]` (embedded with the TARGET's embedding);
its keys/values are the block's own plus a *context*: the target's hidden states at tapped
layers for every committed position, fused by `fc` + `hidden_norm`. The same fused context
feeds every drafter layer (it is not transformed layer by layer), so each layer's context
K/V can be computed once per committed position and cached (`DraftCache`); only the block is
recomputed each round. Output rows 1..bs-1 go through the TARGET's LM head.

Semantics follow z-lab's `dflash==0.1.0` (`dflash.model.DFlashDraftModel`):
  * full-attention layers are bidirectional over context + block (causal if `is_causal`);
  * sliding-attention layers are causal with a window (bidirectional window if
    `is_causal` is explicitly false), measured on absolute positions.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dflash_jax.config import (ConfigError, ModelConfig, RopeConfig, bool_field, default_tap_layers, float_field,
                               int_field, load_json, rope_from_hf)
from dflash_jax.kv_cache import KVCache, write_rows
from dflash_jax.model import (AttentionParams, LayerParams, MLPParams, ModelParams, attend_fused, attention_specs,
                              can_fuse, embed_tokens, epilogue_schedule, gate_up_spec, kv_product, logits_from_hidden,
                              mlp, mlp_specs, output_projection, project_kv, project_qkv, qkv_spec, rms_norm)
from dflash_jax.params import EMBED, HEAD_DIM, KV_HEADS, ParamLayout, Part, Spec, init_layout, slot
from dflash_jax.qwen3_5 import Qwen35Config
from dflash_jax.rope import apply_rope, rope_tables
from dflash_jax.sharding import attention as sharded_attention
from dflash_jax.sharding import check_model, mesh_sizes, specs_shardings
from pallas_kernels.qkv_epilogue import applies_kv as kv_epilogue_applies
from pallas_kernels.qkv_epilogue import kv_epilogue

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Logical axis of fc's input (the concatenated tap features); unsharded by the default rules.
TAPS_EMBED = "taps_embed"

# Keys the reference reads with `dflash_config` taking precedence over the top level.
_DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale",
                "output_multiplier", "final_logit_softcapping")


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash drafter (z-lab `DFlashDraftModel`, a Qwen3Config with extras). Hashable: jit-static."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # one per layer; () = all full attention
    sliding_window: int | None = None
    is_causal: bool | None = None  # overrides the per-layer-type default when set
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "num_target_layers", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_layers} layers (num_hidden_layers)")
            bad = sorted({t for t in self.layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
            if bad:
                raise ConfigError(f"layer_types {bad} not supported; expected "
                                  f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    def layer_causal(self, i: int) -> bool:
        """As `Qwen3DFlashAttention`: sliding layers causal, full layers bidirectional, unless is_causal."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_type(i) == SLIDING_ATTENTION

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None = unlimited)."""
        return self.sliding_window if self.layer_type(i) == SLIDING_ATTENTION else None

    def layer_config(self) -> ModelConfig:
        """A ModelConfig view of one drafter layer (a Qwen3 layer: q/k norms), for model.py's blocks."""
        return ModelConfig(
            model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope=self.rope,
            max_position_embeddings=self.max_position_embeddings, qk_norm=True,
            attention_bias=self.attention_bias)


def draft_config_from_dict(cfg: Mapping[str, Any], source: str = "config.json") -> DraftConfig:
    """Builds a DraftConfig from a parsed drafter `config.json`; `source` names the file in errors.

    Defaults follow Qwen3Config, which is what the reference loads drafter configs with.
    """
    archs = cfg.get("architectures") or ()
    unsupported = [a for a in archs if a != "DFlashDraftModel"]
    if unsupported:
        raise ConfigError(f"{source}: architectures {unsupported} not supported "
                          "(only DFlashDraftModel; DFlash2's convolutions are not implemented)")
    extras = cfg.get("dflash_config") or {}
    if not isinstance(extras, Mapping):
        raise ConfigError(f"{source}: field 'dflash_config' must be an object, got {extras!r}")
    merged = {**cfg, **{k: extras[k] for k in _DFLASH_KEYS if k in extras}}

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: hidden_act {hidden_act!r} not supported (expected 'silu')")
    num_layers = int_field(cfg, "num_hidden_layers", source)
    max_positions = int_field(cfg, "max_position_embeddings", source, 32768)  # before RoPE, which reads it
    num_target_layers = int_field(cfg, "num_target_layers", source)
    heads = int_field(cfg, "num_attention_heads", source)
    if merged.get("target_layer_ids") is not None:
        ids = merged["target_layer_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ConfigError(f"{source}: field 'target_layer_ids' must be a list of layer ids, got {ids!r}")
        taps = tuple(int_field({"target_layer_ids": t}, "target_layer_ids", source, minimum=0) for t in ids)
    else:
        # The reference spreads one tap per DRAFT layer when none are given.
        taps = default_tap_layers(num_target_layers, num_layers)
    # Qwen3Config drops the window unless use_sliding_window, and derives layer_types from it.
    window = (int_field(cfg, "sliding_window", source) if bool_field(cfg, "use_sliding_window", source, False)
              and cfg.get("sliding_window") is not None else None)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        max_window_layers = int_field(cfg, "max_window_layers", source, 28, minimum=0)
        layer_types = [SLIDING_ATTENTION if window is not None and i >= max_window_layers
                       else FULL_ATTENTION for i in range(num_layers)]
    elif not isinstance(layer_types, (list, tuple)):
        raise ConfigError(f"{source}: field 'layer_types' must be a list, got {layer_types!r}")
    softcap = merged.get("final_logit_softcapping")
    is_causal = cfg.get("is_causal")
    fields = dict(
        hidden_size=int_field(cfg, "hidden_size", source),
        intermediate_size=int_field(cfg, "intermediate_size", source),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int_field(cfg, "num_key_value_heads", source, heads),
        head_dim=int_field(cfg, "head_dim", source, 128),  # Qwen3Config's default, not hidden // heads
        vocab_size=int_field(cfg, "vocab_size", source),
        mask_token_id=int_field(merged, "mask_token_id", f"{source} (dflash_config or top level)", minimum=0),
        target_layer_ids=taps,
        num_target_layers=num_target_layers,
        block_size=int_field(merged, "block_size", source, 16),
        rms_norm_eps=float_field(cfg, "rms_norm_eps", source, 1e-6),
        rope=rope_from_hf(cfg, source),
        max_position_embeddings=max_positions,
        attention_bias=bool_field(cfg, "attention_bias", source, False),
        layer_types=tuple(layer_types),
        sliding_window=window,
        is_causal=None if is_causal is None else bool_field(cfg, "is_causal", source, False),
        input_embedding_scale=float_field(merged, "input_embedding_scale", source, 1.0),
        output_multiplier=float_field(merged, "output_multiplier", source, 1.0),
        final_logit_softcapping=None if softcap is None else float_field(merged, "final_logit_softcapping", source),
    )
    try:
        return DraftConfig(**fields)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_draft_config(path: str | Path) -> DraftConfig:
    """Reads a drafter's `config.json` (or a directory holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return draft_config_from_dict(load_json(file), source=str(file))


def draft_config_to_dict(dcfg: DraftConfig, dtype: str = "float32") -> dict[str, Any]:
    """The z-lab `config.json` for `dcfg`, in both schemas z-lab's drafters use: block_size,
    mask_token_id and target_layer_ids at the top level and again in `dflash_config` (dflash
    0.1.0's PyTorch model reads `dflash_config` first, its MLX loader and DDTree-style loaders
    read some at the top level). Loadable by `DFlashDraftModel.from_pretrained` and by
    `draft_config_from_dict`."""
    extras: dict[str, Any] = {"block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
                              "target_layer_ids": list(dcfg.target_layer_ids)}
    if dcfg.input_embedding_scale != 1.0:
        extras["input_embedding_scale"] = dcfg.input_embedding_scale
    if dcfg.output_multiplier != 1.0:
        extras["output_multiplier"] = dcfg.output_multiplier
    if dcfg.final_logit_softcapping is not None:
        extras["final_logit_softcapping"] = dcfg.final_logit_softcapping
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": dcfg.num_layers,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "head_dim": dcfg.head_dim,
        "vocab_size": dcfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": dcfg.rms_norm_eps,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "attention_bias": dcfg.attention_bias,
        "tie_word_embeddings": False,
        "rope_parameters": rope_to_hf(dcfg.rope),
        "layer_types": [dcfg.layer_type(i) for i in range(dcfg.num_layers)],
        "use_sliding_window": dcfg.sliding_window is not None,
        "sliding_window": dcfg.sliding_window,
        "num_target_layers": dcfg.num_target_layers,
        "block_size": dcfg.block_size,
        "mask_token_id": dcfg.mask_token_id,
        "target_layer_ids": list(dcfg.target_layer_ids),
        "dflash_config": extras,
        "dtype": dtype,
    }
    if dcfg.is_causal is not None:
        out["is_causal"] = dcfg.is_causal
    return out


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """Inverse of `rope_from_hf`: the transformers-5 `rope_parameters` dict."""
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type in ("linear", "llama3", "yarn"):
        out["factor"] = rope.factor
    if rope.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    if rope.rope_type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.rope_type == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, key) is not None:
                out[key] = getattr(rope, key)
    return out


def validate_pair(dcfg: DraftConfig, target_cfg: ModelConfig | Qwen35Config) -> None:
    """Raises ValueError (naming the values) when a drafter cannot serve this target, dense or
    hybrid (the fields read here mean the same in both configs; a tap may be any layer's output)."""
    if dcfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"drafter hidden_size {dcfg.hidden_size} != target hidden_size "
                         f"{target_cfg.hidden_size}: the drafter consumes the target's embeddings")
    if dcfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"drafter vocab_size {dcfg.vocab_size} != target vocab_size "
                         f"{target_cfg.vocab_size}")
    if not 0 <= dcfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(f"drafter mask_token_id {dcfg.mask_token_id} is outside the target "
                         f"vocabulary [0, {target_cfg.vocab_size})")
    bad = [t for t in dcfg.target_layer_ids if not 0 <= t < target_cfg.num_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {list(dcfg.target_layer_ids)} include {bad}, "
                         f"outside the target's {target_cfg.num_layers} layers")


# ----------------------------------------------------------------------------- parameters

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftParams:
    fc: Any  # [taps * embed, embed]
    hidden_norm: Any  # [embed]
    layers: tuple  # tuple[LayerParams, ...]
    final_norm: Any  # [embed]
    # The block-qkv layout's context keys and values for every layer as one weight
    # [embed, layers, kv_heads, 2, head_dim] (bias [layers, kv_heads, 2, head_dim]): the fused
    # context is the same input to every layer's k/v projection, so one product serves them all.
    context_kv: Any = None
    context_kv_bias: Any = None


def draft_checkpoint_specs(dcfg: DraftConfig) -> DraftParams:
    """The drafter's weights as z-lab checkpoints store them (no embedding / LM head: the
    target's are used): the loader's sources, and the layout training optimises and
    `convert.dflash_drafter.export_drafter` writes."""
    e, lcfg = dcfg.hidden_size, dcfg.layer_config()
    layer = lambda: LayerParams(  # noqa: E731
        attn_norm=Spec((e,), (EMBED,), init="ones"), attn=attention_specs(lcfg),
        mlp_norm=Spec((e,), (EMBED,), init="ones"), mlp=mlp_specs(lcfg))
    return DraftParams(
        fc=Spec((dcfg.num_taps * e, e), (TAPS_EMBED, EMBED), fan_in=dcfg.num_taps * e),
        hidden_norm=Spec((e,), (EMBED,), init="ones"),
        layers=tuple(layer() for _ in range(dcfg.num_layers)),
        final_norm=Spec((e,), (EMBED,), init="ones"),
    )


def draft_specs(dcfg: DraftConfig, tp: int = 1) -> DraftParams:
    """The drafter's decoding layout at tensor parallelism `tp`; gate/up as one `gate_up`.

    Where `model.can_fuse` (kv heads split over tp): each layer's q, k and v as one `qkv`, the
    target's layout, for the block pass, and every layer's k and v stacked into one
    `context_kv` [embed, layers, kv_heads, 2, head_dim] for the context pass (the fused
    context is the same input to every layer's k/v projection, so one product serves them
    all). Its full-attention layers then run the block pass as the target's verify does
    (`draft_with_cache`): on an H200 the draft's kernels took 0.944 against 0.972 ms a
    DDTree(256) round. k and v are held twice: 2 x embed x kv_heads x head_dim more a layer
    (16 MB in bf16 at Qwen3-8B's shape).
    Elsewhere (kv heads replicated over tp, where q is split and k, v are not): q apart, and k
    and v as one `kv` [embed, kv_heads, 2, head_dim] a layer, which the block and the context
    pass share.
    """
    sources = draft_checkpoint_specs(dcfg)
    lcfg = dcfg.layer_config()
    e, n, kvh, hd = dcfg.hidden_size, dcfg.num_layers, lcfg.num_kv_heads, lcfg.head_dim
    block_qkv = can_fuse(lcfg, tp)
    bias = lcfg.attention_bias
    layers = []
    for i, sep in enumerate(sources.layers):
        a, prefix = sep.attn, f"layers.{i}.attn."
        if block_qkv:
            qkv, qkv_bias = qkv_spec(lcfg, prefix)
            attn = AttentionParams(o=a.o, q_norm=a.q_norm, k_norm=a.k_norm, o_bias=a.o_bias, qkv=qkv, qkv_bias=qkv_bias)
        else:
            kv = Spec((e, kvh, 2, hd), (EMBED, KV_HEADS, None, HEAD_DIM),
                      parts=(Part(prefix + "k", slot(4, {2: 0})), Part(prefix + "v", slot(4, {2: 1}))))
            kv_bias = Spec((kvh, 2, hd), (KV_HEADS, None, HEAD_DIM),
                           parts=(Part(prefix + "k_bias", slot(3, {1: 0})), Part(prefix + "v_bias", slot(3, {1: 1})))
                           ) if bias else None
            attn = dataclasses.replace(a, k=None, v=None, k_bias=None, v_bias=None, kv=kv, kv_bias=kv_bias)
        mlp_ = MLPParams(gate_up=gate_up_spec(lcfg, f"layers.{i}.mlp."), down=sep.mlp.down)
        layers.append(dataclasses.replace(sep, attn=attn, mlp=mlp_))
    context = {}
    if block_qkv:
        context["context_kv"] = Spec(
            (e, n, kvh, 2, hd), (EMBED, None, KV_HEADS, None, HEAD_DIM),
            parts=tuple(Part(f"layers.{i}.attn.{w}", slot(5, {1: i, 3: j}))
                        for i in range(n) for j, w in enumerate("kv")))
        if bias:
            context["context_kv_bias"] = Spec(
                (n, kvh, 2, hd), (None, KV_HEADS, None, HEAD_DIM),
                parts=tuple(Part(f"layers.{i}.attn.{w}_bias", slot(4, {0: i, 2: j}))
                            for i in range(n) for j, w in enumerate("kv")))
    return dataclasses.replace(sources, layers=tuple(layers), **context)


def draft_param_layout(dcfg: DraftConfig, tp: int = 1, *, training: bool = False) -> ParamLayout:
    """`draft_specs(dcfg, tp)` over `draft_checkpoint_specs(dcfg)`: what `load_drafter` fills.

    training: the checkpoint layout itself (each weight once: the block-qkv layout holds k and
    v twice, and two copies would drift apart under an optimiser).
    """
    sources = draft_checkpoint_specs(dcfg)
    return ParamLayout(sources if training else draft_specs(dcfg, tp), sources)


def init_draft_params(dcfg: DraftConfig, key: jax.Array, dtype: Any = jnp.float32, *, mesh: Any = None,
                      training: bool = False) -> DraftParams:
    """Random drafter weights (tests, benchmarks, training from scratch) in the decoding layout,
    or with `training` the checkpoint layout; the same key gives the same weights in both.
    mesh: a ("dp", "tp") mesh to draw them straight into their shards."""
    tp = mesh_sizes(mesh)[1] if mesh is not None else 1
    if mesh is not None:
        check_model(dcfg, tp)
    layout = draft_param_layout(dcfg, tp, training=training)
    return init_layout(layout, key, dtype, None if mesh is None else specs_shardings(layout.specs, mesh))


def is_draft_fused(dparams: DraftParams) -> bool:
    """Whether the drafter holds fused k/v weights (each layer's `kv`, or the stacked `context_kv`)."""
    return bool(dparams.layers) and (dparams.layers[0].attn.kv is not None or dparams.context_kv is not None)



# ----------------------------------------------------------------------------- context cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCache(KVCache):
    """Per drafter layer, the context K/V of the committed prefix (a KVCache over drafter layers).

    k, v: tuple over drafter layers of [batch, max_len, kv_heads, head_dim]; keys after
      k_norm and RoPE. Slot j holds absolute position j (sliding windows are measured on it).
    lengths: [batch] int32, context rows per sequence; slots >= lengths are scratch.

    `draft` needs `block_size` scratch slots: lengths + block_size <= max_len.
    """

    @classmethod
    def create(cls, dcfg: DraftConfig, batch: int, max_len: int, dtype: Any = jnp.float32
               ) -> "DraftCache":
        base = KVCache.create(dcfg.num_layers, batch, max_len, dcfg.num_kv_heads, dcfg.head_dim, dtype)
        return cls(k=base.k, v=base.v, lengths=base.lengths)


def _linear(x: jax.Array, w: jax.Array, eq: str) -> jax.Array:
    """einsum with float32 accumulation, result in x's dtype."""
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def fuse_context(dparams: DraftParams, dcfg: DraftConfig, taps: jax.Array) -> jax.Array:
    """taps [batch, n, taps * embed] -> the fused context [batch, n, embed] (fc, then hidden_norm)."""
    return rms_norm(_linear(taps, dparams.fc, "bnt,te->bne"), dparams.hidden_norm, dcfg.rms_norm_eps)


def context_kv(dparams: DraftParams, dcfg: DraftConfig, taps: jax.Array, positions: jax.Array
               ) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per layer K/V of context rows: (k, v) lists of [batch, n, kv_heads, head_dim].

    The fused context enters every layer's k/v projection directly, without the layer's
    input norm (as the reference does).
    """
    return _context_kv_of(dparams, dcfg, fuse_context(dparams, dcfg, taps), positions)


def stacked_context_kv(dparams: DraftParams, ctx: jax.Array) -> jax.Array:
    """The fused context ctx [batch, n, embed] through the block-qkv layout's `context_kv`
    (bias added): every layer's keys and values, [batch, n, layers, kv_heads, 2, head_dim]."""
    kv = _linear(ctx, dparams.context_kv, "bne,elkgd->bnlkgd")
    return kv if dparams.context_kv_bias is None else kv + dparams.context_kv_bias.astype(kv.dtype)


def _context_kv_of(dparams: DraftParams, dcfg: DraftConfig, ctx: jax.Array, positions: jax.Array
                   ) -> tuple[list[jax.Array], list[jax.Array]]:
    """`context_kv` from the fused context ctx [batch, n, embed]."""
    cos, sin = rope_tables(positions, dcfg.rope, dcfg.head_dim)
    stacked = None if dparams.context_kv is None else stacked_context_kv(dparams, ctx)
    ks, vs = [], []
    for i, lp in enumerate(dparams.layers):
        p = lp.attn
        if stacked is None:
            k, v = project_kv(p, ctx)
        else:
            k, v = stacked[:, :, i, :, 0], stacked[:, :, i, :, 1]
        k = rms_norm(k, p.k_norm, dcfg.rms_norm_eps)
        ks.append(apply_rope(k, cos, sin))
        vs.append(v)
    return ks, vs


CONTEXT_EPILOGUES = ("auto", "xla", "kernel", "interpret")


def context_epilogue_applies(dparams: DraftParams, cache: DraftCache, dtype: Any, backend: str | None = None
                             ) -> bool:
    """Whether `append_context` can write the context rows through `qkv_epilogue.kv_epilogue`:
    fused k/v weights with a k norm (`_kv_epilogue_weights`), no mesh (under one the caches are sharded), a cache in
    the activation dtype, and a head size the Triton kernel takes; on a GPU (`backend`, default
    `jax.default_backend()`) for "auto"."""
    if not _kv_epilogue_weights(dparams) or (backend or jax.default_backend()) != "gpu":
        return False
    return (mesh_sizes() == (1, 1) and cache.k[0].dtype == jnp.dtype(dtype)
            and kv_epilogue_applies(cache.k[0].shape[-1]))


def _kv_epilogue_weights(dparams: DraftParams) -> bool:
    """Whether the drafter's weights suit `kv_epilogue`: fused k/v (each layer's `kv`, or the
    stacked `context_kv`) and a k norm (the kernel rounds the norm as `rms_norm` does; without
    one XLA's path stays)."""
    return is_draft_fused(dparams) and dparams.layers[0].attn.k_norm is not None


def append_context(dparams: DraftParams, dcfg: DraftConfig, cache: DraftCache, taps: jax.Array,
                   positions: jax.Array, counts: jax.Array, epilogue: str = "auto") -> DraftCache:
    """Appends n context rows per sequence; only the first counts[b] of them are committed.

    taps: [batch, n, taps * embed] target features (tap layer outputs, concatenated).
    positions: [batch, n] int32 absolute positions (normally lengths + arange(n)).
    counts: [batch] int32 in [0, n]. Rows are written at slots lengths .. lengths+n-1 (the
    caller guarantees lengths + n <= max_len); rows past counts are scratch that later
    appends overwrite.
    epilogue: "auto": where `context_epilogue_applies`, each layer's `kv` product goes through
    one `kv_epilogue` launch (k norm, RoPE, both cache writes; XLA ran about six kernels a layer
    for them); "xla": `context_kv` and row writes; "kernel" / "interpret": the launch wherever
    the weights allow it (interpret: in Pallas' interpreter, for tests). Same values.
    In the block-qkv layout one product (`stacked_context_kv`) makes every layer's rows, and
    each layer's launch reads its own layer of it.
    """
    if taps.shape[-1] != dcfg.num_taps * dcfg.hidden_size:
        raise ValueError(f"taps last axis is {taps.shape[-1]}, expected {dcfg.num_taps} taps x "
                         f"hidden {dcfg.hidden_size} = {dcfg.num_taps * dcfg.hidden_size}")
    if taps.shape[1] > cache.max_len:
        raise ValueError(f"{taps.shape[1]} context rows do not fit a cache of max_len {cache.max_len}")
    if epilogue not in CONTEXT_EPILOGUES:
        raise ValueError(f"epilogue must be one of {CONTEXT_EPILOGUES}, got {epilogue!r}")
    lengths = cache.lengths + counts.astype(cache.lengths.dtype)
    ctx = fuse_context(dparams, dcfg, taps)
    forced = epilogue in ("kernel", "interpret") and _kv_epilogue_weights(dparams)
    if forced or (epilogue == "auto" and context_epilogue_applies(dparams, cache, ctx.dtype)):
        cos, sin = rope_tables(positions, dcfg.rope, dcfg.head_dim)
        stacked = None if dparams.context_kv is None else stacked_context_kv(dparams, ctx)
        ks, vs = [], []
        for i, (lp, k_buf, v_buf) in enumerate(zip(dparams.layers, cache.k, cache.v)):
            kv, layer = (kv_product(lp.attn, ctx), None) if stacked is None else (stacked, i)
            k_buf, v_buf = kv_epilogue(kv, lp.attn.k_norm, cos, sin, k_buf, v_buf, cache.lengths,
                                       eps=dcfg.rms_norm_eps, layer=layer, interpret=epilogue == "interpret")
            ks.append(k_buf)
            vs.append(v_buf)
        return DraftCache(k=tuple(ks), v=tuple(vs), lengths=lengths)
    ks, vs = _context_kv_of(dparams, dcfg, ctx, positions)
    return DraftCache(k=tuple(write_rows(buf, k, cache.lengths) for buf, k in zip(cache.k, ks)),
                      v=tuple(write_rows(buf, v, cache.lengths) for buf, v in zip(cache.v, vs)),
                      lengths=lengths)


# ----------------------------------------------------------------------------- the draft pass

def make_block(dcfg: DraftConfig, roots: jax.Array) -> jax.Array:
    """roots [batch] -> block tokens [batch, block_size] = [root, MASK, ..., MASK]."""
    masks = jnp.full((roots.shape[0], dcfg.block_size - 1), dcfg.mask_token_id, roots.dtype)
    return jnp.concatenate([roots[:, None], masks], axis=1)


def block_visibility(batch: int, width: int, causal: bool, block_len: jax.Array | None) -> jax.Array:
    """[batch, width, width] bool: block query t sees block key s.

    Keys at s >= block_len do not exist in the reference's shortened final block.
    """
    s = jnp.arange(width)
    vis = s[None, :] <= s[:, None] if causal else jnp.ones((width, width), bool)
    vis = jnp.broadcast_to(vis, (batch, width, width))
    if block_len is not None:
        vis = vis & (s[None, None, :] < block_len[:, None, None])
    return vis


def window_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Masked attention with a float32 softmax (the drafter's sliding layers; few keys).

    q: [batch, width, q_heads, head_dim]; k, v: [batch, keys, kv_heads, head_dim];
    visible: [batch, width, keys] bool. Returns [batch, width, q_heads, head_dim] in q's
    dtype; a row that sees no key is 0.
    """
    batch, width, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    qg = q.astype(jnp.float32).reshape(batch, width, kv_heads, q_heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bjkd->bkgtj", qg, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * head_dim ** -0.5
    seen = visible[:, None, None, :, :]
    scores = jnp.where(seen, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(seen, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    # Masked value rows may be stale scratch (even NaN): zero them so 0 * v stays 0.
    v32 = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgtj,bjkd->btkgd", weights, v32, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, width, q_heads, head_dim).astype(q.dtype)


def _sliding_layer_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_ctx: jax.Array,
                             v_ctx: jax.Array, lengths: jax.Array, positions: jax.Array,
                             block_vis: jax.Array, window: int, causal: bool) -> jax.Array:
    """A sliding layer: the block attends to the last window-1 context slots and to itself.

    q, k, v: the block's [batch, bs, heads, head_dim] (after norm and RoPE);
    k_ctx, v_ctx: the layer's context cache [batch, max_len, kv_heads, head_dim];
    positions: [batch, bs] absolute positions of the block; block_vis: [batch, bs, bs].
    Only slots within window-1 of the block's start can be visible, so only those are read.
    """
    max_len = k_ctx.shape[1]
    n_ctx = min(window - 1, max_len)
    start = jnp.clip(lengths - n_ctx, 0, max_len - n_ctx)
    take = jax.vmap(lambda buf, s: jax.lax.dynamic_slice_in_dim(buf, s, n_ctx, axis=0))
    slots = start[:, None] + jnp.arange(n_ctx)  # [batch, n_ctx]; slot == absolute position
    keys_k = jnp.concatenate([take(k_ctx, start), k.astype(k_ctx.dtype)], axis=1)
    keys_v = jnp.concatenate([take(v_ctx, start), v.astype(v_ctx.dtype)], axis=1)
    q_pos = positions[:, :, None]
    ctx_vis = (slots[:, None, :] < lengths[:, None, None]) & (q_pos - slots[:, None, :] < window)
    if causal:
        ctx_vis = ctx_vis & (slots[:, None, :] <= q_pos)
    else:
        ctx_vis = ctx_vis & (slots[:, None, :] - q_pos < window)
    k_pos = positions[:, None, :]
    blk_vis = block_vis & (q_pos - k_pos < window) & (k_pos - q_pos < window)
    visible = jnp.concatenate([jnp.broadcast_to(ctx_vis, (q.shape[0], q.shape[1], n_ctx)), blk_vis],
                              axis=2)
    return window_attention(q, keys_k, keys_v, visible)


def draft(dparams: DraftParams, dcfg: DraftConfig, target_params: ModelParams, cache: DraftCache,
          block_tokens: jax.Array, block_start: jax.Array, block_len: jax.Array | None = None, *,
          attn_impl: str = "auto") -> jax.Array:
    """One drafter pass over the block; returns final-normed hidden [batch, bs, embed].

    block_tokens: [batch, bs] int32, normally `make_block(dcfg, roots)`.
    block_start: [batch] int32 absolute position of the root (normally cache.lengths).
    block_len: optional [batch] int32 in [1, bs]; block keys >= block_len are masked, which
      equals running the reference on the shorter block (rows >= block_len are junk).
    Needs cache.lengths + bs <= cache.max_len: full layers write the block's K/V at the scratch
    slots lengths .. lengths+bs-1 (`draft_with_cache` hands that cache back).
    """
    return draft_with_cache(dparams, dcfg, target_params, cache, block_tokens, block_start, block_len,
                            attn_impl=attn_impl)[0]


def draft_with_cache(dparams: DraftParams, dcfg: DraftConfig, target_params: ModelParams, cache: DraftCache,
                     block_tokens: jax.Array, block_start: jax.Array, block_len: jax.Array | None = None, *,
                     attn_impl: str = "auto") -> tuple[jax.Array, DraftCache]:
    """`draft`, also returning the cache with the block's K/V in the scratch slots of its full
    layers (lengths unchanged, so it holds the same context).

    A decoder that goes on with this cache (the next `append_context` overwrites those slots)
    lets XLA write the block in place; one that keeps the old cache makes XLA copy every full
    layer's buffers first (10 copies of 10 MB a round for a 5-layer drafter at 5K slots).
    In the block-qkv layout (`draft_specs`), where the target's
    verify would take its fused path for this block (`model.epilogue_schedule`: the Hopper
    kernel on bs x group rows, no mesh, the cache in the activation dtype), the full layers take
    it too (`model.attend_fused`): one qkv product where there were two, and one kernel for the
    norms, RoPE, cache writes and q's row layout where XLA ran about eight; same values. Sliding
    layers, and every layer of the other layouts, keep the path of `layer_forward`.
    """
    batch, bs = block_tokens.shape
    if bs > cache.max_len:
        raise ValueError(f"block of {bs} tokens does not fit a draft cache of max_len {cache.max_len}")
    x = embed_block(target_params, dcfg, block_tokens)
    positions = block_start[:, None].astype(jnp.int32) + jnp.arange(bs, dtype=jnp.int32)
    cos, sin = rope_tables(positions, dcfg.rope, dcfg.head_dim)
    lengths = cache.lengths
    vis_cache: dict[bool, jax.Array] = {}
    k_out, v_out = list(cache.k), list(cache.v)
    lcfg = dcfg.layer_config()
    # DraftParams has the `layers` whose attn.qkv the schedule asks for (the block-qkv layout).
    sched = epilogue_schedule(dparams, lcfg, batch, bs, cache, x.dtype, attn_impl)

    def visibility(causal: bool) -> jax.Array:
        if causal not in vis_cache:
            vis_cache[causal] = block_visibility(batch, bs, causal, block_len)
        return vis_cache[causal]

    for i, lp in enumerate(dparams.layers):
        causal, window = dcfg.layer_causal(i), dcfg.layer_window(i)
        if sched is not None and window is None:
            h = rms_norm(x, lp.attn_norm, dcfg.rms_norm_eps)
            attn, k_out[i], v_out[i] = attend_fused(lp.attn, lcfg, h, cos, sin, cache.k[i], cache.v[i], lengths,
                                                    visibility(causal), sched)
            x = _after_attention(lp, dcfg, x, attn)
            continue

        def attend(q, k, v, i=i, causal=causal, window=window):
            if window is None:
                k_out[i] = write_rows(cache.k[i], k, lengths)
                v_out[i] = write_rows(cache.v[i], v, lengths)
                # shard_map over (dp, tp) under a mesh (dflash_jax.sharding).
                return sharded_attention(q, k_out[i], v_out[i], lengths, visibility(causal), impl=attn_impl)
            return _sliding_layer_attention(q, k, v, cache.k[i], cache.v[i], lengths, positions,
                                            visibility(causal), window, causal)

        x = layer_forward(lp, dcfg, x, cos, sin, attend)
    hidden = rms_norm(x, dparams.final_norm, dcfg.rms_norm_eps)
    return hidden, DraftCache(k=tuple(k_out), v=tuple(v_out), lengths=cache.lengths)


def embed_block(target_params: ModelParams, dcfg: DraftConfig, block_tokens: jax.Array) -> jax.Array:
    """Block tokens [..., n] -> the drafter's input rows [..., n, embed] (target embedding x scale)."""
    x = embed_tokens(target_params, block_tokens)
    if dcfg.input_embedding_scale != 1.0:
        x = x * jnp.asarray(dcfg.input_embedding_scale, x.dtype)
    return x


def layer_forward(lp: LayerParams, dcfg: DraftConfig, x: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Any) -> jax.Array:
    """One drafter layer over block rows x [batch, rows, embed] (cos/sin: the rows' RoPE tables).

    `attend(q, k, v)` gets the rows' queries and keys (after q/k norm and RoPE) and values and
    returns [batch, rows, q_heads, head_dim]; it supplies the context K/V and the mask. Shared
    by inference (`draft`) and training (`dflash_jax.train`), so both run the same layer math.
    """
    h = rms_norm(x, lp.attn_norm, dcfg.rms_norm_eps)
    q, k, v = project_qkv(lp.attn, dcfg.layer_config(), h)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return _after_attention(lp, dcfg, x, attend(q, k, v))


def _after_attention(lp: LayerParams, dcfg: DraftConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
    """x + o_proj(attn), then + MLP: the rest of a layer. x: [batch, rows, embed], attn:
    [batch, rows, q_heads, head_dim]."""
    x = x + output_projection(lp.attn, attn)
    return x + mlp(lp.mlp, rms_norm(x, lp.mlp_norm, dcfg.rms_norm_eps))


def draft_logits(dparams: DraftParams, dcfg: DraftConfig, target_params: ModelParams,
                 hidden: jax.Array) -> jax.Array:
    """hidden [batch, bs, embed] -> float32 logits [batch, bs-1, vocab] for depths 1..bs-1.

    Row 0 (the root) predicts nothing; the target's LM head, x output_multiplier, then an
    optional tanh softcap, as the reference's `compute_logits`.
    """
    del dparams  # the drafter has no head of its own; kept for a uniform signature
    logits = logits_from_hidden(target_params, hidden[:, 1:])
    if dcfg.output_multiplier != 1.0:
        logits = logits * dcfg.output_multiplier
    cap = dcfg.final_logit_softcapping
    if cap is not None and cap > 0:
        logits = jnp.tanh(logits / cap) * cap
    return logits
