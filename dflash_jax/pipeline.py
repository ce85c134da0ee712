"""Text in, text out: tokenizer and chat template, prompt batching, timed generation.

The jitted decoders work on token arrays; this module is the host-side layer the CLI and
benchmarks share. Compilation is done ahead of time so reported speeds exclude it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import ModelConfig
from dflash_jax.generate import Generation, check_prompts, generate_ar
from dflash_jax.impl import Impl
from dflash_jax.sampling import SamplingParams

_STOP_TOKEN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>")


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids per prompt, wrapped in the tokenizer's chat template when `chat`."""
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for text in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def stop_tokens_for(tokenizer: Any, cfg: ModelConfig) -> tuple[int, ...]:
    """End-of-turn and end-of-text ids known to the tokenizer and the config."""
    # A chat model stops at the end of its turn, which is not always the tokenizer's eos_token.
    ids = set(cfg.eos_token_ids)
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids.update(int(vocab[t]) for t in _STOP_TOKEN_TEXTS if t in vocab)
    return tuple(sorted(ids))


def padded_width(token_lists: Sequence[Sequence[int]], multiple: int = 32) -> int:
    """The longest list's length rounded up to `multiple`."""
    return int(-(-max(len(t) for t in token_lists) // multiple) * multiple)


def pad_prompts(token_lists: Sequence[Sequence[int]], multiple: int = 32, pad_id: int = 0,
                width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads to `width`, by default the longest prompt rounded up to `multiple` (fewer
    recompilations) -> ([B, P], [B]). A fixed `width` gives every batch of a run one shape."""
    lens = np.array([len(t) for t in token_lists], np.int32)
    if (lens == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lens))} is empty after tokenization")
    width = padded_width(token_lists, multiple) if width is None else width
    if lens.max() > width:
        raise ValueError(f"a prompt of {int(lens.max())} tokens does not fit width {width}")
    arr = np.full((len(token_lists), width), pad_id, np.int32)
    for i, t in enumerate(token_lists):
        arr[i, :len(t)] = t
    return arr, lens


@dataclasses.dataclass
class TimedGeneration:
    generation: Generation
    seconds: float  # device time of the generation, compile excluded
    compile_seconds: float

    def token_lists(self) -> list[list[int]]:
        toks = np.asarray(self.generation.tokens)
        n = np.asarray(self.generation.num_tokens)
        return [toks[b, :n[b]].tolist() for b in range(toks.shape[0])]

    @property
    def total_tokens(self) -> int:
        return int(np.asarray(self.generation.num_tokens).sum())

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.seconds

    def acceptance(self) -> dict[str, Any] | None:
        """tau (mean tokens committed per round, bonus included) and per-sequence round counts."""
        g = self.generation
        if g.accepted is None:
            return None
        acc, rounds = np.asarray(g.accepted), np.asarray(g.rounds)
        per_seq = [acc[b, :rounds[b]].tolist() for b in range(acc.shape[0])]
        total_rounds = int(rounds.sum())
        # The first token comes from prefill, not from a round.
        committed = sum(sum(s) for s in per_seq)
        return {"tau": committed / max(total_rounds, 1), "rounds": rounds.tolist(),
                "accepted_per_round": per_seq}


class Compiled:
    """Ahead-of-time compiled programs, one per caller-chosen key, so timings exclude compiling.

    Positional arguments that hold no arrays (configs) are static; a compiled program takes
    the rest, in order.
    """

    def __init__(self) -> None:
        self.programs: dict[Any, Any] = {}
        self.compile_seconds = 0.0

    def run(self, key: Any, fn: Any, args: tuple, kwargs: dict,
            stage: Callable[[str], None] | None = None) -> tuple[Any, float]:
        """-> (fn(*args, **kwargs), seconds of the compiled run).

        stage: told "compile" before a program is compiled and "run" before it runs (progress).
        """
        if key not in self.programs:
            if stage is not None:
                stage("compile")
            t0 = time.perf_counter()
            self.programs[key] = fn.lower(*args, **kwargs).compile()
            self.compile_seconds += time.perf_counter() - t0
        dynamic = [a for a in args if _is_array_tree(a)]
        if stage is not None:
            stage("run")
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.programs[key](*dynamic))
        return out, time.perf_counter() - t0


def timed_call(fn: Any, *args: Any, stage: Callable[[str], None] | None = None, **kwargs: Any
               ) -> TimedGeneration:
    """Compiles `fn` for these arguments, then times one run of the compiled program (stage: as
    for `Compiled.run`)."""
    compiled = Compiled()
    result, seconds = compiled.run(None, fn, args, kwargs, stage)
    return TimedGeneration(result, seconds, compiled.compile_seconds)


def _is_array_tree(x: Any) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(l, (jax.Array, np.ndarray)) for l in leaves)


def _itemsize(params: Any) -> int:
    """Bytes per element of the params (and so of the KV cache built from them)."""
    return int(max((np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)), default=4))


def default_max_len(prompt_width: int, max_new_tokens: int, slack: int) -> int:
    """Cache slots for prompts of this width: rounded up to 64 so nearby sizes share a program."""
    need = prompt_width + max_new_tokens + slack
    return int(-(-need // 64) * 64)


def run_ar(params: Any, cfg: ModelConfig, prompts: np.ndarray, lens: np.ndarray, *, max_new_tokens: int,
           sampling: SamplingParams, stop_tokens: tuple[int, ...], seed: int = 0, max_len: int | None = None,
           impl: Impl = Impl(), stage: Callable[[str], None] | None = None) -> TimedGeneration:
    max_len = max_len or default_max_len(prompts.shape[1], max_new_tokens, 1)
    check_prompts(lens, prompts.shape[1], max_new_tokens, max_len, cfg=cfg, itemsize=_itemsize(params))
    return timed_call(generate_ar, params, cfg, jnp.asarray(prompts), jnp.asarray(lens), jax.random.key(seed),
                      max_new_tokens=max_new_tokens, max_len=max_len, sampling=sampling,
                      stop_tokens=stop_tokens, impl=impl, stage=stage)


def run_speculative(params: Any, cfg: ModelConfig, dparams: Any, dcfg: Any, prompts: np.ndarray,
                    lens: np.ndarray, settings: Any, *, seed: int = 0, max_len: int | None = None,
                    impl: Impl = Impl(), stage: Callable[[str], None] | None = None) -> TimedGeneration:
    from dflash_jax.speculative import speculative_program

    slack = settings.cache_slack()
    max_len = max_len or default_max_len(prompts.shape[1], settings.max_new_tokens, slack)
    check_prompts(lens, prompts.shape[1], settings.max_new_tokens, max_len, slack=slack, cfg=cfg, dcfg=dcfg,
                  itemsize=_itemsize(params))
    return timed_call(speculative_program(settings), params, cfg, dparams, dcfg, jnp.asarray(prompts),
                      jnp.asarray(lens), jax.random.key(seed), settings=settings, max_len=max_len, impl=impl,
                      stage=stage)
