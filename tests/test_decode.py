"""`dflash-jax decode`: batched bucketed decoding equals batch-1 decoding, resume loses and duplicates
nothing, a malformed input line is named, and `make demo`'s prompts decode through the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytest.importorskip("torch")

from dflash_jax import decode
from tests import spec_models

# Lengths 3..70 characters: two buckets of width 32, 64 and 96, with batches that need filling up.
PROMPTS = ["abc", "hello there", "a much longer prompt that crosses the first bucket, surely",
           "x" * 40, "q", "mid length prompt here", "y" * 70, "zz"]


class CharTokenizer:
    """One token per character (ids 1..VOCAB-2; the last id is the drafter's mask token)."""
    chat_template = None

    def __init__(self, vocab: int = spec_models.VOCAB):
        self.vocab = vocab

    def __call__(self, text):
        return {"input_ids": [1 + ord(c) % (self.vocab - 2) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def get_vocab(self):
        return {}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return spec_models.convert_pair(spec_models.target_model(), spec_models.drafter_model(block_size=4),
                                    tmp_path_factory.mktemp("pair"))


def _write_input(path: Path, prompts=PROMPTS) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "extra": i}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def _decode(pair, tmp_path, name, method="ar", batch=3, **kw):
    cfg, params, dcfg, dparams = pair
    out = tmp_path / f"{name}.jsonl"
    summary = decode.decode_file(params, cfg, CharTokenizer(), tmp_path / "in.jsonl", out, method=method,
                                 dparams=dparams, dcfg=dcfg, budget=6, batch=batch, max_new_tokens=12,
                                 progress=False, **kw)
    return summary, [json.loads(l) for l in out.read_text().splitlines()]


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_batched_equals_batch_one(pair, tmp_path, method):
    _write_input(tmp_path / "in.jsonl")
    summary, rows = _decode(pair, tmp_path, "b3", method, batch=3)
    _, single = _decode(pair, tmp_path, "b1", method, batch=1)
    assert summary["decoded"] == len(PROMPTS) and summary["skipped"] == 0
    assert summary["programs"] == 3  # one per bucket width (32, 64, 96), not one per batch
    by_id = {r["id"]: r for r in single}
    assert sorted(by_id) == sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(len(PROMPTS)))
    for r in rows:
        assert r["text"] == by_id[r["id"]]["text"] and r["num_tokens"] == by_id[r["id"]]["num_tokens"]
        assert r["prompt"] == PROMPTS[r["extra"]]  # the input row's fields are kept
        assert r["num_tokens"] == len(r["text"].split()) > 0
        assert (r["tau"] is None) == (method == "ar") and r["seconds"] > 0
    if method != "ar":  # lossless: the speculative answers are the AR answers
        _, ar = _decode(pair, tmp_path, "ar", "ar", batch=3)
        assert {r["id"]: r["text"] for r in ar} == {r["id"]: r["text"] for r in rows}
        assert all(r["tau"] >= 1 and r["rounds"] >= 1 for r in rows)


def test_hybrid_ar_batched_equals_batch_one(tmp_path):
    """A Qwen3.5-style hybrid target decodes AR through its own loop, batched as a dense one."""
    from convert import load_qwen35
    from tests.test_qwen3_5 import tiny_hf

    model = tiny_hf("interval4")
    model.save_pretrained(tmp_path / "hybrid")
    cfg, params = load_qwen35(tmp_path / "hybrid")
    _write_input(tmp_path / "in.jsonl", PROMPTS[:5])
    texts = {}
    for batch in (1, 3):
        out = tmp_path / f"h{batch}.jsonl"
        decode.decode_file(params, cfg, CharTokenizer(cfg.vocab_size), tmp_path / "in.jsonl", out, batch=batch,
                           max_new_tokens=10, progress=False)
        rows = [json.loads(l) for l in out.read_text().splitlines()]
        texts[batch] = {r["id"]: r["text"] for r in rows}
        assert len(rows) == 5 and all(r["num_tokens"] == len(r["text"].split()) > 0 for r in rows)
    assert texts[1] == texts[3]


class Killed(Exception):
    pass


def test_resume_loses_and_duplicates_nothing(pair, tmp_path):
    _write_input(tmp_path / "in.jsonl")
    _, whole = _decode(pair, tmp_path, "whole")
    seen = []

    def kill_after_two(rows):
        seen.append(rows)
        if len(seen) == 2:
            raise Killed

    with pytest.raises(Killed):
        _decode(pair, tmp_path, "part", on_batch=kill_after_two)
    out = tmp_path / "part.jsonl"
    first = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(first) == sum(len(r) for r in seen) < len(PROMPTS)
    with out.open("a") as f:  # a row torn by the kill, mid-write
        f.write('{"id": "p7", "prompt": "zz", "te')
    summary, rows = _decode(pair, tmp_path, "part")
    assert summary["skipped"] == len(first) and summary["decoded"] == len(PROMPTS) - len(first)
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in whole)  # each id once
    assert {r["id"]: r["text"] for r in rows} == {r["id"]: r["text"] for r in whole}
    assert rows[:len(first)] == first  # what was written before is kept as it was


