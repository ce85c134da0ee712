"""The GGUF tokenizer built from the file's metadata (convert.gguf_file.gguf_tokenizer).

Two references:
- transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which
  needs torch);
- a plain-Python byte-level BPE written here from the rules llama.cpp applies for each
  `tokenizer.ggml.pre` (regex splits, GPT-2's byte-to-unicode map, lowest-rank merge first).

transformers ignores `tokenizer.ggml.pre`: for SmolLM2 ("smollm": every digit is its own piece
before GPT-2's split, as in the model's own tokenizer.json) it applies GPT-2's split alone. The
two differ only where a run of whitespace precedes a digit ("a  1": ours and llama.cpp give
[a, "  ", 1], transformers [a, " ", " ", 1]). The tests pin that: the Python reference with the
"smollm" splits equals ours on every string, and with GPT-2's split alone equals transformers'.
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex

from convert.checkpoint import load_checkpoint_tokenizer
from convert.gguf_file import _GPT2_SPLIT, _PRE_TOKENIZERS, gguf_tokenizer, smollm2_gguf_path
from convert.layout import ConversionError

TEXTS = [
    "Hello world",
    "Give me three tips for a good night's sleep.",
    "Natalia sold clips to 48 of her friends in April, and then 24 in May.",
    "  1. first\n   2. second\n\n\n3) third",  # whitespace runs before digits
    "a  1 b\t\t42 c \n 7",
    "3.14159 + 2,718 = 12345678901",
    "héllo wörld — ünïcödé 日本語 한국어 🙂👍🏽",
    "don't you'll I'M we'D they've",
    "    def f(x):\n        return x  # trailing   \n",
    "Hello , world ! ( spaced ) punctuation ...",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "",
    " ",
    "\n\n",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List  3  primes:\n 1."}],
    [{"role": "user", "content": "Translate 'chat' to Français, s'il vous plaît."},
     {"role": "assistant", "content": "« chat » → cat"}, {"role": "user", "content": "And 42?"}],
]


@pytest.fixture(scope="module")
def ours():
    return gguf_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ----------------------------------------------------------------------------- plain-Python BPE

@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _split(pieces: list[str], pattern: str) -> list[str]:
    """Each piece cut into the regex's matches and the text between them (both kept)."""
    out = []
    for piece in pieces:
        at = 0
        for m in regex.finditer(pattern, piece):
            if m.start() > at:
                out.append(piece[at:m.start()])
            if m.end() > m.start():
                out.append(m.group())
            at = m.end()
        if at < len(piece):
            out.append(piece[at:])
    return out


