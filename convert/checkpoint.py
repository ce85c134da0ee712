"""Converted models on disk: orbax params + a JSON file with the config, for fast reloads.

Layout of a checkpoint directory:
    dflash_jax_model.json   marker + format version + ModelConfig + saved dtype (written LAST,
                            so a directory whose save was interrupted is never taken for a checkpoint;
                            `save_checkpoint` also writes into a temporary sibling renamed into place)
    params/                 orbax StandardCheckpointer tree of ModelParams, as checkpoints store
                            them (`model.checkpoint_specs`: q, k, v, gate, up apart), whatever
                            layout they are loaded into
    tokenizer/              optional, `tokenizer.save_pretrained` output
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from convert.hf_safetensors import target_layout
from convert.layout import ConversionError
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.files import bounded, check_writable
from dflash_jax.model import ModelParams, param_layout
from dflash_jax.params import Builder, extract, is_spec, layout_of, path_str

MARKER = "dflash_jax_model.json"
FORMAT = "dflash-jax/model-params"
VERSION = 1
# Longest wait for orbax to finish writing the params: it fails fast on a bad destination, but
# some of its failures leave it waiting forever.
SAVE_TIMEOUT_S = float(os.environ.get("DFLASH_JAX_SAVE_TIMEOUT_S", 600))
CLOSE_TIMEOUT_S = 10.0  # closing the writer after a save: nothing is left to write


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_dict(d: dict[str, Any], source: str) -> ModelConfig:
    """Inverse of config_to_dict; unknown or missing fields fail naming the file."""
    d = dict(d)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConversionError(f"{source}: unknown config fields {unknown} (written by a newer version?)")
    try:
        d["rope"] = RopeConfig(**d.get("rope", {}))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return ModelConfig(**d)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"{source}: bad config: {err}") from None


def _dtype_name(params: ModelParams) -> str:
    dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise ConversionError(f"params mix dtypes {sorted(dtypes)}; cast them to one first")
    return dtypes.pop()


def check_destination(path: str | Path, overwrite: bool = False) -> Path:
    """Refuses a checkpoint destination before any work: a file, a non-empty directory (unless
    `overwrite` and it is our checkpoint), or a place that cannot be written. -> absolute path."""
    path = Path(path).absolute()  # orbax wants absolute paths
    if path.exists() and not path.is_dir():
        raise ConversionError(f"{path}: destination exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise ConversionError(f"{path}: destination exists and is not empty (pass --overwrite to replace "
                                  f"a dflash-jax checkpoint)")
        if not is_checkpoint(path):
            # Refuse to delete a directory we did not write.
            raise ConversionError(f"{path}: destination is not a dflash-jax checkpoint; not overwriting it")
    check_writable(path.parent, "destination")
    return path


def save_checkpoint(path: str | Path, cfg: ModelConfig, params: ModelParams, tokenizer: Any = None,
                    *, overwrite: bool = False) -> Path:
    """Writes params (orbax), config (JSON) and optionally the tokenizer to directory `path`.

    params: as the loaders give them (the decoding layout, at any tp). The checkpoint stores the
    tensors as checkpoints store them (`model.checkpoint_specs`), so it loads at any tp.
    """
    layout = layout_of(params, [param_layout(cfg), param_layout(cfg, 2 * cfg.num_kv_heads)])
    if layout is None:
        raise ConversionError(f"{path}: the params hold none of the target's decoding layouts for this config")
    path = check_destination(path, overwrite)
    dtype = _dtype_name(params)
    sources = extract(layout, params)
    treedef = jax.tree.structure(layout.sources, is_leaf=is_spec)
    stored = jax.tree_util.tree_unflatten(treedef, list(sources.values()))
    # Everything is written into a temporary sibling that is renamed into place at the end: a
    # full disk or a crash leaves the old destination (or none), never a partial checkpoint
    # that blocks the retry; the partial sibling is removed on the way out.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        ckpt = ocp.StandardCheckpointer()
        try:
            ckpt.save(tmp / "params", stored)
            bounded(ckpt.wait_until_finished, SAVE_TIMEOUT_S, f"saving {path / 'params'}")
        finally:
            try:
                bounded(ckpt.close, CLOSE_TIMEOUT_S, f"closing the writer of {path / 'params'}")
            except TimeoutError:
                pass  # its threads wait on the failure being raised; the CLI exits without them
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype, "config": config_to_dict(cfg)}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if path.exists():
            # An empty directory, or (overwrite) our own checkpoint: moved aside, then removed.
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_meta(path: str | Path) -> tuple[ModelConfig, str]:
    """-> (config, saved dtype name) from a checkpoint directory's marker file."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise ConversionError(f"{path}: not a dflash-jax checkpoint ({MARKER} is missing)")
    try:
        meta = json.loads(marker.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{marker}: not valid JSON ({err})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ConversionError(f"{marker}: format {meta.get('format')!r} version {meta.get('version')!r} "
                              f"is not {FORMAT!r} version {VERSION}")
    return config_from_dict(meta["config"], str(marker)), meta["dtype"]


def load_checkpoint(path: str | Path, *, dtype: Any = None, mesh: Any = None) -> tuple[ModelConfig, ModelParams]:
    """Restores (config, params in the decoding layout). dtype: None keeps the saved dtype.

    mesh: as for `convert.hf_safetensors.load_hf`. The saved tensors are restored to host memory
    and then written into their slices of the decoding layout, as the other loaders do.
    """
    path = Path(path).absolute()
    cfg, saved_dtype = read_meta(path)
    dtype = jnp.dtype(dtype or saved_dtype)
    layout, sharding = target_layout(cfg, mesh)
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(saved_dtype), sharding=host),
                          layout.sources, is_leaf=is_spec)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            saved = ckpt.restore(path / "params", target)
    except Exception as err:  # orbax raises a variety of types for missing/mismatched arrays
        raise ConversionError(f"{path / 'params'}: cannot restore params: {err}") from err
    builder = Builder(layout, dtype, sharding)
    for (p, x) in jax.tree_util.tree_flatten_with_path(saved)[0]:
        builder.put(path_str(p), np.array(x))  # a copy: x's buffer is freed next
        x.delete()  # the host copy goes as soon as its slices are written
    return cfg, builder.finish()


def load_checkpoint_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved beside the params, or None."""
    tok_dir = Path(path) / "tokenizer"
    if not tok_dir.is_dir():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))
