"""Model configurations, built from Hugging Face `config.json` files.

A config is a frozen, hashable dataclass so it can be a static argument of jitted
functions. Everything that changes the traced program (shapes, RoPE constants, flags)
lives here; arrays never do.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


class ConfigError(ValueError):
    """A config file is missing a field, has a bad value, or names an unknown model type."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding constants (HF `rope_parameters` / legacy `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | llama3 | yarn | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.theta) and self.theta > 0):
            raise ConfigError(f"rope_theta must be a finite number > 0, got {self.theta}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"rope factor must be a finite number > 0, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ConfigError(f"original_max_position_embeddings must be >= 1, "
                              f"got {self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only target model (`qwen3` or `llama`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # qwen3 normalises q and k per head before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_position_embeddings < 1:
            raise ConfigError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return cfg[key]


_MISSING = object()


def int_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = _MISSING, minimum: int | None = 1
              ) -> int:
    """cfg[key] as an int (required unless `default` is given), naming the file and field when it is
    missing, not a whole number ("four", 2.5, true) or below `minimum`."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        value = default
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ConfigError(f"{source}: field {key!r} must be a whole number, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{source}: field {key!r} must be >= {minimum}, got {value}")
    return value


def float_field(cfg: Mapping[str, Any], key: str, source: str, default: Any = _MISSING, positive: bool = True
                ) -> float:
    """cfg[key] as a finite float (> 0 when `positive`), naming the file and field otherwise."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field {key!r} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{source}: field {key!r} must be a finite number{' > 0' if positive else ''}, "
                          f"got {value}")
    return value


def bool_field(cfg: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def rope_from_hf(cfg: Mapping[str, Any], source: str = "config") -> RopeConfig:
    """Reads RoPE settings from either transformers-5 `rope_parameters` or legacy fields."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], Mapping):
            raise ConfigError(f"{source}: field {key!r} must be an object, got {cfg[key]!r}")
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float_field(params, "rope_theta", source, cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "yarn", "linear"):
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported "
                          "(expected default, linear, llama3 or yarn)")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings", 8192)))
    if rope_type in ("llama3", "yarn", "linear") and "factor" not in params:
        raise ConfigError(f"{source}: rope_type {rope_type!r} needs field 'factor'")
    fields = dict(
        theta=theta,
        rope_type=rope_type,
        factor=float_field(params, "factor", source, 1.0),
        low_freq_factor=float_field(params, "low_freq_factor", source, 1.0),
        high_freq_factor=float_field(params, "high_freq_factor", source, 4.0),
        original_max_position_embeddings=int_field({"original_max_position_embeddings": original},
                                                   "original_max_position_embeddings", source),
        beta_fast=float_field(params, "beta_fast", source, 32.0),
        beta_slow=float_field(params, "beta_slow", source, 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
    try:
        return RopeConfig(**fields)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{source}: field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(values)


def model_config_from_dict(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config dict. `source` names the file in errors."""
    model_type = _require(cfg, "model_type", source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    hidden = int_field(cfg, "hidden_size", source)
    heads = int_field(cfg, "num_attention_heads", source)
    bos = cfg.get("bos_token_id")
    max_positions = int_field(cfg, "max_position_embeddings", source, 32768)  # before RoPE, which reads it
    fields = dict(
        model_type=model_type,
        vocab_size=int_field(cfg, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=int_field(cfg, "intermediate_size", source),
        num_layers=int_field(cfg, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=int_field(cfg, "num_key_value_heads", source, heads),
        head_dim=int_field(cfg, "head_dim", source, hidden // heads),
        rms_norm_eps=float_field(cfg, "rms_norm_eps", source, 1e-6),
        rope=rope_from_hf(cfg, source),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool_field(cfg, "tie_word_embeddings", source, False),
        qk_norm=model_type == "qwen3",
        attention_bias=bool_field(cfg, "attention_bias", source, False),
        mlp_bias=bool_field(cfg, "mlp_bias", source, False),
        bos_token_id=None if bos is None else int_field(cfg, "bos_token_id", source, minimum=0),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), source),
    )
    try:
        return ModelConfig(**fields)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_model_config(path: str | Path) -> ModelConfig:
    """Reads `config.json` (or a directory holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return model_config_from_dict(load_json(file), source=str(file))


def default_tap_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's default tap layers: evenly spread over layers 1 .. N-3, or the middle one."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    # Python's round() (half to even) is what the reference uses; keep it for identical taps.
    return tuple(round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps))
