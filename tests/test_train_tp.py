"""Tensor-parallel drafter training (`train(..., dp=2, tp=2)`, `dflash-jax train --tp 2`) on 4 fake CPU devices.

The frozen target is split over "tp" inside the (dp, tp) mesh; the drafter trains as under
"dp" alone. The runs reuse test_train's tiny dense target, drafter, data and TrainConfig, with
validation and keep-best on, so evaluation under tp is exercised too.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dflash_jax import train as tr
from dflash_jax.cli import _train_dp, _train_tp, main
from tests.test_train import (target,  # noqa: F401 (a fixture)
                              TC, assert_loss_falls, assert_refused_before_writing, assert_states_close,
                              forbid_loading, make_dcfg, mesh_run_setup, numpy_init, paired_sequences,
                              recording_first_inputs, stop_and_resume)

# tp splits each row-parallel product (o_proj, down, the vocab-parallel embedding and LM head)
# into partial sums that an all-reduce adds: only the float32 summation order differs.
REL = 1e-5


@pytest.fixture(scope="module")
def tp_runs(target, tmp_path_factory):
    """From the same seed: dp = 2 x tp = 2 (recording the target train_step receives), dp = 2 x
    tp = 1 and dp = 4; and dp = 2 x tp = 2 stopped at step 5, resumed at dp = 4 x tp = 1."""
    _, cfg, params = target
    dcfg, data, kw = mesh_run_setup(cfg)
    seen: dict[str, object] = {}
    with recording_first_inputs(seen):
        tp2 = tr.train(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp2tp2"), dp=2, tp=2, **kw)
    tp1 = tr.train(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp2tp1"), dp=2, tp=1, **kw)
    dp4 = tr.train(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp4"), dp=4, **kw)
    part, switched = stop_and_resume(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("tp2_then_dp4"), 5,
                                     resume_with=dict(dp=4, tp=1), dp=2, tp=2, **kw)
    return dict(tp2=tp2, tp1=tp1, dp4=dp4, part=part, switched=switched, seen=seen, cfg=cfg)


def test_tp2_trains_the_same_drafter_as_tp1(tp_runs):
    tp2 = tp_runs["tp2"]
    assert int(tp2.state.step) == TC.steps
    losses = assert_loss_falls(tp2.history, TC.steps)
    for ref in (tp_runs["tp1"], tp_runs["dp4"]):
        assert_states_close(tp2.state, ref.state, rel=REL)
        np.testing.assert_allclose(losses, [r["loss"] for r in ref.history], rtol=REL)
        v_ref = {r["step"]: r["val_loss"] for r in ref.history if "val_loss" in r}
        v_tp2 = {r["step"]: r["val_loss"] for r in tp2.history if "val_loss" in r}
        assert sorted(v_tp2) == sorted(v_ref) == [3, 6, 9, 12]
        np.testing.assert_allclose([v_tp2[s] for s in v_ref], list(v_ref.values()), rtol=REL)
        assert tp2.best_step == ref.best_step


def test_tp2_splits_the_target_and_replicates_the_drafter(tp_runs):
    seen, cfg = tp_runs["seen"], tp_runs["cfg"]
    target = seen["target"]
    layer = target.layers[0]
    # The decoding layout's tensor-parallel specs: heads / MLP / vocabulary over "tp", whole over "dp".
    assert layer.attn.qkv.sharding.spec == P(None, "tp", None, None), layer.attn.qkv.sharding
    assert layer.attn.o.sharding.spec[0] == "tp", layer.attn.o.sharding
    assert layer.mlp.gate_up.sharding.spec == P(None, None, "tp")
    assert layer.mlp.down.sharding.spec == P("tp", None)
    assert target.embed.sharding.spec == P("tp", None)
    assert layer.attn_norm.sharding.is_fully_replicated
    qkv_shards = {s.data.shape for s in layer.attn.qkv.addressable_shards}
    assert qkv_shards == {(cfg.hidden_size, cfg.num_kv_heads // 2, cfg.group_size + 2, cfg.head_dim)}
    for leaf in jax.tree.leaves(seen["state_in"]):
        assert len(leaf.sharding.device_set) == 4 and leaf.sharding.is_fully_replicated, leaf.sharding
    record = json.loads((tp_runs["tp2"].out_dir / tr.RUN_FILE).read_text())
    assert (record["dp"], record["tp"]) == (2, 2) and record["result"]["tp"] == 2


def test_resume_a_tp2_run_at_dp4(tp_runs):
    """Checkpoints hold whole arrays: a dp 2 x tp 2 run resumes at dp 4 x tp 1 as the same run."""
    part, switched = tp_runs["part"], tp_runs["switched"]
    assert int(part.state.step) == 5 and int(switched.state.step) == TC.steps
    assert_states_close(switched.state, tp_runs["tp2"].state, rel=REL)
    assert json.loads((switched.out_dir / tr.RUN_FILE).read_text())["tp"] == 1  # this call's tp


@pytest.mark.parametrize("dp,tp,message", [
    (1, 3, r"tp \(--tp\) = 3 does not divide this process's 4 cpu device\(s\)"),
    (4, 2, r"dp \(--dp\) = 4 x tp \(--tp\) = 2 needs 8 devices, but only 4"),
    (1, 0, r"tp \(--tp\) must be >= 1, got 0"),
])
def test_bad_tp_gives_one_clear_error(target, tmp_path, dp, tp, message):
    assert_refused_before_writing(target, tmp_path / "run", message, dp=dp, tp=tp)


def test_tp_that_does_not_split_the_heads_is_refused(target, tmp_path):
    import dataclasses

    wide = dataclasses.replace(target[1], num_heads=6)  # 6 q heads over tp = 4
    assert_refused_before_writing(target, tmp_path / "run", r"tp \(--tp\) = 4 does not fit the target: .*num_heads=6",
                                  cfg=wide, tp=4)


def test_cli_bad_tp_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    forbid_loading(monkeypatch, "--tp")
    assert main(["train", "--out", str(tmp_path), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "tp (--tp) = 3 does not divide this process's 4 cpu device(s)" in err


def test_cli_tp_default_on_resume():
    assert _train_tp(None, None) == 1
    assert _train_tp(None, {"dp": 2}) == 1  # a run recorded before --tp existed
    assert _train_tp(None, {"tp": 2}) == 2
    assert _train_tp(4, {"tp": 2}) == 4
    assert _train_dp(None, {"dp": 2}, tp=2) == 2


def test_cli_tp_that_does_not_split_the_heads_is_one_error(tmp_path, capsys):
    """6 q heads over --tp 4: refused while the target is read onto its shards, naming --tp and the heads."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=64)).save_pretrained(tmp_path / "six_heads")
    argv = ["train", "--target", str(tmp_path / "six_heads"), "--out", str(tmp_path / "run"), "--tp", "4",
            "--batch", "4", "--data-gen"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "tp (--tp) = 4 does not fit the target" in err and "=6" in err, err


def test_train_step_bench_at_tp2(tmp_path):
    """`bench/train_step.py --tp 2` (runbook phase train-step with TS_TP=2) on the tiny hybrid:
    both ways timed with the target split over 2 devices."""
    from dflash_jax.bench import train_step as bench

    record = bench.run("tiny-hybrid", 2, 2, 64, 4, 4, 2, 2, str(tmp_path / "taps"), ("in-step", "disk"), tp=2)
    assert record["tp"] == 2 and sorted(record["modes"]) == ["disk", "in-step"]
    assert all(r["tokens_per_s"] > 0 for r in record["modes"].values())
    assert "at tp 2" in bench.table(record)
    with pytest.raises(ValueError, match=r"tp \(--tp\) = 3 does not divide"):
        bench.run("tiny-hybrid", 2, 2, 64, 4, 4, 2, 2, None, ("in-step",), tp=3)


def test_measure_taps_at_tp2(target):
    """`train --measure-taps --tp 2`'s timing (`time_step_parts`) with the target split over 2 devices."""
    _, cfg, params = target
    times = tr.time_step_parts(params, cfg, make_dcfg(cfg), paired_sequences(), TC, numpy_init(make_dcfg(cfg)),
                               repeats=1, tp=2)
    assert times["taps_s"] > 0 and times["step_s"] > 0