def test_malformed_line_is_named_and_nothing_is_lost(pair, tmp_path):
    lines = [json.dumps({"id": "a", "prompt": "abc"}), json.dumps({"id": "b", "prompt": "de"}), "{not json",
             json.dumps({"id": "c", "prompt": "f"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "bad.jsonl"
    out.write_text(json.dumps({"id": "old", "text": "kept"}) + "\n")
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"in\.jsonl:3: not valid JSON"):
        _decode(pair, tmp_path, "bad")
    assert out.read_bytes() == before
    (tmp_path / "in.jsonl").write_text("\n".join([lines[0], json.dumps({"id": "b", "question": ""})]) + "\n")
    with pytest.raises(ValueError, match=r"in\.jsonl:2: no prompt"):
        _decode(pair, tmp_path, "bad")
    (tmp_path / "in.jsonl").write_text("\n".join([lines[0], lines[0]]) + "\n")
    with pytest.raises(ValueError, match=r"in\.jsonl:2: id 'a' repeats line 1"):
        _decode(pair, tmp_path, "bad")
    assert out.read_bytes() == before


def test_cli_malformed_line_exit_2(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n[1, 2]\n')
    res = subprocess.run([sys.executable, "-m", "dflash_jax.cli", "decode", "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl"), "--batch", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "in.jsonl:2: expected a JSON object" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_demo_prompts_decode_through_the_cli(tmp_path):
    """`make demo`'s two prompts, DDTree with the shipped drafter, then AR: the same answers."""
    demo = ["Give me three tips for a good night's sleep.",
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?"]
    src = _write_input(tmp_path / "in.jsonl", demo)
    texts = {}
    for method in ("ddtree", "ar"):
        out = tmp_path / f"{method}.jsonl"
        res = subprocess.run([sys.executable, "-m", "dflash_jax.cli", "decode", "--model", "smollm2", "--method",
                              method, "--draft", "smollm2", "--budget", "16", "--batch", "2", "--max-new-tokens",
                              "12", "--input", str(src), "--output", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        rows = [json.loads(l) for l in out.read_text().splitlines()]
        assert [r["id"] for r in rows] == ["p0", "p1"] and all(r["num_tokens"] == 12 for r in rows)
        texts[method] = [r["text"] for r in rows]
        assert all(t.strip() for t in texts[method])
    assert texts["ddtree"] == texts["ar"]


def _word_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids ("hi" is 1), saved beside a target for the CLI."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "hi"] + [f"w{i}" for i in range(vocab - 2)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_cli_decode_mtp_tree_equals_ar(tmp_path):
    """`decode --method mtp --draft HEAD --mtp-steps --mtp-budget` (a random head exported beside a
    tiny target) writes every row once, batches filled up, with AR's answers."""
    from convert.hf_safetensors import load_hf
    from convert.mtp import export_mtp
    from dflash_jax import cli, mtp

    target = tmp_path / "target"
    spec_models.target_model().save_pretrained(target)
    _word_tokenizer(spec_models.VOCAB).save_pretrained(target)
    cfg, _ = load_hf(target)
    export_mtp(mtp.init_mtp_params(cfg, jax.random.key(4)), cfg, tmp_path / "head")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["hi w1", "w3 w3 hi", "w7"])))
    texts = {}
    for method, extra in (("mtp", ["--draft", str(tmp_path / "head"), "--mtp-steps", "2", "--mtp-budget", "4"]),
                          ("ar", [])):
        out = tmp_path / f"{method}.jsonl"
        code = cli.main(["decode", "--model", str(target), "--method", method, *extra, "--batch", "2",
                         "--max-new-tokens", "10", "--input", str(src), "--output", str(out), "--no-progress"])
        assert code == 0
        rows = [json.loads(l) for l in out.read_text().splitlines()]
        assert [r["id"] for r in rows] == [0, 1, 2] and all(r["num_tokens"] == 10 for r in rows)
        assert all((r["tau"] is None) == (method == "ar") for r in rows)
        texts[method] = [r["text"] for r in rows]
        if method == "mtp":
            assert all(r["tau"] >= 1 for r in rows) and any(r["tau"] > 1 for r in rows)  # drafts accepted
    assert texts["mtp"] == texts["ar"]
    with pytest.raises(ValueError, match="method mtp needs an MTP head: dcfg must be an mtp.MTPConfig"):
        decode.decode_file(None, cfg, None, src, tmp_path / "bad.jsonl", method="mtp", dparams={}, dcfg=cfg)


def test_prompt_field_precedence():
    from dflash_jax.decode import prompt_text

    assert prompt_text({"instruction": "alpaca", "turns": ["t"]}, "x:1") == "alpaca"
    assert prompt_text({"question": "q", "instruction": "i"}, "x:1") == "q"
    assert prompt_text({"prompt": "p", "question": "q"}, "x:1") == "p"
    assert prompt_text({"turns": ["first", "second"]}, "x:1") == "first"
    with pytest.raises(ValueError, match=r"x:1: no prompt .*'instruction'"):
        prompt_text({"instruction": "  "}, "x:1")
