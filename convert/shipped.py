"""Artifacts trained by this project and shipped inside the package (`dflash_jax/drafters/`).

One table, by kind and short name, and one resolver that every command and loader reads a
name-or-path argument through: `--draft smollm2`, `--init smollm2`, `--mtp-head smollm2`.
"""
from __future__ import annotations

from pathlib import Path

import dflash_jax
from convert.layout import ConversionError

DFLASH = "dflash"  # a DFlash drafter directory (config.json + model.safetensors)
MTP = "mtp"  # an MTP head directory (mtp.safetensors, `convert.mtp.export_mtp`'s layout)

# kind -> short name -> directory under dflash_jax/drafters/.
SHIPPED: dict[str, dict[str, str]] = {
    DFLASH: {"smollm2": "smollm2-135m-instruct-b16"},
    MTP: {"smollm2": "smollm2-135m-instruct-mtp"},
}

_WHAT = {DFLASH: "DFlash drafter", MTP: "MTP head"}


def resolve_shipped(value: str | Path, kind: str, arg: str = "path") -> Path:
    """The directory `value` stands for: the shipped artifact of `kind` it names, else `value` itself
    as a path that exists (a directory or a file; the loader checks what it holds).

    kind: DFLASH or MTP. arg: the argument or flag that gave `value` ("--draft", "--init"), named
    in the error.
    Raises ConversionError (a ValueError) naming `arg`, the value and the known names when `value`
    is neither a shipped name nor an existing path.
    """
    if kind not in SHIPPED:
        raise ValueError(f"kind must be one of {sorted(SHIPPED)}, got {kind!r}")
    if str(value) in SHIPPED[kind]:
        return Path(dflash_jax.__file__).parent / "drafters" / SHIPPED[kind][str(value)]
    path = Path(value)
    if not path.exists():
        raise ConversionError(f"{arg} {value}: no such file or directory, and not the name of a shipped "
                              f"{_WHAT[kind]} (known: {', '.join(sorted(SHIPPED[kind]))})")
    return path
