"""Turning logits into tokens: greedy, temperature, top-k and top-p, with explicit PRNG keys."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Vocabulary entries per chunk of `greedy_tokens`' first reduction (about; see `_argmax_chunk`).
ARGMAX_CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _argmax_chunk(vocab: int, target: int = ARGMAX_CHUNK) -> int:
    """A chunk length for `greedy_tokens`: a divisor of vocab within [target / 2, 2 * target]
    (the one nearest target), so the rows split without padding; else target (the row padded)."""
    divisors = [d for d in range(max(1, target // 2), 2 * target + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: abs(d - target)) if divisors else target


def _max_first(values: jax.Array, index: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """The largest of values along `axis` and its index, the lowest index among equal values,
    NaN above everything (the first NaN wins): jnp.argmax's choice, as one variadic reduction."""
    def pick(a, b):
        (av, ai), (bv, bi) = a, b
        a_nan, b_nan = av != av, bv != bv
        b_first = bi < ai
        take_b = jnp.where(a_nan, b_nan & b_first, b_nan | (bv > av) | ((bv == av) & b_first))
        return lax.select(take_b, bv, av), lax.select(take_b, bi, ai)

    init = (jnp.array(-jnp.inf, values.dtype), jnp.array(np.iinfo(np.int32).max, jnp.int32))
    return lax.reduce((values, index), init, pick, (axis,))


def greedy_tokens(logits: jax.Array, chunk: int | None = None) -> jax.Array:
    """jnp.argmax(logits, -1) as int32 [...], from logits [..., vocab] (floats), in two reductions.

    The first takes each chunk's largest entry and its index, the second the largest of those:
    the same token as jnp.argmax (the lowest index among equal maxima, the first NaN if any).
    Why: XLA reduces each row of one argmax in one thread block, and 257 rows of Qwen3's 151936
    logits (a DDTree(256) verify) leave most of the GPU idle: 36-44 us, about 2 TB/s (BENCHMARKS.md,
    twenty-ninth session). Chunks give the first reduction rows x vocab / chunk blocks.
    chunk: entries per chunk (default `_argmax_chunk(vocab)`); a row of at most 2 chunks takes
    jnp.argmax itself.
    """
    vocab = logits.shape[-1]
    chunk = _argmax_chunk(vocab) if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = -(-vocab // chunk)
    if n <= 2:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    x = logits
    if n * chunk != vocab:  # -inf at the end: a real entry equal to it comes first
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * chunk - vocab)], constant_values=-jnp.inf)
    x = x.reshape(*x.shape[:-1], n, chunk)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) + lax.broadcasted_iota(
        jnp.int32, x.shape, x.ndim - 2) * chunk
    best, at = _max_first(x, index, x.ndim - 1)
    return _max_first(best, at, best.ndim - 1)[1]


def sampling_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [..., vocab] -> float32 probabilities after temperature, top-k, then top-p.

    Same order of filters as the dflash reference: top-k, softmax, keep the smallest set
    of most probable tokens whose mass before each token is < top_p, renormalise.
    """
    if sp.greedy:
        return jax.nn.one_hot(greedy_tokens(logits), logits.shape[-1], dtype=jnp.float32)
    scores = logits.astype(jnp.float32) / sp.temperature
    vocab = scores.shape[-1]
    if 0 < sp.top_k < vocab:
        kth = jax.lax.top_k(scores, sp.top_k)[0][..., -1:]
        scores = jnp.where(scores >= kth, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    if sp.top_p < 1.0:
        order = jnp.argsort(-probs, axis=-1, stable=True)
        sorted_probs = jnp.take_along_axis(probs, order, -1)
        keep_sorted = jnp.cumsum(sorted_probs, -1) - sorted_probs < sp.top_p
        keep = jnp.zeros_like(keep_sorted)
        keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, -1, keepdims=True)
    return probs


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws one token per row of probs [..., vocab] -> int32 [...]."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def sample(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [..., vocab] -> tokens int32 [...]."""
    if sp.greedy:
        return greedy_tokens(logits)
    return sample_from_probs(key, sampling_probs(logits, sp))
