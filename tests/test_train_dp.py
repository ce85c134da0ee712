"""Data-parallel drafter training (`train(..., dp=2)`, `dflash-jax train --dp 2`) on fake CPU devices.

conftest.py gives jax 4 CPU devices. The runs reuse test_train's tiny target, drafter, data and
TrainConfig (so the dp = 1 step is the one test_train compiles), with validation and keep-best
on, so evaluation under dp is exercised by every run.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dflash_jax import train as tr
from dflash_jax.cli import _train_dp, main
from tests.test_train import (target,  # noqa: F401 (a fixture)
                              TC, VAL, assert_loss_falls, assert_refused_before_writing, assert_states_close,
                              forbid_loading, mesh_run_setup, paired_sequences, recording_first_inputs,
                              stop_and_resume, time_boxed)


@pytest.fixture(scope="module")
def dp_runs(target, tmp_path_factory):
    """dp = 1 and dp = 2 from the same seed; dp = 2 stopped at step 5 and resumed at dp = 2; and a
    dp = 1 run stopped at step 5 whose train_run.json is stripped of "dp" (an old record), resumed at dp = 2.

    The uninterrupted dp = 2 run records the layout of the first training batch and state
    train_step receives, and of the first validation batch.
    """
    _, cfg, params = target
    dcfg, data, kw = mesh_run_setup(cfg)
    seen: dict[str, object] = {}
    one = tr.train(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp1"), dp=1, **kw)
    with recording_first_inputs(seen):
        two = tr.train(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp2"), dp=2, **kw)
    part, resumed = stop_and_resume(params, cfg, dcfg, data, TC, tmp_path_factory.mktemp("dp2_resumed"), 5,
                                    dp=2, **kw)
    switch_dir = tmp_path_factory.mktemp("dp1_then_dp2")
    tr.train(params, cfg, dcfg, data, TC, switch_dir, dp=1, stop_at=5, **kw)
    run_file = switch_dir / tr.RUN_FILE
    old = json.loads(run_file.read_text())
    del old["dp"], old["result"]["dp"]  # as written before --dp existed
    run_file.write_text(json.dumps(old))
    switched = tr.train(params, cfg, dcfg, data, TC, switch_dir, dp=2, resume=True, **kw)
    return dict(one=one, two=two, part=part, resumed=resumed, switched=switched, seen=seen)


def test_dp2_trains_the_same_drafter_as_dp1(dp_runs):
    one, two = dp_runs["one"], dp_runs["two"]
    assert int(two.state.step) == TC.steps
    # Same anchors and data order; only the float32 reduction order of the batch sums differs.
    assert_states_close(two.state, one.state, rel=1e-5)
    losses = assert_loss_falls(two.history, TC.steps)
    np.testing.assert_allclose(losses, [r["loss"] for r in one.history], rtol=1e-5)
    # Validation under dp: the same metrics at the same steps, and the same kept step.
    v1 = {r["step"]: r for r in one.history if "val_loss" in r}
    v2 = {r["step"]: r for r in two.history if "val_loss" in r}
    assert sorted(v2) == sorted(v1) == [3, 6, 9, 12]
    for s in v1:
        assert v2[s]["val_loss"] == pytest.approx(v1[s]["val_loss"], rel=1e-5)
        np.testing.assert_allclose(v2[s]["val_acc_by_pos"], v1[s]["val_acc_by_pos"], atol=1e-6)
    assert two.best_step == one.best_step is not None
    # The exported drafter is the kept step's parameters (export and keep-best work under dp).
    assert two.export_dir is not None and (two.export_dir / "model.safetensors").is_file()


def test_dp2_state_is_replicated_and_the_batch_split(dp_runs):
    seen, two, resumed = dp_runs["seen"], dp_runs["two"], dp_runs["resumed"]
    # Every state array is whole on both devices: going in, coming out, and restored from a checkpoint.
    for state in (seen["state_in"], two.state, resumed.state, dp_runs["switched"].state):
        for leaf in jax.tree.leaves(state):
            assert len(leaf.sharding.device_set) == 2 and leaf.sharding.is_fully_replicated, leaf.sharding
            assert all(s.data.shape == leaf.shape for s in leaf.addressable_shards)
    # Batch arrays (training and validation): each device holds batch / 2 rows.
    for batch in (seen["batch"], seen["val_batch"]):
        for name, arr in batch.items():
            assert arr.shape[0] == TC.batch_size and len(arr.sharding.device_set) == 2, name
            shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start)
            assert [s.data.shape[0] for s in shards] == [TC.batch_size // 2] * 2, name
            np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in shards]), np.asarray(arr))
    record = json.loads((two.out_dir / tr.RUN_FILE).read_text())
    assert record["dp"] == 2 and record["result"]["dp"] == 2
    assert json.loads((dp_runs["one"].out_dir / tr.RUN_FILE).read_text())["dp"] == 1


def test_dp2_resumed_equals_uninterrupted(dp_runs):
    two, part, resumed = dp_runs["two"], dp_runs["part"], dp_runs["resumed"]
    assert int(part.state.step) == 5 and part.export_dir is None
    assert int(resumed.state.step) == TC.steps
    assert_states_close(resumed.state, two.state, rel=1e-6)
    np.testing.assert_allclose([r["loss"] for r in resumed.history], [r["loss"] for r in two.history], rtol=1e-6)
    assert resumed.best_step == two.best_step


def test_resume_at_another_dp_from_an_old_record(dp_runs):
    """A dp = 1 checkpoint (its train_run.json without "dp") resumes at dp = 2: same run as dp = 1."""
    one, switched = dp_runs["one"], dp_runs["switched"]
    assert int(switched.state.step) == TC.steps
    assert_states_close(switched.state, one.state, rel=1e-5)
    assert json.loads((switched.out_dir / tr.RUN_FILE).read_text())["dp"] == 2  # this call's dp


def test_time_limit_under_dp(target, tmp_path):
    out = time_boxed(target, tmp_path, paired_sequences(), dp=2, **VAL)
    assert int(out.state.step) == 1 and out.best_step == 1 and out.summary["exported_step"] == 1


@pytest.mark.parametrize("dp,batch,message", [
    (3, 4, r"batch_size \(--batch\) = 4 is not divisible by dp \(--dp\) = 3"),
    (8, 4, r"dp \(--dp\) = 8 needs 8 devices, but only 4 cpu device\(s\) are available"),
    (0, 4, r"dp \(--dp\) must be >= 1, got 0"),
])
def test_bad_dp_gives_one_clear_error(target, tmp_path, dp, batch, message):
    tc = tr.TrainConfig(**{**TC.to_dict(), "batch_size": batch})
    assert_refused_before_writing(target, tmp_path / "run", message, tc, dp=dp)


@pytest.mark.parametrize("argv,message", [
    (["--dp", "3", "--batch", "4"], "--batch) = 4 is not divisible by dp (--dp) = 3"),
    (["--dp", "8", "--batch", "8"], "(--dp) = 8 needs 8 devices, but only 4 cpu device(s)"),
])
def test_cli_bad_dp_is_refused_before_loading(argv, message, tmp_path, capsys, monkeypatch):
    forbid_loading(monkeypatch, "--dp")
    assert main(["train", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("error") == 1 and message in err


def test_cli_dp_default_on_resume():
    assert _train_dp(None, None) == 1  # a fresh run
    assert _train_dp(None, {"train_config": {}}) == 1  # a run recorded before --dp existed
    assert _train_dp(None, {"dp": 2}) == 2  # the run's own dp
    assert _train_dp(4, {"dp": 2}) == 4  # an explicit --dp wins (checkpoints are whole arrays)
