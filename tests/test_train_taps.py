"""Taps written once to disk (`train_data.TapStore`) and streamed back into `train.train_step`,
and the throughput tool that weighs the two (`bench/train_step.py`, runbook phase train-step)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import train as tr
from dflash_jax.bench.common import SHAPES
from dflash_jax.model import init_params
from dflash_jax.train_data import TAPS_FILE, TAPS_META, TapStore

REPO = Path(__file__).resolve().parents[1]
TC = tr.TrainConfig(steps=10, batch_size=2, seq_len=24, num_blocks=3, compute_dtype="float32", learning_rate=1e-2)


def test_a_step_on_taps_from_disk_equals_the_step_that_computes_them(tmp_path):
    cfg = SHAPES["tiny"]
    target = init_params(cfg, jax.random.key(0), jnp.float32)
    dcfg = tr.drafter_config_for(cfg, num_layers=2, block_size=4, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (2, TC.seq_len), dtype=np.int32)),
             "prompt_lens": jnp.asarray([3, 5], jnp.int32), "total_lens": jnp.asarray([24, 20], jnp.int32)}
    taps, _ = tr.target_taps(target, cfg, batch["tokens"], dcfg.target_layer_ids)
    store = TapStore.create(tmp_path / "taps", 2, TC.seq_len, taps.shape[-1], "float32", dcfg.target_layer_ids)
    store.write(0, np.asarray(taps))
    state = tr.init_state(tr.dr.init_draft_params(dcfg, jax.random.key(1), training=True), TC)

    computed, m1 = tr.train_step(state, target, batch, cfg=cfg, dcfg=dcfg, tc=TC)
    read = TapStore.open(tmp_path / "taps").read(np.arange(2))
    streamed, m2 = tr.train_step(state, target, {**batch, "taps": jnp.asarray(read)}, cfg=cfg, dcfg=dcfg, tc=TC)
    np.testing.assert_array_equal(read, np.asarray(taps))  # float32 on disk: exact
    # The step's own taps come from the same forward compiled into a larger program: equal to
    # float32 rounding, so the loss, accuracy and gradient norm agree to that.
    for name in ("loss", "ce", "acc_by_pos", "grad_norm", "tau_estimate"):
        np.testing.assert_allclose(np.asarray(m2[name]), np.asarray(m1[name]), rtol=1e-5, err_msg=name)
    assert float(m1["loss"]) > 0 and int(streamed.step) == 1
    # Other rows' taps give another loss: the step really reads the taps it is given.
    _, other = tr.train_step(state, target, {**batch, "taps": jnp.asarray(read[::-1])}, cfg=cfg, dcfg=dcfg, tc=TC)
    assert abs(float(other["loss"]) - float(m1["loss"])) > 1e-3

    with pytest.raises(ValueError, match="--labels target needs the target's logits"):
        tr.train_step(state, target, {**batch, "taps": jnp.asarray(read)}, cfg=cfg, dcfg=dcfg,
                      tc=tr.TrainConfig(**{**TC.to_dict(), "labels": "target"}))


def test_tap_store_reads_its_rows_back_and_refuses_damage(tmp_path):
    store = TapStore.create(tmp_path, 4, 3, 5, "bfloat16", (1, 2))
    data = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
    store.write(1, data[1:3])
    again = TapStore.open(tmp_path)
    assert (again.shape, again.dtype, again.tap_layers) == ((4, 3, 5), "bfloat16", (1, 2))
    got = again.read(np.array([2, 1, 0]))
    np.testing.assert_array_equal(got[:2].astype(np.float32), data[[2, 1]].astype(jnp.bfloat16).astype(np.float32))
    assert not got[2].any()  # a row never written reads as zeros
    with open(tmp_path / TAPS_FILE, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=f"{TAPS_FILE}: 10 bytes"):
        TapStore.open(tmp_path)
    (tmp_path / TAPS_META).write_text("{}")
    with pytest.raises(ValueError, match=f"{TAPS_META}: not a taps record"):
        TapStore.open(tmp_path)
    with pytest.raises(FileNotFoundError, match="no taps here"):
        TapStore.open(tmp_path / "nothing")


def test_runbook_train_step_phase_dry(tmp_path):
    """DRY=1 runs the phase on the tiny hybrid on the CPU: both ways timed, the trade reported."""
    # The runbook calls `python`: this interpreter's.
    env = {**os.environ, "DRY": "1", "JAX_PLATFORMS": "cpu",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "dflash_jax/bench/gpu_runbook.sh", "train-step", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    record = json.loads((tmp_path / "train_step.json").read_text())
    assert sorted(record["modes"]) == ["disk", "in-step"]
    assert all(r["tokens_per_s"] > 0 for r in record["modes"].values())
    cfg = SHAPES["tiny-hybrid"]
    assert record["disk_bytes_per_token"] == len(record["taps"]) * cfg.hidden_size * 2  # bf16
    assert record["target_gflop_per_step"] > 0 and record["tokens_per_step"] == 2 * 64
    assert "| in-step |" in done.stdout and "| disk |" in done.stdout
    assert not (tmp_path / "taps").exists()  # the phase removes its taps file


def test_make_taps_then_train_from_them_as_in_the_step(tmp_path, capsys):
    """`make-taps` once (2 processes, 2 batches of 3 rows each and one of 2, every process writing
    its own rows), then `train --taps`: the same losses as `train` computing the taps."""
    from dflash_jax.cli import main
    from tests.spec_models import VOCAB, target_model
    from tests.test_multi_process import launch, token_file

    target_model(vocab=VOCAB).save_pretrained(tmp_path / "target")
    data = token_file(tmp_path / "tokens.npz", VOCAB)
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--seq-len", "32"]
    out = launch(["make-taps", *common, "--out", str(tmp_path / "taps"), "--layers", "2", "--batch", "3",
                  "--dtype", "float32", "--no-progress"], processes=2, devices=2)
    made = json.loads(out[0].strip().splitlines()[-1])
    assert made["rows"] == 8 and made["tap_layers"] == [1, 1]

    def train(run: str, *extra: str) -> list[float]:
        assert main(["train", *common, "--out", str(tmp_path / run), "--steps", "4", "--batch", "2", "--blocks", "2",
                     "--block-size", "4", "--layers", "2", "--mask-token-id", str(VOCAB - 1), "--lr", "3e-3",
                     "--log-every", "1", "--val-fraction", "0", "--compute-dtype", "float32", "--no-progress",
                     *extra]) == 0, capsys.readouterr().err
        capsys.readouterr()
        return [json.loads(line)["loss"] for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]

    np.testing.assert_allclose(train("streamed", "--taps", str(tmp_path / "taps")), train("in_step"), rtol=1e-4)
    # Taps of another drafter's layers are refused, naming the flag.
    assert main(["train", *common, "--out", str(tmp_path / "bad"), "--layers", "3", "--taps", str(tmp_path / "taps"),
                 "--steps", "2", "--batch", "2", "--block-size", "4", "--mask-token-id", str(VOCAB - 1),
                 "--val-fraction", "0", "--no-progress"]) == 2
    assert "taps (--taps)" in capsys.readouterr().err
