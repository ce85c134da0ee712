"""Checks on loaded models: every weight finite, every tokenizer id inside the vocabulary.

A NaN in one tensor, or a tokenizer whose ids run past the embedding table, otherwise decodes
to empty or garbage text with exit code 0. `convert.load_model` runs both checks at its end;
`check_weights=False` (CLI `--no-weight-check`) skips the weight pass, which reads every byte
once (about a second for an 8B model on a CPU host, milliseconds on a GPU).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from convert.layout import ConversionError
from dflash_jax.params import path_str

# The CLI's --no-weight-check sets this for every load_model call of its command.
CHECK_WEIGHTS_DEFAULT = True


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    """[len(leaves)] bool: whether each floating array holds only finite values."""
    return jnp.stack([jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.floating) else jnp.asarray(True)
                      for x in leaves])


def check_finite(params: Any, source: str) -> None:
    """Raises ConversionError naming `source` and the first tensors holding NaN or inf."""
    flat = [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if x is not None]
    if not flat:
        return
    ok = np.asarray(_all_finite([x for _, x in flat]))
    bad = [name for (name, _), good in zip(flat, ok) if not good]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConversionError(f"{source}: tensor {shown} holds NaN or inf values (a damaged file?); "
                              f"--no-weight-check skips this check")


def check_tokenizer(tokenizer: Any, vocab_size: int, source: str) -> None:
    """Raises ConversionError when the tokenizer can produce ids >= the model's vocab_size."""
    if tokenizer is None:
        return
    vocab = tokenizer.get_vocab()
    if not vocab:
        return
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    if top >= vocab_size:
        raise ConversionError(f"{source}: the tokenizer's id {top} ({token!r}) is outside the model's "
                              f"vocabulary of {vocab_size} (vocab_size): tokenizer and weights do not belong together")
