"""Shared pieces of the GPU benchmarks: model shapes, timing, bandwidth and environment."""
from __future__ import annotations

import gzip
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.qwen3_5 import FULL, LINEAR, QWEN36_27B, Qwen35Config

# Real models' shapes; the benchmarks use random weights of these shapes. Dense targets are
# ModelConfigs, Qwen3.5 / Qwen3.6 hybrids Qwen35Configs (`dense_shape` refuses those for the
# tools that time dense targets only).
SHAPES: dict[str, ModelConfig | Qwen35Config] = {
    "qwen3-8b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                            rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960),
    "smollm2-135m": ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                                rope=RopeConfig(theta=100000.0), max_position_embeddings=8192),
    "qwen3-32b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                             num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, qk_norm=True,
                             rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960),
    # A smoke-test shape, so every benchmark can be dry-run on CPU before it spends GPU time.
    "tiny": ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                        rope=RopeConfig(theta=10000.0), max_position_embeddings=8192),
    # Qwen3.6-27B: 16 x (3 Gated-DeltaNet layers, 1 gated-attention layer); RoPE on 25% of head_dim 256.
    "qwen3.6-27b": QWEN36_27B,
    # The hybrid's smoke-test shape: two periods, key heads < value heads as in the real models.
    "tiny-hybrid": Qwen35Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, num_heads=4, num_kv_heads=2,
                                head_dim=32, rotary_dim=8, gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=16,
                                gdn_value_dim=16, rope=RopeConfig(theta=10000.0), max_position_embeddings=8192),
}

# SHAPES of dense targets (the tools that build dense models take only these as choices).
DENSE_SHAPES = sorted(name for name, cfg in SHAPES.items() if isinstance(cfg, ModelConfig))


def dense_shape(name: str, tool: str) -> ModelConfig:
    """SHAPES[name] for a tool that times dense targets only; a hybrid or unknown name is refused
    naming the shape and the tool."""
    if name not in SHAPES:
        raise ValueError(f"{tool}: unknown model shape {name!r}; known: {sorted(SHAPES)}")
    cfg = SHAPES[name]
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"{tool}: model shape {name!r} is a Qwen3.5 / Qwen3.6 hybrid; {tool} times dense "
                         f"targets only (dense shapes: {DENSE_SHAPES}); time a hybrid with `dflash-jax bench` "
                         f"or `generate --stage-times` on a saved checkpoint")
    return cfg


_T0 = time.perf_counter()


def log(*parts: Any) -> None:
    """Print with the seconds since the process started: shows where a run's time goes."""
    print(f"[{time.perf_counter() - _T0:6.1f}s]", *parts, flush=True)


def time_fn(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Median / min wall time in ms of `fn()` (which must return device arrays), after warm-up.

    `first_ms` is the first warm-up call: compile time included, it says what a run costs.
    """
    first = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        first = (time.perf_counter() - t0) * 1e3 if first is None else first
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters, "first_ms": first}


def copy_bandwidth(num_bytes: int = 4 << 30) -> dict[str, Any]:
    """Device-to-device streaming bandwidth (bytes read + bytes written per second).

    The best of a few streaming kernels (bf16 and float32, flat and 2-D), since one XLA
    elementwise kernel alone can sit well under what the memory delivers; the roofline
    should use the best the device is seen to stream, not one kernel's shortfall.
    """
    variants = {"bf16 flat x*1.5": ((num_bytes // 2,), jnp.bfloat16),
                "bf16 2-D x*1.5": ((num_bytes // 2 // 8192, 8192), jnp.bfloat16),
                "f32 2-D x*1.5": ((num_bytes // 4 // 8192, 8192), jnp.float32)}
    results = {}
    f = jax.jit(lambda a: a * jnp.asarray(1.5, a.dtype))
    for name, (shape, dtype) in variants.items():
        x = jax.random.normal(jax.random.key(0), shape, dtype)
        moved = 2 * x.size * x.dtype.itemsize
        t = time_fn(lambda: f(x), warmup=3, iters=20)
        results[name] = moved / (t["median_ms"] * 1e-3) / 1e12
        del x
    best = max(results, key=results.get)
    return {"tb_per_s": results[best], "best": best, "variants_tb_per_s": results}


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {"date": time.strftime("%Y-%m-%d"), "device": getattr(dev, "device_kind", str(dev)),
            "jax": jax.__version__, "python": platform.python_version(), "backend": jax.default_backend(),
            "num_devices": jax.device_count()}


def write_json(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def dump_hlo(directory: str | None, name: str, text: str) -> None:
    """Writes a compiled program's HLO to DIRECTORY/NAME.hlo.txt.gz (for reading a profile offline)."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        with gzip.open(os.path.join(directory, f"{name}.hlo.txt.gz"), "wt") as f:
            f.write(text)
