"""Plain autoregressive decoding, entirely on device: a jitted prefill and a `lax.while_loop`.

Also the pieces every decoder shares: prompt validation, prefill, stop handling and the
output buffer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ModelConfig
from dflash_jax.impl import Impl
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import ModelParams, forward
from dflash_jax.sampling import SamplingParams, sample

PAD = -1  # output slots after a sequence has finished


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Generation:
    """tokens: [batch, max_new_tokens] int32 (PAD after the end); num_tokens: [batch] int32.

    For speculative decoders `accepted` is [batch, max_rounds] int32 (tokens committed per round,
    bonus included; 0 for rounds a sequence did not run) and `rounds` [batch] int32.
    """

    tokens: Any
    num_tokens: Any
    accepted: Any = None
    rounds: Any = None


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def memory_available() -> int:
    """Bytes this process's first device can hold: the accelerator's limit, or the host's RAM on CPU."""
    import os

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, itemsize: int) -> int:
    """Bytes of the target's K and V caches for `batch` sequences of `max_len` slots."""
    return 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * itemsize


def check_prompts(prompt_lens: np.ndarray, prompt_width: int, max_new_tokens: int, max_len: int,
                  slack: int = 1, cfg: ModelConfig | None = None, dcfg: Any = None, itemsize: int = 4) -> None:
    """Host-side checks that every sequence fits the cache; raises naming the argument.

    With `cfg` (and the drafter's `dcfg`), also that the last position stays below each model's
    max_position_embeddings (past it RoPE runs on positions the model never saw and the output is
    silently wrong), and that the KV cache fits the device's memory (an absurd --max-new-tokens
    otherwise fails deep inside XLA with a multi-terabyte allocation).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lens = np.asarray(prompt_lens)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"prompt_lens must be a non-empty [batch] array, got shape {lens.shape}")
    if (lens < 1).any():
        raise ValueError(f"every prompt needs at least one token; prompt_lens = {lens.tolist()}")
    if (lens > prompt_width).any():
        raise ValueError(f"prompt_lens {lens.tolist()} exceed the prompt array width {prompt_width}")
    longest = int(lens.max())
    # A sequence's last token sits at position prompt + max_new_tokens - 1; the draft block of its
    # last round reaches up to `slack` positions further.
    last = longest + max_new_tokens + slack - 1
    tokens = f"{longest} token{'s' if longest != 1 else ''}"
    for name, c in (("target", cfg), ("drafter", dcfg)):
        if c is None:
            continue
        room = c.max_position_embeddings - longest - slack  # the most new tokens that fit
        if room < 1:
            raise ValueError(f"a prompt of {tokens} is too long for the {name}'s max_position_embeddings "
                             f"{c.max_position_embeddings} (it leaves no room for new tokens); shorten the prompt")
        if last >= c.max_position_embeddings:
            raise ValueError(
                f"a prompt of {tokens} + max_new_tokens (--max-new-tokens) {max_new_tokens} reaches "
                f"position {last}, beyond the {name}'s max_position_embeddings {c.max_position_embeddings}: "
                f"shorten the prompt or lower --max-new-tokens to at most {room}")
    if cfg is not None:
        need, have = kv_cache_bytes(cfg, lens.size, max_len, itemsize), memory_available()
        if need > have:
            raise ValueError(f"max_new_tokens (--max-new-tokens) {max_new_tokens} for {lens.size} sequence(s) "
                             f"needs a KV cache of {_bytes(need)}, more than the device's {_bytes(have)}")
    need = longest + max_new_tokens + slack
    if max(need, prompt_width) > max_len:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} (+{slack} scratch slots) "
            f"needs a cache of {max(need, prompt_width)}, but max_len is {max_len}")


def prefill(params: ModelParams, cfg: ModelConfig, prompts: jax.Array, prompt_lens: jax.Array,
            cache: KVCache, tap_layers: tuple[int, ...] = (), attn_impl: str = "auto",
            last_tap_pre_norm: bool = False) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Runs the right-padded prompts [batch, P] through the target (taps as `model.forward`'s).

    Returns logits at each prompt's last token [batch, vocab], the tap features of all P
    rows [batch, P, taps*embed] (rows past a prompt's length are garbage), and the cache
    with lengths = prompt_lens.
    """
    batch, width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = dataclasses.replace(cache, lengths=jnp.zeros((batch,), jnp.int32))
    out = forward(params, cfg, prompts, positions, cache, None, tap_layers=tap_layers,
                  logit_rows=(prompt_lens - 1)[:, None], attn_impl=attn_impl, last_tap_pre_norm=last_tap_pre_norm)
    cache = dataclasses.replace(out.cache, lengths=prompt_lens.astype(jnp.int32))
    return out.logits[:, 0], out.taps, cache


