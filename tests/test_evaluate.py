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
    assert g.text == "What is 2+2?" + ev.MATH_SUFFIX and g.category == "gsm8k"
    rows = ev.load_bench_prompts(spec, limit=2)
    assert [(r.text, r.category) for r in rows] == [("t0", "writing"), ("t1", "math")]
    assert ev.load_bench_prompts(gsm, math_suffix="never")[0].text == "What is 2+2?"
    assert ev.load_bench_prompts(spec, math_suffix="always")[0].text == "t0" + ev.MATH_SUFFIX
    if SHARED.is_dir():
        assert len(ev.load_bench_prompts(SHARED / "spec_bench" / "question.jsonl")) == 480
        assert ev.load_bench_prompts(SHARED / "gsm8k" / "test.jsonl", limit=128)[0].text.endswith(ev.MATH_SUFFIX)


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
