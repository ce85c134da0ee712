"""The Qwen3.5 / Qwen3.6 hybrid target (`model_type` qwen3_5): config, weights, cache, forward, AR decoding,
and the verify / commit of speculative rounds.

The decoder mixes two token mixers, following the config's `layer_types`:
- "linear_attention": a Gated DeltaNet (GDN) layer: in_proj to q/k/v (through a causal depthwise
  conv and SiLU), z (output gate), b and a (write strength and decay); the gated delta rule of
  `dflash_jax.gdn`; a gated RMSNorm with z; out_proj.
- "full_attention": GQA attention whose q_proj also gives a per-head output gate, zero-centred
  q/k RMS norms, RoPE on the first `rotary_dim` dims of each head, sigmoid(gate) on the output.
Every decoder norm is zero-centred (x * (1 + w)), except the GDN's gated norm (x * w).

Every layer holds its own arrays, as the dense target's (`dflash_jax.model`): the weights are
tuples of per-layer pytrees (`LayerCommon` per decoder layer, `AttnMixer` per attention layer,
`GDNMixer` per GDN layer) and the cache tuples of per-layer buffers, and `forward` is a Python
loop over the layers. Stacked [n_layers, ...] arrays read in a `lax.scan` made XLA copy each
layer's weights out of the stacks on every step (a slice is no operand for a GEMM), about 30 of
the 53.6 ms AR step of the 27B shape on an H100; per-layer arrays go to the GEMMs and the
attention kernel as they are, and each cache buffer is updated in place (tests/test_qwen3_5.py
reads the compiled HLO for slices of weights and caches). transformers'
`models/qwen3_5/modeling_qwen3_5.py` is the numerical reference (tests/test_qwen3_5.py).

Speculative decoding verifies a draft tree (a chain for DFlash) with `verify`, which commits
nothing, and keeps the accepted path with `commit`: each GDN layer's recurrent state after the
path comes in closed form from the verify's own U, K and G (`gdn.commit_state`), so there are
neither per-node states nor a second target pass (tests/test_qwen3_5_speculative.py).

Tensor and data parallelism (`dflash_jax.sharding`'s ("dp", "tp") mesh, `with use_mesh(mesh):`
around tracing; no-ops without one): GDN key and value heads, the conv channels (key-head-major,
so each key head's q, k and its value heads' v stay on one device) and the recurrent and conv
states split over tp, the gated attention by q / kv heads as the dense target (kv heads
replicated when tp is a multiple of them), the MLP by its intermediate axis; out_proj, o_proj
and down are row-parallel (one all-reduce each); embedding and LM head vocab-parallel; caches
by sequence over dp. The attention core is the dense target's (`sharding.attention`: the tree
attention kernel, per (dp, tp) shard in a shard_map under a mesh).
`load_qwen35(mesh=)` and `init_params(mesh=)` place each weight straight on its shards;
`check_tp` names the numbers that do not divide.

Imports only the stable low modules (params, config, rope, gdn, sampling, sharding, kv_cache).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dflash_jax import gdn
from dflash_jax.config import ConfigError, RopeConfig, rope_from_hf
from dflash_jax.kv_cache import gather_rows, write_rows
# Tensor parallelism splits GDN key and value heads (and with them the conv channels, which are
# key-head-major, and the recurrent states) over tp.
from dflash_jax.params import (EMBED, GDN_CONV, GDN_K_HEADS, GDN_V_HEADS, HEAD_DIM, KV_HEADS, MLP, Q_HEADS, VOCAB,
                               Spec, init_from_specs)
from dflash_jax.rope import rope_tables
from dflash_jax.sampling import SamplingParams, sample
from dflash_jax.sharding import (BATCH, ShardingError, attention, check_model, constrain, embed_lookup, mesh_sizes,
                                 partition_spec, specs_shardings)
from pallas_kernels.tree_gdn import impl_for_attention


FULL, LINEAR = "full_attention", "linear_attention"
# Named scopes of the two token mixers (`_run_layers`): profiles split a verify's time by them.
ATTENTION_SCOPE, GDN_SCOPE = "attention", "gdn"
PAD = -1  # output slots after a sequence has finished (as dflash_jax.generate)


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """A Qwen3.5 / Qwen3.6 dense hybrid target; hashable, a static argument of jitted functions."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # RoPE covers dims [0, rotary_dim) of each head (partial_rotary_factor)
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig(theta=1e7)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "gdn_key_heads", "gdn_value_heads", "gdn_key_dim", "gdn_value_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.layer_types:
            raise ConfigError("layer_types must name at least one layer")
        bad = sorted({t for t in self.layer_types if t not in (FULL, LINEAR)})
        if bad:
            raise ConfigError(f"layer_types has unknown entries {bad}; expected {FULL!r} or {LINEAR!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.gdn_value_heads % self.gdn_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.gdn_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.gdn_key_heads})")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ConfigError(f"rotary_dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even "
                              f"and in (0, head_dim={self.head_dim}]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def gdn_group(self) -> int:
        """Value heads per key head."""
        return self.gdn_value_heads // self.gdn_key_heads

    @property
    def conv_head_channels(self) -> int:
        """Conv channels per key head: its q (dk), its k (dk), its group's v (group x dv)."""
        return 2 * self.gdn_key_dim + self.gdn_group * self.gdn_value_dim

    @property
    def conv_channels(self) -> int:
        return self.gdn_key_heads * self.conv_head_channels


# Qwen3.6-27B's decoder (its config.json's text_config): 64 layers, every 4th gated attention
# (24 q / 4 kv heads of 256, RoPE on the first 64 dims), GDN 16 key / 48 value heads of 128.
# Benchmarks and the memory table (`dflash_jax.bench.memory`) use this shape with random weights.
QWEN36_27B = Qwen35Config(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                          layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 16, num_heads=24, num_kv_heads=4, head_dim=256,
                          rotary_dim=64, gdn_key_heads=16, gdn_value_heads=48, gdn_key_dim=128, gdn_value_dim=128,
                          conv_kernel=4, rope=RopeConfig(theta=1e7), max_position_embeddings=262144)


def _field(cfg: Mapping[str, Any], key: str, source: str, prefix: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: required field '{prefix}{key}' is missing")
    return cfg[key]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def qwen35_config_from_dict(cfg: Mapping[str, Any], source: str = "config.json") -> Qwen35Config:
    """A Qwen35Config from a parsed HF config: the text model (`qwen3_5_text`) or the
    vision-language wrapper (`qwen3_5`, whose `text_config` holds the decoder; its vision tower is
    not part of the target). `source` names the file in errors."""
    model_type = _field(cfg, "model_type", source, "")
    if "moe" in str(model_type):
        raise ConfigError(f"{source}: model_type {model_type!r} (mixture of experts, e.g. Qwen3.5-35B-A3B) is "
                          "not supported yet; only the dense qwen3_5 models are")
    if model_type not in ("qwen3_5", "qwen3_5_text"):
        raise ConfigError(f"{source}: model_type {model_type!r} is not a Qwen3.5 / Qwen3.6 model "
                          "(expected 'qwen3_5' or 'qwen3_5_text')")
    text, prefix = cfg, ""
    if "text_config" in cfg:
        text, prefix = cfg["text_config"] or {}, "text_config."
        if not isinstance(text, Mapping):
            raise ConfigError(f"{source}: field 'text_config' must be an object, got {type(text).__name__}")
    for moe_field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if text.get(moe_field):
            raise ConfigError(f"{source}: field '{prefix}{moe_field}' describes a mixture-of-experts model, "
                              "which is not supported yet")
    if text.get("attn_output_gate") is False:
        raise ConfigError(f"{source}: field '{prefix}attn_output_gate' is false; Qwen3.5 attention always "
                          "gates its output and no other variant is implemented")
    num_layers = int(_field(text, "num_hidden_layers", source, prefix))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"{source}: field '{prefix}full_attention_interval' must be >= 1, got {interval}")
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    layer_types = tuple(str(t) for t in layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(f"{source}: field '{prefix}layer_types' has {len(layer_types)} entries but "
                          f"num_hidden_layers is {num_layers}")
    bad = sorted({t for t in layer_types if t not in (FULL, LINEAR)})
    if bad:
        raise ConfigError(f"{source}: field '{prefix}layer_types' has unknown entries {bad}; "
                          f"expected {FULL!r} or {LINEAR!r}")
    hidden = int(_field(text, "hidden_size", source, prefix))
    heads = int(_field(text, "num_attention_heads", source, prefix))
    head_dim = int(text.get("head_dim") or hidden // heads)
    rope_params = text.get("rope_parameters") or {}
    factor = rope_params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    rope = rope_from_hf(text, source)
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    fields = dict(
        vocab_size=int(_field(text, "vocab_size", source, prefix)),
        hidden_size=hidden,
        intermediate_size=int(_field(text, "intermediate_size", source, prefix)),
        layer_types=layer_types,
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=int(head_dim * float(factor)),
        gdn_key_heads=int(_field(text, "linear_num_key_heads", source, prefix)),
        gdn_value_heads=int(_field(text, "linear_num_value_heads", source, prefix)),
        gdn_key_dim=int(_field(text, "linear_key_head_dim", source, prefix)),
        gdn_value_dim=int(_field(text, "linear_value_head_dim", source, prefix)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=_eos_ids(eos),
    )
    try:
        return Qwen35Config(**fields)
    except ConfigError as e:
        where = f" (in '{prefix[:-1]}')" if prefix else ""
        raise ConfigError(f"{source}{where}: {e}") from None


def load_qwen35_config(path: str | Path) -> Qwen35Config:
    """Reads `config.json` (or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return qwen35_config_from_dict(raw, str(path))


# ----------------------------------------------------------------------------- parameters

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCommon:
    """What every decoder layer has (one layer's)."""

    input_norm: Any  # [embed], zero-centred
    post_norm: Any  # [embed], zero-centred (before the MLP)
    gate_up: Any  # [embed, 2, mlp]: gate, then up
    down: Any  # [mlp, embed]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnMixer:
    """One gated full-attention layer's mixer."""

    q: Any  # [embed, q_heads, 2, head_dim]: per head its query, then its output gate (HF q_proj)
    k: Any  # [embed, kv_heads, head_dim]
    v: Any  # [embed, kv_heads, head_dim]
    q_norm: Any  # [head_dim], zero-centred
    k_norm: Any  # [head_dim], zero-centred
    o: Any  # [q_heads, head_dim, embed]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNMixer:
    """One Gated DeltaNet layer's mixer.

    The conv input channels are key-head-major: key head h owns [q_h (dk), k_h (dk), v of its value
    heads h*group .. h*group+group-1 (group x dv)], so splitting key heads over tp splits q, k, v,
    the conv and its state together, and value heads follow their key head.
    """

    qkv: Any  # [embed, gdn_k_heads, 2 dk + group dv]
    conv: Any  # [kernel, gdn_k_heads, 2 dk + group dv]; conv[kernel - 1] weighs the current token
    zba: Any  # [embed, gdn_v_heads, dv + 2]: per value head z (dv), then b, then a
    a_log: Any  # [gdn_v_heads] (the checkpoint's A_log)
    dt_bias: Any  # [gdn_v_heads]
    norm: Any  # [dv], the gated norm's weight (x * w, not zero-centred)
    out: Any  # [gdn_v_heads, dv, embed]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen35Params:
    embed: Any  # [vocab, embed]
    layers: tuple[LayerCommon, ...]  # one per decoder layer
    attn: tuple[AttnMixer, ...]  # one per attention layer, in layer order (cfg.attn_layers)
    gdn: tuple[GDNMixer, ...]  # one per GDN layer, in layer order (cfg.gdn_layers)
    final_norm: Any  # [embed], zero-centred
    lm_head: Any = None  # [embed, vocab]; None when tied to `embed`


def model_specs(cfg: Qwen35Config) -> Qwen35Params:
    """Every weight's shape and logical axes, in the layout `forward`'s einsums use (one pytree
    per layer, as `Qwen35Params`)."""
    e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hk, hv, dv, kc = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_value_dim, cfg.conv_head_channels

    def common() -> LayerCommon:
        return LayerCommon(input_norm=Spec((e,), (EMBED,), init="zeros"),
                           post_norm=Spec((e,), (EMBED,), init="zeros"),
                           gate_up=Spec((e, 2, m), (EMBED, None, MLP), fan_in=e),
                           down=Spec((m, e), (MLP, EMBED), fan_in=m))

    def attn() -> AttnMixer:
        return AttnMixer(q=Spec((e, qh, 2, hd), (EMBED, Q_HEADS, None, HEAD_DIM), fan_in=e),
                         k=Spec((e, kvh, hd), (EMBED, KV_HEADS, HEAD_DIM), fan_in=e),
                         v=Spec((e, kvh, hd), (EMBED, KV_HEADS, HEAD_DIM), fan_in=e),
                         q_norm=Spec((hd,), (HEAD_DIM,), init="zeros"),
                         k_norm=Spec((hd,), (HEAD_DIM,), init="zeros"),
                         o=Spec((qh, hd, e), (Q_HEADS, HEAD_DIM, EMBED), fan_in=qh * hd))

    def gdn_() -> GDNMixer:
        return GDNMixer(qkv=Spec((e, hk, kc), (EMBED, GDN_K_HEADS, None), fan_in=e),
                        conv=Spec((cfg.conv_kernel, hk, kc), (None, GDN_K_HEADS, None), fan_in=cfg.conv_kernel),
                        zba=Spec((e, hv, dv + 2), (EMBED, GDN_V_HEADS, None), fan_in=e),
                        a_log=Spec((hv,), (GDN_V_HEADS,), fan_in=1),
                        dt_bias=Spec((hv,), (GDN_V_HEADS,), init="ones"),
                        norm=Spec((dv,), (None,), init="ones"),
                        out=Spec((hv, dv, e), (GDN_V_HEADS, None, EMBED), fan_in=hv * dv))

    return Qwen35Params(
        embed=Spec((v, e), (VOCAB, EMBED), fan_in=1),
        layers=tuple(common() for _ in range(cfg.num_layers)),
        attn=tuple(attn() for _ in cfg.attn_layers),
        gdn=tuple(gdn_() for _ in cfg.gdn_layers),
        final_norm=Spec((e,), (EMBED,), init="zeros"),
        lm_head=None if cfg.tie_word_embeddings else Spec((e, v), (EMBED, VOCAB), fan_in=e),
    )


def check_tp(cfg: Qwen35Config, tp: int) -> None:
    """Raises a ShardingError naming the numbers when `cfg` cannot be split over `tp` devices.

    GDN key heads must divide by tp (a key head's conv channels and its value heads stay on one
    device); value heads then do too. The gated attention and the MLP follow the dense rules
    (`sharding.check_model`): q heads and the MLP divide, kv heads divide or are replicated.
    """
    if tp == 1:
        return
    if cfg.gdn_key_heads % tp:
        raise ShardingError(f"Qwen35Config: gdn key heads (linear_num_key_heads) {cfg.gdn_key_heads} are not "
                            f"divisible by tp={tp}")
    check_model(cfg, tp)


def init_params(cfg: Qwen35Config, key: jax.Array, dtype: Any = jnp.float32, *, mesh: Any = None) -> Qwen35Params:
    """Random weights (tests and benchmarks; real weights come from a converter), drawn straight
    into their tensor-parallel shards when a ("dp", "tp") `mesh` is given (same values)."""
    specs = model_specs(cfg)
    if mesh is None:
        return init_from_specs(specs, key, dtype)
    check_tp(cfg, mesh_sizes(mesh)[1])
    return init_from_specs(specs, key, dtype, shardings=specs_shardings(specs, mesh))


# ----------------------------------------------------------------------------- cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    """Per-sequence decoding state of the hybrid; every sequence has its own length.

    k, v:    per attention layer [batch, max_len, kv_heads, head_dim]  K/V (activation dtype)
    conv:    per GDN layer [batch, kernel - 1, conv_channels]          the last kernel - 1 conv inputs,
             oldest first (activation dtype); channels key-head-major (axis GDN_CONV)
    state:   per GDN layer [batch, gdn_v_heads, dk, dv] float32        the GDN recurrent states
    lengths: [batch] int32                                             tokens committed (K/V slots in use)

    One array per layer, as `dflash_jax.kv_cache.KVCache`: each buffer is updated in place and
    handed to its kernel without a slice copy.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def create(cls, cfg: Qwen35Config, batch: int, max_len: int, dtype: Any = jnp.float32) -> "HybridCache":
        kv = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        conv = (batch, cfg.conv_kernel - 1, cfg.conv_channels)
        state = (batch, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim)
        return cls(k=tuple(jnp.zeros(kv, dtype) for _ in cfg.attn_layers),
                   v=tuple(jnp.zeros(kv, dtype) for _ in cfg.attn_layers),
                   conv=tuple(jnp.zeros(conv, dtype) for _ in cfg.gdn_layers),
                   state=tuple(jnp.zeros(state, jnp.float32) for _ in cfg.gdn_layers),
                   lengths=jnp.zeros((batch,), jnp.int32))


# Logical axes of each layer's cache buffers: sequences over dp, heads (and conv channels) over tp.
KV_AXES = (BATCH, None, KV_HEADS, None)
CONV_AXES = (BATCH, None, GDN_CONV)
STATE_AXES = (BATCH, GDN_V_HEADS, None, None)


def _cache_axes(cache: HybridCache) -> HybridCache:
    """The logical axes of every buffer of `cache`, a HybridCache of axis tuples."""
    return HybridCache(k=tuple(KV_AXES for _ in cache.k), v=tuple(KV_AXES for _ in cache.v),
                       conv=tuple(CONV_AXES for _ in cache.conv), state=tuple(STATE_AXES for _ in cache.state),
                       lengths=(BATCH,))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) > 0 and all(a is None or isinstance(a, str) for a in x)


def constrain_cache(cache: HybridCache) -> HybridCache:
    """Lays the cache out on the active mesh (`KV_AXES`, `CONV_AXES`, `STATE_AXES`); a no-op without one."""
    return jax.tree.map(lambda axes, x: constrain(x, axes), _cache_axes(cache), cache, is_leaf=_is_axes)


def cache_shardings(cfg: Qwen35Config, batch: int, max_len: int, mesh: Any) -> HybridCache:
    """NamedShardings of a `HybridCache.create(cfg, batch, max_len)` on `mesh`, leaf for leaf."""
    shapes = jax.eval_shape(lambda: HybridCache.create(cfg, batch, max_len))
    return jax.tree.map(lambda a, s: jax.sharding.NamedSharding(mesh, partition_spec(a, s.shape, mesh,
                                                                                     what="HybridCache")),
                        _cache_axes(shapes), shapes, is_leaf=_is_axes)


# ----------------------------------------------------------------------------- building blocks

def _dot(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum with float32 accumulation, result in the activation dtype."""
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _row_parallel_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, T, *in] @ w [*in, embed] (out_proj, o_proj, down; `in` split over tp) -> [B, T, embed],
    replicated over tp: XLA all-reduces the result once.

    Both sides are flattened to one contracted axis first: with two (heads, head dim) XLA's CPU
    layout assignment transposed the weight, a copy of it on every step; the flattening is free
    for the row-major weight, and tp splits the flat axis in the heads' blocks.

    The result is in the activation dtype from the start, so under tp the all-reduce moves
    activation-dtype partial sums, not float32 ones (half the bytes in bf16); GPU GEMMs still
    accumulate in float32, as `dflash_jax.model`'s row-parallel dots.
    """
    flat = x.reshape(x.shape[:2] + (-1,))
    return constrain(jnp.einsum("btk,ke->bte", flat, w.reshape(flat.shape[-1], -1), preferred_element_type=x.dtype),
                     (BATCH, None, None))


def zero_centred_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * (1 + w) over the last axis, in float32; returns x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The GDN output norm: w * (x / rms(x)) * silu(gate) over the last axis; returns x's dtype.

    The weight multiplies the normed x after its cast back to x's dtype, as transformers'
    `Qwen3_5RMSNormGated` does (it matters only below float32).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = (weight * xf.astype(x.dtype)).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(x.dtype)


def _partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates (HF "rotate half") the first cos.shape[-1] dims of each head; the rest pass through.

    x: [B, T, H, head_dim]; cos, sin: [B, T, rotary_dim] float32.
    """
    rd = cos.shape[-1]
    rot = x[..., :rd].astype(jnp.float32)
    half = rd // 2
    turned = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * cos[:, :, None] + turned * sin[:, :, None]
    return jnp.concatenate([rot.astype(x.dtype), x[..., rd:]], axis=-1)


def mlp(lp: LayerCommon, h: jax.Array) -> jax.Array:
    """SwiGLU: h [B, T, embed] with one layer's gate_up [embed, 2, mlp] and down [mlp, embed]."""
    gu = _dot("bte,ecm->btcm", h, lp.gate_up)
    act = constrain(jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], (BATCH, None, MLP))
    return _row_parallel_dot(act, lp.down)


def attention_mixer(p: AttnMixer, cfg: Qwen35Config, h: jax.Array, cos: jax.Array, sin: jax.Array,
                    k_buf: jax.Array, v_buf: jax.Array, starts: jax.Array, visible: jax.Array | None = None,
                    attn_impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """One gated attention layer.

    h: [B, T, embed] (normed); k_buf, v_buf: [B, max_len, kv_heads, head_dim]; the T new K/V go
    to slots starts[b] .. starts[b] + T - 1. Query t sees every slot < starts[b] and new slot
    starts[b] + s where visible[b, t, s] ([B, T, T] bool; None: s <= t, causal).
    attn_impl: the attention core's implementation (`pallas_kernels.tree_attention.IMPLS`), as
    the dense target's.
    Returns (out [B, T, embed], k_buf, v_buf).
    """
    qg = _dot("bte,ehcd->bthcd", h, p.q)
    q, gate = qg[:, :, :, 0], qg[:, :, :, 1]
    k = _dot("bte,ehd->bthd", h, p.k)
    v = _dot("bte,ehd->bthd", h, p.v)
    # Tensor parallel: heads split over tp (kv heads replicated when tp is a multiple of them).
    q, gate = constrain(q, (BATCH, None, Q_HEADS, None)), constrain(gate, (BATCH, None, Q_HEADS, None))
    k, v = constrain(k, (BATCH, None, KV_HEADS, None)), constrain(v, (BATCH, None, KV_HEADS, None))
    q = _partial_rope(zero_centred_rms_norm(q, p.q_norm, cfg.rms_norm_eps), cos, sin)
    k = _partial_rope(zero_centred_rms_norm(k, p.k_norm, cfg.rms_norm_eps), cos, sin)
    k_buf, v_buf = write_rows(k_buf, k, starts), write_rows(v_buf, v, starts)
    # Only the softmax(q k^T + mask) v core is the shared tree attention (q head h reads kv head
    # h // group, transformers' repeat_kv); the norms, the partial RoPE and the output gate stay here.
    out = attention(q, k_buf, v_buf, starts, visible, impl=attn_impl).astype(jnp.float32)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
    out = constrain(out.astype(h.dtype), (BATCH, None, Q_HEADS, None))
    return _row_parallel_dot(out, p.o), k_buf, v_buf


def _gdn_inputs(p: GDNMixer, cfg: Qwen35Config, h: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A GDN layer's projections of h [B, T, embed]: (conv inputs [B, T, C], z [B, T, Hv, dv],
    g and beta [B, T, Hv] float32)."""
    batch, width, _ = h.shape
    dv = cfg.gdn_value_dim
    mixed = _dot("bte,ehc->bthc", h, p.qkv).reshape(batch, width, cfg.conv_channels)
    zba = constrain(_dot("bte,ehc->bthc", h, p.zba), (BATCH, None, GDN_V_HEADS, None))
    z, b, a = zba[..., :dv], zba[..., dv], zba[..., dv + 1]
    g, beta = gdn.gates(a, b, p.a_log, p.dt_bias)
    return constrain(mixed, (BATCH, None, GDN_CONV)), z, g, beta


def _gdn_qkv(cfg: Qwen35Config, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Conv outputs [B, T, C] (key-head-major) -> q, k [B, T, Hk, dk] and v [B, T, Hv, dv]."""
    batch, width, _ = y.shape
    dk = cfg.gdn_key_dim
    y = constrain(y.reshape(batch, width, cfg.gdn_key_heads, cfg.conv_head_channels),
                  (BATCH, None, GDN_K_HEADS, None))
    v = constrain(y[..., 2 * dk:].reshape(batch, width, cfg.gdn_value_heads, -1), (BATCH, None, GDN_V_HEADS, None))
    return y[..., :dk], y[..., dk:2 * dk], v


def _gdn_output(p: GDNMixer, cfg: Qwen35Config, h: jax.Array, out: jax.Array, z: jax.Array) -> jax.Array:
    """The rule's output [B, T, Hv, dv] through the gated norm and out_proj -> [B, T, embed]."""
    out = constrain(gated_rms_norm(out.astype(h.dtype), z, p.norm, cfg.rms_norm_eps), (BATCH, None, GDN_V_HEADS, None))
    return _row_parallel_dot(out, p.out)


def _conv_weight(p: GDNMixer, cfg: Qwen35Config) -> jax.Array:
    return p.conv.reshape(cfg.conv_kernel, cfg.conv_channels)


def gdn_mixer(p: GDNMixer, cfg: Qwen35Config, h: jax.Array, conv_state: jax.Array, state: jax.Array,
              lengths: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet layer.

    h: [B, T, embed] (normed); conv_state: [B, kernel - 1, C]; state: [B, Hv, dk, dv] float32;
    lengths: optional [B], valid tokens per sequence (right padding): the states stop at each
    sequence's last valid token. T = 1 runs the recurrent step, longer T the chunked form.
    Returns (out [B, T, embed], conv_state, state).
    """
    mixed, z, g, beta = _gdn_inputs(p, cfg, h)
    y, conv_state = gdn.causal_conv(mixed, conv_state, _conv_weight(p, cfg), None, lengths)
    q, k, v = _gdn_qkv(cfg, y)
    rule = gdn.recurrent if h.shape[1] == 1 else gdn.chunked
    out, state = rule(q, k, v, g, beta, state, lengths)
    return _gdn_output(p, cfg, h, out, z), conv_state, state


def gdn_tree_mixer(p: GDNMixer, cfg: Qwen35Config, h: jax.Array, conv_state: jax.Array, state: jax.Array,
                   visible: jax.Array, parents: jax.Array, attn_impl: str = "auto"
                   ) -> tuple[jax.Array, gdn.VerifyKept, jax.Array]:
    """One GDN layer over the W nodes of a draft tree, from the committed states, committing nothing.

    h: [B, W, embed] (normed); conv_state, state as `gdn_mixer`; visible [B, W, W] and parents
    [B, W] as `dflash_jax.tree.Tree`. Every node gets the output of the layer along its own
    root..node path (`gdn.tree_conv`, `gdn.tree_verify`). attn_impl: the decoder's attention impl;
    "reference" and "interpret" keep the rule's chunk in jnp / interpreted too (where the kernel
    takes the head sizes: `pallas_kernels.tree_gdn.impl_for_attention`), else it runs as
    `gdn.tree_verify`'s "auto".
    Returns (out [B, W, embed], what `gdn.commit_state` needs, the conv inputs [B, W, C] that
    `gdn.commit_conv_state` needs).
    """
    mixed, z, g, beta = _gdn_inputs(p, cfg, h)
    y = gdn.tree_conv(mixed, conv_state, parents, _conv_weight(p, cfg))
    q, k, v = _gdn_qkv(cfg, y)
    impl = impl_for_attention(attn_impl, cfg.gdn_key_dim, cfg.gdn_value_dim)
    out, kept = gdn.tree_verify(q, k, v, g, beta, state, visible, impl=impl)
    return _gdn_output(p, cfg, h, out, z), kept, mixed


def logits_from_hidden(params: Qwen35Params, hidden: jax.Array) -> jax.Array:
    """[..., embed] final-normed -> float32 logits [..., vocab] (split over tp by vocabulary under a mesh)."""
    if params.lm_head is None:
        logits = jnp.einsum("...e,ve->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...e,ev->...v", hidden, params.lm_head, preferred_element_type=jnp.float32)
    return constrain(logits, (BATCH,) * (logits.ndim > 1) + (None,) * max(logits.ndim - 2, 0) + (VOCAB,))


# ----------------------------------------------------------------------------- forward

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen35Output:
    logits: Any  # [batch, rows, vocab] float32 (rows = T, or R of logit_rows), or None
    taps: Any  # [batch, T, len(tap_layers) * embed], or None
    cache: HybridCache  # new K/V and GDN states; lengths advanced by the valid new tokens


def _check_step(fn: str, params: Qwen35Params, cfg: Qwen35Config, tokens: jax.Array, positions: jax.Array,
                cache: HybridCache, tap_layers: tuple[int, ...]) -> None:
    layers = (cfg.num_layers, "")  # (layers the config has, how the error names them)
    attn, gdn_ = (len(cfg.attn_layers), " attention layers"), (len(cfg.gdn_layers), " GDN layers")
    for what, have, (want, kind) in (("params.layers", params.layers, layers), ("params.attn", params.attn, attn),
                                     ("params.gdn", params.gdn, gdn_), ("cache.k", cache.k, attn),
                                     ("cache.v", cache.v, attn), ("cache.conv", cache.conv, gdn_),
                                     ("cache.state", cache.state, gdn_)):
        if len(have) != want:
            raise ValueError(f"{fn}: {what} holds {len(have)} layers; the config has {want}{kind}")
    batch, width = tokens.shape
    if positions.shape != (batch, width):
        raise ValueError(f"{fn}: positions must be [batch, T] = {(batch, width)}, got {positions.shape}")
    if cache.lengths.shape != (batch,):
        raise ValueError(f"{fn}: cache holds {cache.lengths.shape[0]} sequences, tokens {batch}")
    bad = [t for t in tap_layers if not 0 <= t < cfg.num_layers]
    if bad:
        raise ValueError(f"{fn}: tap_layers {bad} out of range for a {cfg.num_layers}-layer target")


def _run_layers(params: Qwen35Params, cfg: Qwen35Config, tokens: jax.Array, positions: jax.Array,
                cache: HybridCache, lengths: jax.Array | None, tap_layers: tuple[int, ...],
                tree: tuple[jax.Array, jax.Array] | None, attn_impl: str, last_tap_pre_norm: bool = False) -> tuple:
    """The decoder stack, shared by `forward` (tree None: GDN states advance) and `verify`
    (tree = (visible, parents): GDN layers run `gdn_tree_mixer` and keep their states).

    The token mixers run under the named scopes ATTENTION_SCOPE and GDN_SCOPE, so a profile of
    a round splits the verify's time between the two kinds of layer (MLPs, norms and the LM head
    stay in the enclosing scope).

    Every layer reads its own arrays (`params.layers[i]`, `params.attn[a]`, `params.gdn[g]`, the
    cache tuples) and returns new ones, so XLA updates each cache buffer in place and hands each
    weight to its GEMM without a copy.

    Returns (final-normed hidden [B, T, embed], taps or None, k, v, conv, state (tuples over their
    layers), and for verify the `gdn_tree_mixer` outputs per GDN layer (kept, conv inputs): two
    tuples, not stacked, as `commit` takes them one layer at a time; None for forward).
    """
    x = embed_lookup(params.embed, tokens)  # vocab-parallel under tp
    cos, sin = rope_tables(positions, cfg.rope, cfg.rotary_dim)
    cache = constrain_cache(cache)
    starts = cache.lengths
    visible = None if tree is None else tree[0]
    k_all, v_all, conv_all, state_all = list(cache.k), list(cache.v), list(cache.conv), list(cache.state)
    kept_all, conv_in_all = [], []
    taps = {}
    a = g = 0  # index of the next attention / GDN layer within its kind
    for i, kind in enumerate(cfg.layer_types):
        lp = params.layers[i]
        h = zero_centred_rms_norm(x, lp.input_norm, cfg.rms_norm_eps)
        if kind == FULL:
            with jax.named_scope(ATTENTION_SCOPE):
                out, k_all[a], v_all[a] = attention_mixer(params.attn[a], cfg, h, cos, sin, k_all[a], v_all[a],
                                                          starts, visible, attn_impl)
            a += 1
        elif tree is None:
            with jax.named_scope(GDN_SCOPE):
                out, conv_all[g], state_all[g] = gdn_mixer(params.gdn[g], cfg, h, conv_all[g], state_all[g], lengths)
            g += 1
        else:
            with jax.named_scope(GDN_SCOPE):
                out, kept, conv_in = gdn_tree_mixer(params.gdn[g], cfg, h, conv_all[g], state_all[g], *tree,
                                                    attn_impl)
            kept_all.append(kept)
            conv_in_all.append(conv_in)
            g += 1
        x = x + out
        x = x + mlp(lp, zero_centred_rms_norm(x, lp.post_norm, cfg.rms_norm_eps))
        if i in tap_layers:
            taps[i] = x
    ys = None if tree is None else (tuple(kept_all), tuple(conv_in_all))
    hidden = zero_centred_rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    tap_out = None
    if tap_layers:
        # HF's hidden_states[-1] is the final-normed output; the last layer's tap keeps that meaning
        # unless `last_tap_pre_norm` asks for its state before the final norm.
        last = cfg.num_layers - 1
        tap_out = jnp.concatenate([hidden if t == last and not last_tap_pre_norm else taps[t] for t in tap_layers],
                                  axis=-1)
    return hidden, tap_out, tuple(k_all), tuple(v_all), tuple(conv_all), tuple(state_all), ys


def forward(params: Qwen35Params, cfg: Qwen35Config, tokens: jax.Array, positions: jax.Array,
            cache: HybridCache, lengths: jax.Array | None = None, *, tap_layers: tuple[int, ...] = (),
            logit_rows: jax.Array | None = None, compute_logits: bool = True, attn_impl: str = "auto",
            last_tap_pre_norm: bool = False) -> Qwen35Output:
    """Runs T new tokens per sequence through the hybrid and commits them: prefill and AR steps.

    tokens, positions: [B, T] int32 (positions only rotate the attention layers' q/k).
    The new K/V go to slots cache.lengths[b] .. + T - 1 (callers keep cache.lengths + T <= max_len:
    the write would clamp silently); GDN layers run from the cached conv and
    recurrent states (T = 1: the recurrent step; T > 1: the chunked form, chunk gdn.CHUNK).
    lengths: optional [B] int, valid new tokens per sequence (right-padded prompts; 0 leaves a
        sequence's state as it was); default T for all.
    tap_layers: decoder layer ids whose outputs are returned (HF `hidden_states[id + 1]`; for the
        last layer that is the final-normed output, as the dense target's taps).
    last_tap_pre_norm: the last layer's tap is its state before the final norm instead (static).
    logit_rows: optional [B, R] row indices; logits only for those rows.
    attn_impl: the attention layers' core (`pallas_kernels.tree_attention.IMPLS`, `Impl.attention`).
    Returns logits, taps and the cache with lengths += the valid new tokens. Rows past a
    sequence's valid tokens give unspecified logits and taps.
    """
    _check_step("forward", params, cfg, tokens, positions, cache, tap_layers)
    batch, width = tokens.shape
    if lengths is not None and lengths.shape != (batch,):
        raise ValueError(f"forward: lengths must be [batch] = ({batch},), got {lengths.shape}")
    hidden, tap_out, k_all, v_all, conv_all, state_all, _ = _run_layers(params, cfg, tokens, positions, cache,
                                                                        lengths, tap_layers, None, attn_impl,
                                                                        last_tap_pre_norm)
    logits = None
    if compute_logits:
        rows = hidden if logit_rows is None else jax.vmap(lambda hb, rb: hb[rb])(hidden, logit_rows)
        logits = logits_from_hidden(params, rows)
    added = jnp.full((batch,), width, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    new_cache = HybridCache(k=k_all, v=v_all, conv=conv_all, state=state_all, lengths=cache.lengths + added)
    return Qwen35Output(logits=logits, taps=tap_out, cache=constrain_cache(new_cache))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen35Verified:
    """A verified tree, not yet committed (`verify` -> `commit`).

    cache:   the committed cache with the W tree nodes' attention K/V written at slots L..L+W-1
             (L = cache.lengths, unchanged); conv and recurrent states as committed
    kept:    per GDN layer a gdn.VerifyKept: k [B, Hk, W, dk], u [B, Hv, W, dv], decay [B, Hv, W]
             (float32); () without GDN layers
    conv_in: per GDN layer [B, W, conv_channels], the nodes' conv inputs; () without GDN layers
    parents: [B, W] int32, the tree's parent slots (-1 at the root and padding)
    """

    cache: HybridCache
    kept: Any
    conv_in: Any
    parents: Any


def verify(params: Qwen35Params, cfg: Qwen35Config, tokens: jax.Array, positions: jax.Array,
           visible: jax.Array, parents: jax.Array, cache: HybridCache, *, tap_layers: tuple[int, ...] = (),
           attn_impl: str = "auto", last_tap_pre_norm: bool = False
           ) -> tuple[jax.Array, jax.Array | None, Qwen35Verified]:
    """One target pass over the W nodes of a draft tree (a chain for DFlash) from the committed
    cache, committing nothing.

    tokens, positions: [B, W] int32, node tokens and positions (L + depth); visible [B, W, W] bool
    and parents [B, W] int as `dflash_jax.tree.Tree` (node 0 the root, parents before children,
    every row sees itself). Attention layers write the nodes' K/V at slots L..L+W-1 and attend to
    the committed slots < L plus the visible nodes (callers keep L + W <= max_len); GDN layers
    run the conv over each node's own path and the rule from the committed state (`gdn_tree_mixer`),
    so every node's logits are those of a plain forward over its root..node path.
    attn_impl: the attention layers' core (`pallas_kernels.tree_attention.IMPLS`, `Impl.attention`).
    last_tap_pre_norm: as `forward`'s.
    Returns (logits [B, W, vocab] float32, taps [B, W, len(tap_layers) * embed] or None,
    what `commit` needs).
    """
    _check_step("verify", params, cfg, tokens, positions, cache, tap_layers)
    batch, width = tokens.shape
    if visible.shape != (batch, width, width) or visible.dtype != jnp.bool_:
        raise ValueError(f"verify: visible must be bool [batch, W, W] = {(batch, width, width)}, "
                         f"got {visible.dtype} {visible.shape}")
    if parents.shape != (batch, width):
        raise ValueError(f"verify: parents must be [batch, W] = {(batch, width)}, got {parents.shape}")
    hidden, tap_out, k_all, v_all, _, _, ys = _run_layers(params, cfg, tokens, positions, cache, None, tap_layers,
                                                          (visible, parents), attn_impl, last_tap_pre_norm)
    kept, conv_in = ys
    written = dataclasses.replace(cache, k=k_all, v=v_all)
    return (logits_from_hidden(params, hidden), tap_out,
            Qwen35Verified(cache=written, kept=kept, conv_in=conv_in, parents=parents.astype(jnp.int32)))


def commit(verified: Qwen35Verified, path: jax.Array, accepted: jax.Array) -> HybridCache:
    """The cache after the accepted root..last path of a verified tree, per sequence, exactly.

    path: [B, P] int, the accepted nodes' slots by depth (path[:, 0] = 0, the root), padded with
    repeats of the last accepted node (`dflash_jax.accept`); accepted: [B] int, nodes accepted
    (the root included: m + 1), or 0 to leave a sequence as it was committed.
    Attention K/V of the path move to slots L..L+P-1 (the first `accepted` of them count); each GDN
    layer's recurrent state becomes `gdn.commit_state` (closed form from the verify's U, K and G)
    and its conv state `gdn.commit_conv_state`: neither per-node states nor a second pass.
    lengths += accepted. Callers keep L + P <= max_len.
    """
    cache = verified.cache
    batch, width = verified.parents.shape
    if path.ndim != 2 or path.shape[0] != batch:
        raise ValueError(f"commit: path must be [batch={batch}, P], got {path.shape}")
    if accepted.shape != (batch,):
        raise ValueError(f"commit: accepted must be [batch] = ({batch},), got {accepted.shape}")
    path = path.astype(jnp.int32)
    accepted = accepted.astype(jnp.int32)
    starts = cache.lengths
    slots = starts[:, None] + path
    # The path's K/V rows to slots L..L+P-1, as the dense target's commit moves them without its kernel.
    k = tuple(write_rows(buf, gather_rows(buf, slots), starts) for buf in cache.k)
    v = tuple(write_rows(buf, gather_rows(buf, slots), starts) for buf in cache.v)
    last = jnp.take_along_axis(path, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]
    taken = jnp.arange(path.shape[1])[None, :] < jnp.maximum(accepted, 1)[:, None]
    on_path = jnp.any((path[:, :, None] == jnp.arange(width)[None, None, :]) & taken[:, :, None], axis=1)  # [B, W]
    moved = accepted > 0
    state, conv = [], []
    for old_state, kept, old_conv, conv_in in zip(cache.state, verified.kept, cache.conv, verified.conv_in):
        new_state = gdn.commit_state(old_state, kept, on_path, last).astype(old_state.dtype)
        state.append(jnp.where(moved[:, None, None, None], new_state, old_state))
        new_conv = gdn.commit_conv_state(old_conv, conv_in, verified.parents, last)
        conv.append(jnp.where(moved[:, None, None], new_conv, old_conv))
    return constrain_cache(HybridCache(k=k, v=v, conv=tuple(conv), state=tuple(state), lengths=starts + accepted))


forward_jit = jax.jit(forward, static_argnames=("cfg", "tap_layers", "compute_logits", "attn_impl", "last_tap_pre_norm"),
                      donate_argnames=("cache",))


# ----------------------------------------------------------------------------- AR decoding

def _is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, tokens.dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "max_len", "sampling", "stop_tokens",
                                             "attn_impl"))
def generate(params: Qwen35Params, cfg: Qwen35Config, prompts: jax.Array, prompt_lens: jax.Array,
             key: jax.Array, *, max_new_tokens: int, max_len: int, sampling: SamplingParams = SamplingParams(),
             stop_tokens: tuple[int, ...] = (), attn_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Autoregressive generation on device (a prefill, then a `lax.while_loop` of one-token steps).

    prompts: [B, P] int32, right-padded; prompt_lens: [B] int32 (>= 1 each). Each sequence stops
    after a stop token (kept) or max_new_tokens tokens; a finished sequence's cache no longer moves.
    attn_impl: the attention layers' core (`Impl.attention`).
    Returns (tokens [B, max_new_tokens] int32, PAD after each end; num_tokens [B] int32).
    """
    batch, width = prompts.shape
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if width + max_new_tokens > max_len:
        raise ValueError(f"generate: max_len {max_len} is too small: prompts of width {width} + "
                         f"max_new_tokens {max_new_tokens} need {width + max_new_tokens}")
    cache = HybridCache.create(cfg, batch, max_len, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    lens = prompt_lens.astype(jnp.int32)
    pre = forward(params, cfg, prompts, positions, cache, lens, logit_rows=(lens - 1)[:, None], attn_impl=attn_impl)
    key, sub = jax.random.split(key)
    first = sample(sub, pre.logits[:, 0], sampling)
    out = jnp.full((batch, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((batch,), jnp.int32)
    done = _is_stop(first, stop_tokens) | (max_new_tokens <= 1)

    def cond(carry: tuple) -> jax.Array:
        return ~jnp.all(carry[4])

    def body(carry: tuple) -> tuple:
        cache, last, out, count, done, key = carry
        live = (~done).astype(jnp.int32)
        step = forward(params, cfg, last[:, None], cache.lengths[:, None], cache, live, attn_impl=attn_impl)
        key, sub = jax.random.split(key)
        nxt = sample(sub, step.logits[:, 0], sampling)
        write = jnp.where(done, max_new_tokens, count)  # out of range -> dropped
        out = out.at[jnp.arange(batch), write].set(nxt, mode="drop")
        count = count + live
        done = done | _is_stop(nxt, stop_tokens) | (count >= max_new_tokens)
        return step.cache, jnp.where(done, last, nxt), out, count, done, key

    _, _, out, count, _, _ = jax.lax.while_loop(cond, body, (pre.cache, first, out, count, done, key))
    return out, count
