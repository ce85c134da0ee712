"""`dflash-jax train --resume` after the process is killed: it continues from the last finished
checkpoint and ends bitwise equal to a run that was never interrupted, even when the newest
checkpoint is damaged and the log's last line was cut short; with no finished checkpoint it
refuses and leaves the run's files alone.

Real processes on a tiny target: a SIGKILL gives the code no chance to clean up.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_jax import train as tr
from dflash_jax.cli import main
from dflash_jax.train_data import TokenData
from tests.spec_models import target_model

REPO = Path(__file__).resolve().parents[1]
VOCAB, MASK, STEPS, SAVE_EVERY = 24, 23, 14, 4
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", "4", "--seq-len", "32", "--blocks", "3", "--block-size", "4",
              "--layers", "2", "--mask-token-id", str(MASK), "--lr", "1e-2", "--seed", "3", "--val-fraction", "0",
              "--compute-dtype", "float32", "--save-every", str(SAVE_EVERY), "--log-every", "1", "--no-progress"]
# Runs the CLI in a process that SIGKILLs itself when train_step is called for the KILL_AT-th time
# (after KILL_AT - 1 finished steps): no handler, no flush, no cleanup. Each earlier step first
# waits (up to 120 s) until the newest save issued so far has finished (orbax saves step 1, then
# every --save-every), so that every checkpoint but one issued right before the kill is finished
# however busy the machine is (a fixed wait of 0.1 s was too short beside other tests).
KILLER = """
import os, signal, sys, time
from pathlib import Path
from dflash_jax import train
from dflash_jax.cli import main
kill_at, calls, step = int(os.environ["KILL_AT"]), [0], train.train_step
ckpts = Path(sys.argv[sys.argv.index("--out") + 1]) / "checkpoints"
every = int(sys.argv[sys.argv.index("--save-every") + 1])
def dying_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    saved = [s for s in range(1, calls[0]) if s == 1 or s % every == 0]
    deadline = time.monotonic() + 120
    while saved and saved[-1] not in train.finished_steps(ckpts) and time.monotonic() < deadline:
        time.sleep(0.05)
    return step(*args, **kwargs)
train.train_step = dying_step
sys.argv = ["dflash-jax"] + sys.argv[1:]
sys.exit(main())
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    target_model(vocab=VOCAB).save_pretrained(root / "target")
    rng = np.random.default_rng(0)
    prompts, responses = [], []
    for _ in range(16):
        prompts.append(rng.integers(0, 20, int(rng.integers(3, 8))).tolist())
        t = int(rng.integers(0, 20))
        response = []
        for _ in range(int(rng.integers(12, 22))):
            response.append(t)
            t = (3 * t + 1) % 20
        responses.append(response)
    data = TokenData.from_lists(prompts, responses, [0.0] * 16, [0] * 16, {}).save(root / "tokens.npz")
    return root, data


def cli(*argv: str, killer_at: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    if killer_at is None:
        cmd = [sys.executable, "-m", "dflash_jax.cli", *argv]
    else:
        cmd = [sys.executable, "-c", KILLER, *argv]
        env["KILL_AT"] = str(killer_at)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def log_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / tr.LOG_FILE).read_text().splitlines())]


def test_resume_after_a_kill_equals_an_uninterrupted_run(setup):
    root, data = setup
    common = ["train", "--target", str(root / "target"), "--data", str(data)]
    kill_at = int(np.random.default_rng().integers(SAVE_EVERY + 2, STEPS))  # a step between checkpoints
    full = cli(*common, "--out", str(root / "full"), *TRAIN_ARGS)
    killed = cli(*common, "--out", str(root / "killed"), *TRAIN_ARGS, killer_at=kill_at)
    rc, err = finish(killed)
    assert rc == -signal.SIGKILL, err
    rc, err = finish(full)
    assert rc == 0, err

    out = root / "killed"
    done = tr.finished_steps(out / "checkpoints")
    assert len(done) >= 2 and max(done) <= kill_at - 1 and not (out / "drafter").exists(), (kill_at, done)
    # The newest checkpoint damaged (an array file cut short), and the log's last line cut short.
    latest = out / "checkpoints" / str(max(done))
    arrays = sorted((p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 64
                     and "d" in p.parent.name), key=lambda p: -p.stat().st_size)
    assert arrays, sorted(str(p) for p in latest.rglob("*"))
    arrays[0].write_bytes(arrays[0].read_bytes()[:16])
    with (out / tr.LOG_FILE).open("a") as f:
        f.write('{"step": 99, "loss": 1.2')

    # The logging and saving cadence is not part of the run record: given again.
    rc, err = finish(cli(*common, "--out", str(out), "--resume", "--log-every", "1", "--save-every", str(SAVE_EVERY),
                         "--no-progress"))
    assert rc == 0, err
    previous = max(s for s in done if s < max(done))
    assert f"checkpoint {latest} is damaged" in err and f"resuming from checkpoint {previous}" in err, err
    assert "dropping a partial last line" in err and tr.LOG_FILE in err, err

    a = (root / "full" / "drafter" / "model.safetensors").read_bytes()
    b = (out / "drafter" / "model.safetensors").read_bytes()
    assert a == b, f"killed at step {kill_at}: the resumed drafter differs from the uninterrupted one"
    assert log_losses(out) == log_losses(root / "full")
    assert json.loads((out / tr.RUN_FILE).read_text())["result"]["finished"]


def test_resume_without_a_finished_checkpoint_is_refused_and_changes_nothing(tmp_path, capsys, monkeypatch):
    import convert

    monkeypatch.setattr(convert, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    (tmp_path / tr.RUN_FILE).write_text('{"train_config": {}, "drafter_config": {}, "init": "some/drafter"}\n')
    (tmp_path / tr.LOG_FILE).write_text('{"step": 1, "loss": 2.0}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    for contents in ([], ["3.orbax-checkpoint-tmp-1733300000"]):
        for name in contents:
            (ckpt / name).mkdir()
        assert main(["train", "--out", str(tmp_path), "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.count("error") == 1 and "no finished checkpoint to resume from" in err and str(ckpt) in err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_partial_last_log_line_is_dropped_and_an_earlier_one_is_an_error(tmp_path, capsys):
    log = tmp_path / tr.LOG_FILE
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in tr._read_log(log)] == [1, 2]
    assert "dropping a partial last line" in capsys.readouterr().err
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{tr.LOG_FILE}:2: not a log record"):
        tr._read_log(log)
