"""Multi-process runs (`dflash_jax.distributed`): real processes joined by `jax.distributed` over gloo.

Each run is BUILD.md's multi-host recipe on one machine: the same `python -m dflash_jax.cli ...`
command in every process with `--coordinator 127.0.0.1:PORT --num-processes N --process-id I`,
2 fake CPU devices per process. Training runs over 4 devices in all, as 2 processes of 2 or as
1 process of 4: the same global mesh, the same rows in every step, so the exports and the logged
losses must be bitwise equal, also after 2 processes stop and 1 process resumes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_jax import distributed as dist
from dflash_jax.train_data import TokenData

REPO = Path(__file__).resolve().parents[1]
STEPS, STOP = 6, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], processes: int, devices: int, timeout: float = 240) -> list[str]:
    """Runs `dflash-jax ARGV` as `processes` processes of `devices` CPU devices each -> their stdouts."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    for var in (dist.ENV_ADDRESS, dist.ENV_PROCESSES, dist.ENV_ID):
        env.pop(var, None)
    extra: list[list[str]] = [[]]
    if processes > 1:
        address = f"127.0.0.1:{free_port()}"
        extra = [["--coordinator", address, "--num-processes", str(processes), "--process-id", str(i)]
                 for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_jax.cli", *argv, *e], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in extra]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"process {procs.index(p)} of {processes} failed:\n{err[-3000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def token_file(path: Path, vocab: int, seed: int = 0) -> Path:
    """8 rows of random prompts and responses (the tiny target learns nothing in particular)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab - 1, int(rng.integers(3, 8))).tolist() for _ in range(8)]
    responses = [rng.integers(0, vocab - 1, int(rng.integers(12, 24))).tolist() for _ in range(8)]
    return TokenData.from_lists(prompts, responses, [0.0] * 8, [0] * 8, {"sources": ["test"]}).save(path)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A tiny dense (Qwen3) and a tiny hybrid (Qwen3.5) target, saved as HF directories."""
    from tests.spec_models import VOCAB as DENSE_VOCAB, target_model
    from tests.test_convert_qwen3_5 import VOCAB as HYBRID_VOCAB, build_causal

    root = tmp_path_factory.mktemp("targets")
    target_model(vocab=DENSE_VOCAB).save_pretrained(root / "dense")
    hybrid, _ = build_causal(root, "hybrid", num_hidden_layers=4, tie_word_embeddings=False)
    return {"dense": (root / "dense", DENSE_VOCAB), "hybrid": (Path(hybrid), HYBRID_VOCAB)}


def train_argv(target: Path, vocab: int, data: Path, out: Path) -> list[str]:
    return ["train", "--target", str(target), "--out", str(out), "--data", str(data), "--steps", str(STEPS),
            "--batch", "4", "--seq-len", "32", "--blocks", "2", "--block-size", "4", "--layers", "2",
            "--mask-token-id", str(vocab - 1), "--lr", "3e-3", "--warmup", "0.0", "--log-every", "1",
            "--save-every", "3", "--val-fraction", "0", "--compute-dtype", "float32", "--no-progress"]


def exported(run: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(run / "drafter" / "model.safetensors")


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "log.jsonl").read_text().splitlines()]


def assert_bitwise_same_run(got: Path, ref: Path) -> dict:
    """The training run in `got` logged the losses of the one in `ref` (STEPS of them, finite) and
    exported its weights, every bit equal -> the record (train_run.json) of `got`."""
    assert len(losses(ref)) == STEPS and np.all(np.isfinite(losses(ref)))
    assert losses(got) == losses(ref)  # floats from JSON: every bit
    ref_weights, got_weights = exported(ref), exported(got)
    assert sorted(got_weights) == sorted(ref_weights)
    for name in ref_weights:
        np.testing.assert_array_equal(got_weights[name], ref_weights[name], err_msg=name)
    return json.loads((got / "train_run.json").read_text())


def word_target(directory: Path) -> Path:
    """The tiny dense target with test_bad_input's word tokenizer, saved in `directory`."""
    from tests.spec_models import target_model
    from tests.test_bad_input import VOCAB, WORDS, save_tokenizer

    target_model(vocab=VOCAB).save_pretrained(directory)
    save_tokenizer(directory, WORDS)
    return directory


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_two_processes_train_bitwise_as_one(targets, tmp_path, kind):
    """2 processes x 2 devices for STOP steps, then 1 process x 4 devices resuming to the end ==
    1 process x 4 devices uninterrupted, bitwise (weights and every logged loss)."""
    target, vocab = targets[kind]
    data = token_file(tmp_path / "tokens.npz", vocab)
    one, switched = tmp_path / "one", tmp_path / "switched"
    launch(train_argv(target, vocab, data, one) + ["--dp", "4"], processes=1, devices=4)
    launch(train_argv(target, vocab, data, switched) + ["--stop-at", str(STOP)], processes=2, devices=2)
    # Process 0 alone wrote the log: one record per step, not one per process.
    assert [json.loads(line)["step"] for line in (switched / "log.jsonl").read_text().splitlines()] == list(
        range(1, STOP + 1))
    assert losses(switched) == losses(one)[:STOP]  # floats from JSON: every bit
    assert str(STOP) in os.listdir(switched / "checkpoints") and not (switched / "drafter").exists()
    launch(train_argv(target, vocab, data, switched) + ["--resume"], processes=1, devices=4)
    record = assert_bitwise_same_run(switched, one)
    assert record["dp"] == 4 and record["result"]["finished"]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_two_processes_tp2_train_bitwise_as_one(targets, tmp_path, kind):
    """--tp 2 inside each of 2 processes (dp = 2 across them) == 1 process x 4 devices at
    --dp 2 --tp 2, bitwise (weights and every logged loss): the same mesh, each tp pair on one
    process either way, the dp sums added in `ordered_sum`'s fixed order, and each of XLA's tp
    all-reduces adds two operands, whose sum is the same bits in either order."""
    target, vocab = targets[kind]
    data = token_file(tmp_path / "tokens.npz", vocab)
    one, two = tmp_path / "one", tmp_path / "two"
    launch(train_argv(target, vocab, data, one) + ["--dp", "2", "--tp", "2"], processes=1, devices=4)
    launch(train_argv(target, vocab, data, two) + ["--tp", "2"], processes=2, devices=2)
    record = assert_bitwise_same_run(two, one)
    assert (record["dp"], record["tp"]) == (2, 2)


@pytest.mark.parametrize("environ,message", [
    ({dist.ENV_PROCESSES: "2"}, "need --coordinator"),
    ({dist.ENV_ADDRESS: "127.0.0.1:1234", dist.ENV_PROCESSES: "2"}, "needs --num-processes N and --process-id I"),
    ({dist.ENV_ADDRESS: "127.0.0.1:1234", dist.ENV_PROCESSES: "2", dist.ENV_ID: "2"}, r"must be in 0..1"),
    ({dist.ENV_ADDRESS: "127.0.0.1", dist.ENV_PROCESSES: "2", dist.ENV_ID: "0"}, "must be HOST:PORT"),
    ({dist.ENV_ADDRESS: "h:1", dist.ENV_PROCESSES: "two", dist.ENV_ID: "0"}, "JAX_NUM_PROCESSES='two'"),
])
def test_incomplete_cluster_is_one_clear_error(environ, message):
    with pytest.raises(ValueError, match=message):
        dist.cluster_from(environ=environ)


def test_flags_win_over_the_environment():
    env = {dist.ENV_ADDRESS: "h:1", dist.ENV_PROCESSES: "4", dist.ENV_ID: "3"}
    assert dist.cluster_from(environ=env) == dist.Cluster("h:1", 4, 3)
    assert dist.cluster_from("g:2", 2, 0, environ=env) == dist.Cluster("g:2", 2, 0)
    assert dist.cluster_from(environ={}) is None
    assert dist.cluster_from("auto", environ={}) == dist.Cluster("auto", None, None)


def test_two_processes_decode_every_row_once(tmp_path):
    """7 prompts in batches of 2 (4 batches, 2 per process): every id answered exactly once, by
    process 0 alone, with the answers one process gives (each batch keeps its own key)."""
    import jax.numpy as jnp

    from convert import load_model
    from dflash_jax.decode import decode_file

    model_dir = word_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    texts = ["w1 w2", "w3", "w4 w5 w6", "w7 w8", "w9", "w10 w11 w12 w13", "w14"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    output = tmp_path / "answers.jsonl"
    launch(["decode", "--model", str(model_dir), "--input", str(prompts), "--output", str(output), "--batch", "2",
            "--max-new-tokens", "5", "--no-chat", "--no-progress", "--dtype", "float32"], processes=2, devices=2)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(len(texts))]

    cfg, params, tokenizer = load_model(str(model_dir), dtype=jnp.float32)
    one = tmp_path / "one.jsonl"
    decode_file(params, cfg, tokenizer, prompts, one, batch=2, max_new_tokens=5, chat=False, progress=False)
    expected = {r["id"]: r for r in map(json.loads, one.read_text().splitlines())}
    for r in rows:
        assert (r["text"], r["num_tokens"]) == (expected[r["id"]]["text"], expected[r["id"]]["num_tokens"]), r["id"]


def test_two_processes_make_data_as_one(tmp_path):
    """make-data split over 2 processes (3 batches: 2 for process 0, 1 for process 1; greedy and
    sampled) writes the token file one process makes."""
    import jax.numpy as jnp

    from convert import load_model
    from dflash_jax.train_data import make_token_data

    model_dir = word_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}" + " w3" * (i % 3)}) + "\n" for i in range(5)))
    out = tmp_path / "tokens.npz"
    argv = ["--prompts", str(prompts), "--gen-tokens", "6", "--gen-batch", "2", "--sample-fraction", "0.5",
            "--math-suffix", "never", "--seed", "1"]
    launch(["make-data", "--target", str(model_dir), "--out", str(out), "--dtype", "float32", *argv],
           processes=2, devices=2)
    got = TokenData.load(out)

    cfg, params, tokenizer = load_model(str(model_dir), dtype=jnp.float32)
    ref = make_token_data(params, cfg, tokenizer, [prompts], max_new_tokens=6, batch_size=2, sample_fraction=0.5,
                          math_suffix="never", seed=1, progress=False)
    assert len(got) == len(ref) == 5
    for name in ("prompt_tokens", "prompt_offsets", "response_tokens", "response_offsets", "temperature"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    assert 0.0 in ref.temperature and 1.0 in ref.temperature  # both modes crossed processes


def test_build_md_recipe_is_the_one_the_tests_run():
    """BUILD.md's multi-host commands use flags the CLI has, and the ones `launch` passes."""
    import re

    from dflash_jax.cli import build_parser

    text = (REPO / "BUILD.md").read_text(encoding="utf-8")
    section = text.split("## Multi-host", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^dflash-jax (\w[\w-]*)([^\n#]*)", section, flags=re.M)
    assert commands, "BUILD.md has no multi-host command"
    subparsers = build_parser()._subparsers._group_actions[0].choices
    for command, rest in commands:
        known = {s for a in subparsers[command]._actions for s in a.option_strings}
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
        assert flags <= known, (command, sorted(flags - known))
    assert {"--coordinator", "--num-processes", "--process-id"} <= set(re.findall(r"--[a-z-]+", commands[0][1]))
    for command in ("train", "make-data", "decode"):
        assert "--coordinator" in {s for a in subparsers[command]._actions for s in a.option_strings}
