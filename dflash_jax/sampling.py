"""Turning logits into tokens: greedy, temperature, top-k and top-p, with explicit PRNG keys."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def sampling_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [..., vocab] -> float32 probabilities after temperature, top-k, then top-p.

    Same order of filters as the dflash reference: top-k, softmax, keep the smallest set
    of most probable tokens whose mass before each token is < top_p, renormalise.
    """
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
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
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return sample_from_probs(key, sampling_probs(logits, sp))