def _merge(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    while len(word) > 1:
        best = min(range(len(word) - 1), key=lambda i: ranks.get((word[i], word[i + 1]), 1 << 30))
        pair = (word[best], word[best + 1])
        if pair not in ranks:
            break
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                merged.append(word[i] + word[i + 1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return word


def python_bpe(text: str, tokens: list[str], merges: list[str], specials: list[str],
               splits: tuple[str, ...]) -> list[int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    special_re = "(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids = []
    for part in regex.split(special_re, text):
        if part in vocab and part in specials:
            ids.append(vocab[part])
            continue
        pieces = [part] if part else []
        for pattern in splits:
            pieces = _split(pieces, pattern)
        for piece in pieces:
            chars = [_byte_to_char()[b] for b in piece.encode("utf-8")]
            ids += [vocab[t] for t in _merge(chars, ranks)]
    return ids


@pytest.fixture(scope="module")
def smollm2_meta():
    reader = gguf.GGUFReader(smollm2_gguf_path())
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [str(m) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    return tokens, merges, [t for t, ty in zip(tokens, types) if ty == 3]


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_the_pre_tokenizer_rule_and_transformers(ours, reference, smollm2_meta, text):
    tokens, merges, specials = smollm2_meta
    got = ours(text)["input_ids"]
    assert got == python_bpe(text, tokens, merges, specials, _PRE_TOKENIZERS["smollm"][0])
    # The Python BPE is right where transformers applies the same rule (GPT-2's split alone).
    assert reference(text)["input_ids"] == python_bpe(text, tokens, merges, specials, (_GPT2_SPLIT,))
    if not regex.search(r"\s\s\p{N}|[^\S ]\p{N}", text):
        assert got == reference(text)["input_ids"]


def test_the_digit_rule_is_exercised(ours, reference):
    # Guards the test above: a text where the two rules differ must actually differ.
    text = "a  1"
    assert ours(text)["input_ids"] != reference(text)["input_ids"]
    assert ours.convert_ids_to_tokens(ours(text)["input_ids"]) == ["a", "ĠĠ", "1"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, reference, text):
    ids = reference(text)["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours(text)["input_ids"]) == text


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_matches_transformers(ours, reference, chat):
    def ids(tok):
        out = tok.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    text = ours.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=False)
    assert text == reference.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids(ours) == ours(text, add_special_tokens=False)["input_ids"]
    if not regex.search(r"\s\s\p{N}|[^\S ]\p{N}", text):
        assert ids(ours) == ids(reference)


def test_special_tokens_come_from_the_metadata(ours, smollm2_meta):
    tokens, _, specials = smollm2_meta
    assert len(ours) == len(tokens) == 49152
    # tokenizer.ggml.eos_token_id is <|im_end|> (transformers' GGUF tokenizer reports <|im_start|>).
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert sorted(t.content for t in ours.added_tokens_decoder.values() if t.special) == sorted(specials)
    assert ours("<|im_end|>")["input_ids"] == [tokens.index("<|im_end|>")]
    assert ours("hi")["input_ids"] == ours("hi", add_special_tokens=False)["input_ids"]  # add_bos_token false


def test_checkpoint_round_trip(ours, tmp_path):
    ours.save_pretrained(str(tmp_path / "tokenizer"))
    back = load_checkpoint_tokenizer(tmp_path)
    for text in TEXTS:
        assert back(text)["input_ids"] == ours(text)["input_ids"]
    assert back.chat_template == ours.chat_template and back.eos_token == ours.eos_token


# ----------------------------------------------------------------------------- other files

def _write_gguf(path: Path, *, model: str = "gpt2", pre: str | None = "qwen2", add_bos: bool = False,
                tokens: list[str] | None = None, merges: list[str] | None = None,
                types: list[int] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    chars = sorted(set(_byte_to_char().values()))
    tokens = tokens or [*chars, "Ġt", "he", "Ġthe", "11", "111", "<|im_end|>", "<tool_call>"]
    w.add_token_list(tokens)
    w.add_token_types(types or [1] * (len(tokens) - 2) + [3, 4])
    w.add_token_merges(merges if merges is not None else ["Ġ t", "h e", "Ġt he", "1 1", "11 1"])
    w.add_bos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_other_pre_tokenizers_follow_their_rule(tmp_path, pre):
    path = _write_gguf(tmp_path / "t.gguf", pre=pre)
    tok = gguf_tokenizer(path)
    reader = gguf.GGUFReader(path)
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    merges = [str(m) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    for text in ["the theme 1111 11111", "x\n\n  the<|im_end|>1<tool_call>", "it's  Ünï 42\r\n\tthe"]:
        want = python_bpe(text, tokens, merges, ["<|im_end|>", "<tool_call>"], _PRE_TOKENIZERS[pre][0])
        assert tok(text)["input_ids"] == want
        assert tok.decode(tok(text)["input_ids"]) == text
    # Qwen2 cuts digits one by one, Llama 3 in threes; GPT-2 leaves the run whole to the merges.
    digits = tok.convert_ids_to_tokens(tok("11111")["input_ids"])
    assert digits == {"qwen2": ["1"] * 5, "llama-bpe": ["111", "11"], "gpt-2": ["11", "111"]}[pre]
    assert tok.decode(tok("a<tool_call>b<|im_end|>")["input_ids"], skip_special_tokens=True) == "a<tool_call>b"


def test_qwen2_matches_transformers(tmp_path):
    # transformers builds a qwen3-architecture GGUF's tokenizer with Qwen2's own split rule, so
    # here it is a reference for "qwen2" as well.
    from transformers import AutoTokenizer

    chars = sorted(set(_byte_to_char().values()))
    tokens = [*chars, "Ġt", "he", "Ġthe", "11", "111", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = _write_gguf(tmp_path / "q.gguf", pre="qwen2", tokens=tokens, types=[1] * (len(tokens) - 3) + [3, 3, 3])
    ours = gguf_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS + ["the theme 1111 11111", "x\n\n  the<|im_end|>1", "it's  Ünï 42\r\n\tthe"]:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
        ids = reference(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_llama3_takes_whole_vocabulary_words_before_merging(tmp_path):
    # "the" is in the vocabulary but no merge builds it from t + he: Llama 3's BPE (ignore_merges)
    # takes it whole, the others stop at the merges.
    chars = sorted(set(_byte_to_char().values()))
    tokens = [*chars, "he", "the", "<|im_end|>", "<tool_call>"]
    kw = dict(tokens=tokens, merges=["h e"])
    llama = gguf_tokenizer(_write_gguf(tmp_path / "l.gguf", pre="llama-bpe", **kw))
    qwen = gguf_tokenizer(_write_gguf(tmp_path / "q.gguf", pre="qwen2", **kw))
    assert llama.convert_ids_to_tokens(llama("the")["input_ids"]) == ["the"]
    assert qwen.convert_ids_to_tokens(qwen("the")["input_ids"]) == ["t", "he"]


def test_add_bos_token(tmp_path):
    tok = gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", add_bos=True))
    assert tok("the")["input_ids"][0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok("the", add_special_tokens=False)["input_ids"][0] != tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("kw, field", [
    (dict(model="llama"), "tokenizer.ggml.model='llama'"),
    (dict(pre="default"), "tokenizer.ggml.pre='default'"),
    (dict(pre=None), "tokenizer.ggml.pre=None"),
    (dict(merges=["Ġ t", "h e x"]), r"tokenizer.ggml.merges\[1\]"),
])
def test_unsupported_tokenizers_name_the_file_and_field(tmp_path, kw, field):
    path = _write_gguf(tmp_path / "bad.gguf", **kw)
    with pytest.raises(ConversionError, match=rf"bad\.gguf: {field}"):
        gguf_tokenizer(path)


def test_byte_map_covers_every_byte_once():
    assert len(set(_byte_to_char().values())) == 256
    assert np.all([_byte_to_char()[b] == chr(b) for b in b"Hello!"])