def is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, tokens.dtype))


# XLA's command buffers (CUDA graphs) for every command type, the loop types (WHILE, CONDITIONAL)
# included. A generation's while_loop otherwise has the host read `done` back after every step
# before it issues the next, so each step starts with the GPU waiting on the host. Speculative
# decoding compiles its loop so too (`speculative.SPEC_COMPILER_OPTIONS`). AR decoding at ctx 4K
# (Qwen3-8B shape, 127 tokens, in turns): 4.803 against 4.844 ms a token with XLA's default
# command types, faster in each of 7 turns, the same tokens (BENCHMARKS.md).
COMMAND_BUFFERS_ALL = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                       "xla_gpu_graph_min_graph_size": 1}
COMMAND_BUFFERS_OFF = {"xla_gpu_enable_command_buffer": ""}


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "max_len", "sampling", "stop_tokens",
                                             "impl"), compiler_options=COMMAND_BUFFERS_ALL)
def generate_ar(params: ModelParams, cfg: ModelConfig, prompts: jax.Array, prompt_lens: jax.Array,
                key: jax.Array, *, max_new_tokens: int, max_len: int,
                sampling: SamplingParams = SamplingParams(), stop_tokens: tuple[int, ...] = (),
                impl: Impl = Impl()) -> Generation:
    """Autoregressive generation for a batch of right-padded prompts [batch, P].

    Each sequence stops after a stop token (which is kept) or `max_new_tokens` tokens.
    impl: the attention's implementation (`Impl.attention`); the loop reads `done` every step
    (its `rounds_per_check` is for speculative rounds).
    """
    batch = prompts.shape[0]
    if prompts.shape[1] + max_new_tokens > max_len:
        raise ValueError(f"max_len {max_len} is too small: prompts of width {prompts.shape[1]} + "
                         f"max_new_tokens {max_new_tokens} need {prompts.shape[1] + max_new_tokens}")
    dtype = params.embed.dtype
    cache = KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)
    logits, _, cache = prefill(params, cfg, prompts, prompt_lens, cache, attn_impl=impl.attention)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling)
    out = jnp.full((batch, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((batch,), jnp.int32)
    done = is_stop(first, stop_tokens) | (max_new_tokens <= 1)

    def cond(state):
        return ~jnp.all(state[4])

    def body(state):
        cache, last, out, count, done, key = state
        positions = cache.lengths[:, None]
        step = forward(params, cfg, last[:, None], positions, cache, None, attn_impl=impl.attention)
        key, sub = jax.random.split(key)
        nxt = sample(sub, step.logits[:, 0], sampling)
        # Finished sequences keep their slot and output; their compute is wasted but harmless.
        lengths = cache.lengths + (~done).astype(jnp.int32)
        write = jnp.where(done, max_new_tokens, count)  # out of range -> dropped
        out = out.at[jnp.arange(batch), write].set(nxt, mode="drop")
        count = count + (~done).astype(jnp.int32)
        done = done | is_stop(nxt, stop_tokens) | (count >= max_new_tokens)
        cache = dataclasses.replace(step.cache, lengths=lengths)
        return cache, jnp.where(done, last, nxt), out, count, done, key

    state = (cache, first, out, count, done, key)
    _, _, out, count, _, _ = jax.lax.while_loop(cond, body, state)
    return Generation(tokens=out, num_tokens=count)
