"""Benchmarks (dflash_jax.evaluate) and the make-data / train / bench command lines."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_jax import evaluate as ev
from dflash_jax.cli import build_parser
from tests.spec_models import convert_pair, drafter_model, target_model

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def test_load_bench_prompts(tmp_path):
    gsm = tmp_path / "gsm8k" / "test.jsonl"
    gsm.parent.mkdir()
    gsm.write_text(json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    spec = tmp_path / "spec_bench" / "question.jsonl"
    spec.parent.mkdir()
    spec.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"t{i}", "second"]}) + "\n"
                            for i, c in enumerate(["writing", "math", "writing"])))
    (g,) = ev.load_bench_prompts(gsm)
    assert g.text == "What is 2+2?" + ev.MATH_SUFFIX and g.category == "math"
    rows = ev.load_bench_prompts(spec, limit=2)
    assert [(r.text, r.category) for r in rows] == [("t0", "writing"), ("t1", "math")]
    assert ev.load_bench_prompts(gsm, math_suffix="never")[0].text == "What is 2+2?"
    assert ev.load_bench_prompts(spec, math_suffix="always")[0].text == "t0" + ev.MATH_SUFFIX
    if SHARED.is_dir():
        assert len(ev.load_bench_prompts(SHARED / "spec_bench" / "question.jsonl")) == 480
        assert ev.load_bench_prompts(SHARED / "gsm8k" / "test.jsonl", limit=128)[0].text.endswith(ev.MATH_SUFFIX)


def test_load_bench_files_takes_several_files_and_row_limits(tmp_path):
    gsm = tmp_path / "gsm8k" / "test.jsonl"
    gsm.parent.mkdir()
    gsm.write_text("".join(json.dumps({"question": f"q{i}", "answer": "1"}) + "\n" for i in range(5)))
    code = tmp_path / "code_heldout.jsonl"
    code.write_text("".join(json.dumps({"instruction": f"c{i}", "category": "code"}) + "\n" for i in range(3)))
    other = tmp_path / "chat" / "rows.jsonl"
    other.parent.mkdir()
    other.write_text(json.dumps({"instruction": "hello"}) + "\n")
    rows = ev.load_bench_files([f"{gsm}:2", code, other], math_suffix="never")
    assert [(r.text, r.category) for r in rows] == [("q0", "math"), ("q1", "math"), ("c0", "code"),
                                                    ("c1", "code"), ("c2", "code"), ("hello", "chat")]
    assert [r.text for r in ev.load_bench_files([gsm, f"{code}:3"], limit=1, math_suffix="never")] == ["q0", "c0"]
    # A category two files share is reported per file, not pooled.
    bench = tmp_path / "spec_bench" / "question.jsonl"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"turns": ["m"], "category": "math"}) + "\n"
                     + json.dumps({"turns": ["w"], "category": "writing"}) + "\n")
    rows = ev.load_bench_files([f"{gsm}:1", bench, code], math_suffix="never")
    assert [(r.text, r.category) for r in rows] == [("q0", "gsm8k/math"), ("m", "spec_bench/math"),
                                                    ("w", "writing"), ("c0", "code"), ("c1", "code"),
                                                    ("c2", "code")]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        ev.load_bench_files([tmp_path / "missing.jsonl:4"])
    with pytest.raises(ValueError, match="no prompt file"):
        ev.load_bench_files([])


def test_method_specs():
    names = [s.name for s in ev.method_specs(["dflash", "ddtree"], [16, 64], 16)]
    assert names == ["ar", "dflash(bs=16)", "ddtree(bs=16,budget=16)", "ddtree(bs=16,budget=64)"]
    assert [s.name for s in ev.method_specs(["ar"], [], 16)] == ["ar"]
    with pytest.raises(ValueError, match="budget"):
        ev.method_specs(["ddtree"], [], 16)


def test_bench_tokens_reports_tau_speed_and_categories(tmp_path):
    """AR and DFlash on a tiny pair: greedy outputs agree, tau >= 1, per-category records, plots."""
    cfg, params, dcfg, dparams = convert_pair(target_model(vocab=8), drafter_model(4, vocab=8), tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8, int(rng.integers(3, 10))).tolist() for _ in range(3)]
    specs = ev.method_specs(["dflash"], [], 4)
    report = ev.bench_tokens(params, cfg, prompts, ["a", "b", "a"], specs, dparams=dparams, dcfg=dcfg,
                             max_new_tokens=16, width_multiple=16, progress=False)
    ar, df = report["methods"]["ar"], report["methods"]["dflash(bs=4)"]
    assert ar["tokens"] == df["tokens"] == 3 * 16 and ar["speedup_over_ar"] == 1.0
    assert df["matches_ar"] == 1.0 and 1.0 <= df["tau"] <= 4.0
    assert set(df["by_category"]) == {"a", "b"} and df["by_category"]["a"]["prompts"] == 2
    assert df["speedup_over_ar"] > 0 and "tau" in df["by_category"]["b"]
    paths = ev.plot_report(report, tmp_path / "plots")
    assert [p.name for p in paths] == ["tau_by_category.png", "speed.png"]
    json.dumps(report)


def test_cli_parsers():
    parser = build_parser()
    a = parser.parse_args(["train", "--out", "runs/x", "--steps", "100", "--layers", "2", "--resume"])
    # Unset shape flags stay None: a fresh run fills in 16 / 3, `--init` the drafter's own.
    assert (a.steps, a.layers, a.resume, a.batch, a.block_size, a.init) == (100, 2, True, None, None, None)
    a = parser.parse_args(["make-data", "--out", "d.npz", "--limit", "5"])
    assert (a.target, a.limit, a.gen_tokens) == ("smollm2", 5, 256)
    a = parser.parse_args(["bench", "--method", "dflash", "ddtree", "--prompts", "p.jsonl", "--draft", "d",
                           "--budget", "16", "64", "256", "--limit", "128"])
    assert (a.method, a.budget, a.max_new_tokens, a.limit) == (["dflash", "ddtree"], [16, 64, 256], 256, 128)


def test_bench_cli_reports_tau_by_category_over_several_files(tmp_path, capsys):
    """One `bench` over a gsm8k-like set (math), spec_bench-like rows (their categories) and the
    held-out code set: the JSON has every category, each with its own tau, and the table on
    stderr (and in --out) shows those same numbers."""
    from dflash_jax.cli import main
    from tests.test_bad_input import VOCAB, WORDS, save_tokenizer

    tiny = tmp_path / "tiny"
    target_model(vocab=VOCAB).save_pretrained(tiny)
    save_tokenizer(tiny, WORDS)
    draft = tmp_path / "draft"
    drafter_model(4, vocab=VOCAB).save_pretrained(draft)
    gsm = tmp_path / "gsm8k" / "test.jsonl"
    gsm.parent.mkdir()
    gsm.write_text("".join(json.dumps({"question": f"w{i} w2 w3", "answer": "4"}) + "\n" for i in range(3)))
    spec = tmp_path / "spec_bench" / "question.jsonl"
    spec.parent.mkdir()
    spec.write_text("".join(json.dumps({"category": c, "turns": [f"w{i} w5", "w6"]}) + "\n"
                            for i, c in enumerate(["writing", "coding", "writing"])))
    code = tmp_path / "code_heldout.jsonl"
    code.write_text("".join(json.dumps({"instruction": f"w7 w{i}", "category": "code"}) + "\n" for i in range(2)))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(tiny), "--draft", str(draft), "--method", "dflash", "ddtree",
                 "--budget", "4", "--prompts", f"{gsm}:2", str(spec), str(code), "--max-new-tokens", "8",
                 "--batch", "4", "--out", str(out), "--no-progress", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["prompts_files"] == [f"{gsm}:2", str(spec), str(code)] and report["num_prompts"] == 7
    names = ["dflash(bs=4)", "ddtree(bs=4,budget=4)"]
    for name in names:
        rec = report["methods"][name]
        cats = rec["by_category"]
        assert {c: v["prompts"] for c, v in cats.items()} == {"math": 2, "writing": 2, "coding": 1, "code": 2}
        assert rec["matches_ar"] == 1.0 and all(1.0 <= v["tau"] <= 4.0 for v in cats.values())
        # Pooled tau = all committed tokens over all rounds; the category mean weighs each alike.
        assert rec["tau"] == pytest.approx(sum(v["tau"] * v["rounds"] for v in cats.values()) / rec["rounds"])
        assert rec["tau_category_mean"] == pytest.approx(np.mean([v["tau"] for v in cats.values()]))
    table = (out / "tau_by_category.md").read_text()
    assert table in captured.err
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:]}
    assert list(rows) == ["math", "writing", "coding", "code", "all", "category mean"]
    for cat in ("math", "writing", "coding", "code"):
        want = [str(report["methods"]["ar"]["by_category"][cat]["prompts"])]
        want += [f"{report['methods'][n]['by_category'][cat]['tau']:.2f}" for n in names]
        assert rows[cat] == want
    assert rows["category mean"][1:] == [f"{report['methods'][n]['tau_category_mean']:.2f}" for n in names]
