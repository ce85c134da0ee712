"""Model configurations, built from Hugging Face `config.json` files.

A config is a frozen, hashable dataclass so it can be a static argument of jitted
functions. Everything that changes the traced program (shapes, RoPE constants, flags)
lives here; arrays never do.
"""
from __future__ import annotations

import dataclasses
import json
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


def rope_from_hf(cfg: Mapping[str, Any], source: str = "config") -> RopeConfig:
    """Reads RoPE settings from either transformers-5 `rope_parameters` or legacy fields."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "yarn", "linear"):
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported "
                          "(expected default, linear, llama3 or yarn)")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings", 8192)))
    if rope_type in ("llama3", "yarn", "linear") and "factor" not in params:
        raise ConfigError(f"{source}: rope_type {rope_type!r} needs field 'factor'")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_config_from_dict(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config dict. `source` names the file in errors."""
    model_type = _require(cfg, "model_type", source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unknown model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    head_dim = cfg.get("head_dim") or (hidden // heads)
    try:
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(_require(cfg, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(cfg, "intermediate_size", source)),
            num_layers=int(_require(cfg, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(cfg, source),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        )
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


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
