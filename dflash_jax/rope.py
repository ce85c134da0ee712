"""Rotary position embeddings (HF "rotate half" layout) with default, linear, llama3 and YaRN scaling."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [rotary_dim // 2] float32, attention scaling of cos/sin).

    Computed in numpy at trace time: the values are constants of the model.
    """
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
    base_freq = (1.0 / (rope.theta ** exponents)).astype(np.float32)
    if rope.rope_type == "default":
        return base_freq, 1.0
    if rope.rope_type == "linear":
        return (base_freq / rope.factor).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3(base_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, rotary_dim)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor, base = rope.factor, rope.theta
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled frequency
    inv = interpolation * (1 - keep) + extrapolation * keep
    return inv.astype(np.float32), float(attention_factor)


def rope_tables(positions: jax.Array, rope: RopeConfig, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [..., rotary_dim] float32 for integer `positions` of any shape."""
    inv_freq, scaling = inverse_frequencies(rope, rotary_dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scaling, jnp.sin(angles) * scaling


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; cos/sin: [batch, seq, head_dim]. Rotation in float32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
