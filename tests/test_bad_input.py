"""Bad input, unwritable places and failed writes: one line on stderr, exit code 2, nothing lost.

Each test drives the command line (`cli.main`, or a real process where the exit itself matters)
with a tiny random Qwen3 target that carries a word-level tokenizer, and checks that the message
names the file, field, tensor or argument at fault, and that files written before are intact.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.cli import main
from tests.spec_models import target_model

REPO = Path(__file__).resolve().parents[1]
VOCAB = 24
WORDS = 20  # tokenizer ids 0..20 ("[UNK]" = 20) < VOCAB


def save_tokenizer(directory: Path, words: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    vocab["[UNK]"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(directory))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """An HF directory: a tiny Qwen3 target (max_position_embeddings 512) and its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny")
    target_model(vocab=VOCAB).save_pretrained(directory)
    save_tokenizer(directory, WORDS)
    return directory


def variant(tiny: Path, where: Path, **config: object) -> Path:
    """A copy of the tiny target with config.json fields replaced."""
    shutil.copytree(tiny, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg.update(config)
    (where / "config.json").write_text(json.dumps(cfg))
    return where


def one_error(capsys, *needles: str) -> str:
    """The single `dflash-jax ...: error:` line on stderr; it holds every needle; no traceback."""
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("dflash-jax")]
    assert len(lines) == 1 and "error:" in lines[0], err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def refuse_loading(monkeypatch) -> None:
    import convert

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad argument was refused")

    monkeypatch.setattr(convert, "load_model", no_load)


def unwritable(tmp_path: Path) -> Path:
    """A directory path nothing can be written under: read-only for an ordinary user; below a
    regular file where the tests run as root (root writes through permission bits)."""
    if os.geteuid() != 0:
        d = tmp_path / "read_only"
        d.mkdir()
        d.chmod(0o500)
        return d / "sub"
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "sub"


# ----------------------------------------------------------------------------- numbers and configs

@pytest.mark.parametrize("argv,needle", [
    (["generate", "--temperature", "nan", "hi"], "--temperature"),
    (["generate", "--temperature", "inf", "hi"], "--temperature"),
    (["generate", "--block-size", "0", "hi"], "--block-size"),
    (["generate", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--dp", "0", "hi"], "--dp"),
    (["generate", "--max-new-tokens", "-5", "hi"], "--max-new-tokens"),
    (["train", "--out", "x", "--lr", "-1"], "--lr"),
    (["train", "--out", "x", "--dp", "0"], "--dp"),
    (["train", "--out", "x", "--steps", "ten"], "--steps"),
    (["train", "--out", "x", "--warmup", "1"], "--warmup"),
    (["bench", "--prompts", "p.jsonl", "--budget", "64", "0"], "--budget"),
    (["make-data", "--out", "x.npz", "--sample-fraction", "1.5"], "--sample-fraction"),
])
def test_cli_numbers_are_checked_before_anything_loads(argv, needle, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    assert main(argv) == 2
    one_error(capsys, needle)


@pytest.mark.parametrize("field,change", [
    ("max_position_embeddings", {"max_position_embeddings": 0}),
    ("rms_norm_eps", {"rms_norm_eps": -1}),
    ("rope_theta", {"rope_parameters": {"rope_theta": -5, "rope_type": "default"}}),
    ("rope_theta", {"rope_parameters": None, "rope_theta": -5}),  # the legacy top-level field
    ("num_attention_heads", {"num_attention_heads": "four"}),
    ("vocab_size", {"vocab_size": 2.5}),
    ("tie_word_embeddings", {"tie_word_embeddings": "yes"})])
def test_bad_config_values_name_the_file_and_field(tiny, tmp_path, field, change, capsys):
    d = variant(tiny, tmp_path / "bad", **change)
    assert main(["generate", "--model", str(d), "--no-chat", "w1"]) == 2
    one_error(capsys, str(d / "config.json"), f"field '{field}'")


def test_bad_drafter_config_names_the_file_and_field(tmp_path):
    from dflash_jax.config import ConfigError
    from dflash_jax.drafter import draft_config_from_dict

    good = {"architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "vocab_size": 24, "num_target_layers": 4, "dflash_config": {"mask_token_id": 23}}
    assert draft_config_from_dict(good, "d.json").num_layers == 2
    for field, value in (("num_hidden_layers", "two"), ("rms_norm_eps", 0), ("block_size", 0),
                         ("max_position_embeddings", -1)):
        with pytest.raises(ConfigError, match=rf"d\.json: field '{field}'"):
            draft_config_from_dict({**good, field: value}, "d.json")
    with pytest.raises(ConfigError, match=r"d\.json: field 'target_layer_ids'"):
        draft_config_from_dict({**good, "dflash_config": {"mask_token_id": 23, "target_layer_ids": "1,2"}}, "d.json")


# ----------------------------------------------------------------------------- prompts against positions

def test_max_new_tokens_past_the_targets_positions(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--no-chat", "--max-new-tokens", "1000000000", "w1"]) == 2
    one_error(capsys, "--max-new-tokens", "max_position_embeddings 512")


def test_a_prompt_longer_than_the_targets_positions(tiny, tmp_path, capsys):
    d = variant(tiny, tmp_path / "short", max_position_embeddings=16)
    prompt = " ".join(f"w{i % WORDS}" for i in range(20))
    assert main(["generate", "--model", str(d), "--no-chat", "--max-new-tokens", "4", prompt]) == 2
    one_error(capsys, "a prompt of 20 tokens is too long for the target's max_position_embeddings 16")
    d = variant(tiny, tmp_path / "shorter", max_position_embeddings=24)
    assert main(["generate", "--model", str(d), "--no-chat", "--max-new-tokens", "4", prompt]) == 2
    one_error(capsys, "a prompt of 20 tokens + max_new_tokens (--max-new-tokens) 4", "max_position_embeddings 24",
              "at most 3")


def test_an_absurd_cache_is_refused_with_its_size(tiny, tmp_path, capsys):
    d = variant(tiny, tmp_path / "long", max_position_embeddings=10 ** 15)
    assert main(["generate", "--model", str(d), "--no-chat", "--max-new-tokens", str(10 ** 12), "w1"]) == 2
    # 2 (K, V) x 4 layers x 2 kv heads x 8 x 4 bytes = 512 bytes a slot: 10^12 slots are 512 TB.
    one_error(capsys, "--max-new-tokens", "KV cache of 512.0 TB")


def test_the_drafters_positions_are_checked_too():
    from dflash_jax.config import ModelConfig
    from dflash_jax.generate import check_prompts
    from dflash_jax.train import drafter_config_for

    cfg = ModelConfig("qwen3", 24, 32, 64, 4, 4, 2, 8, max_position_embeddings=512)
    dcfg = dataclasses.replace(drafter_config_for(cfg, num_layers=1, block_size=4, mask_token_id=23),
                               max_position_embeddings=32)
    check_prompts(np.array([10]), 32, 16, 64, slack=4, cfg=cfg)
    with pytest.raises(ValueError, match=r"drafter's max_position_embeddings 32.*at most 18"):
        check_prompts(np.array([10]), 32, 20, 64, slack=4, cfg=cfg, dcfg=dcfg)


# ----------------------------------------------------------------------------- weights and tokenizer

def test_nan_weights_are_refused_naming_the_tensor(tiny, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    from convert import load_model

    d = tmp_path / "nan"
    shutil.copytree(tiny, d)
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name][3, 5] = np.nan
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert main(["generate", "--model", str(d), "--no-chat", "w1"]) == 2
    one_error(capsys, str(d), "tensor layers.2.mlp.down holds NaN or inf", "--no-weight-check")
    # The check can be turned off (for speed): the NaN is then loaded as it is.
    _, params, _ = load_model(d, check_weights=False, tokenizer=False)
    assert np.isnan(np.asarray(params.layers[2].mlp.down)).sum() == 1


def test_a_tokenizer_past_the_vocabulary_is_refused(tiny, tmp_path, capsys):
    d = tmp_path / "big_tokenizer"
    shutil.copytree(tiny, d)
    save_tokenizer(d, 30)
    assert main(["generate", "--model", str(d), "--no-chat", "w1"]) == 2
    one_error(capsys, str(d), "id 30", "vocabulary of 24")


# ----------------------------------------------------------------------------- input files

@pytest.mark.parametrize("row,needle", [("[1, 2]", "rows.jsonl:2: expected a JSON object"),
                                        ('{"turns": [123]}', "rows.jsonl:2: field 'turns'"),
                                        ('{"question": ', "rows.jsonl:2: not valid JSON")])
def test_bad_jsonl_rows_name_the_file_and_line(row, needle, tmp_path, capsys, monkeypatch):
    refuse_loading(monkeypatch)  # bench reads its prompts before loading the target
    f = tmp_path / "rows.jsonl"
    f.write_text('{"question": "w1 w2"}\n' + row + "\n")
    assert main(["bench", "--method", "ar", "--prompts", str(f)]) == 2
    one_error(capsys, needle)


def test_bad_training_rows_name_the_file_and_line(tiny, tmp_path, capsys):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"question": "w1 w2"}\n[1, 2]\n')
    assert main(["make-data", "--target", str(tiny), "--prompts", str(f), "--out", str(tmp_path / "t.npz")]) == 2
    one_error(capsys, "rows.jsonl:2: expected a JSON object")
    assert not (tmp_path / "t.npz").exists()


def test_a_truncated_token_file_is_named(tiny, tmp_path, capsys):
    from dflash_jax.train_data import TokenData

    data = TokenData.from_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, [0.0] * 4, [0] * 4, {})
    good = data.save(tmp_path / "tokens.npz")
    assert len(TokenData.load(good)) == 4
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    with pytest.raises(ValueError, match=r"cut\.npz: not a readable token file"):
        TokenData.load(cut)
    assert main(["train", "--target", str(tiny), "--out", str(tmp_path / "run"), "--data", str(cut),
                 "--mask-token-id", "23", "--no-progress"]) == 2
    one_error(capsys, str(cut), "not a readable token file")


# ----------------------------------------------------------------------------- unwritable destinations

@pytest.mark.parametrize("command", ["make-data", "bench", "train", "convert"])
def test_an_unwritable_destination_is_refused_before_the_work(command, tmp_path, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    dst = unwritable(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "w1"}\n')
    argv = {"make-data": ["make-data", "--out", str(dst / "t.npz")],
            "bench": ["bench", "--method", "ar", "--prompts", str(prompts), "--out", str(dst)],
            "train": ["train", "--out", str(dst)],
            "convert": ["convert", "smollm2", str(dst)]}[command]
    assert main(argv) == 2
    one_error(capsys, str(dst.parent))


def test_bench_writes_each_method_as_it_finishes(tiny, tmp_path, capsys, monkeypatch):
    """A failure in the second method (here a full disk) keeps the baseline's results on disk."""
    from dflash_jax import speculative
    from tests.spec_models import drafter_model

    draft = tmp_path / "draft"
    drafter_model(4, vocab=VOCAB).save_pretrained(draft)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "w1 w2 w3"}\n{"question": "w4 w5"}\n')

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(speculative, "speculative_program", full_disk)
    out = tmp_path / "report"
    assert main(["bench", "--model", str(tiny), "--draft", str(draft), "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--out", str(out), "--no-progress"]) == 2
    one_error(capsys, "No space left on device")
    report = json.loads((out / "report.json").read_text())
    assert list(report["methods"]) == ["ar"] and report["complete"] is False
    assert report["methods"]["ar"]["prompts"] == 2 and report["methods"]["ar"]["tokens"] > 0


def test_a_failed_convert_leaves_no_partial_destination_and_keeps_the_old_one(tiny, tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    from convert import load_model
    from convert.checkpoint import is_checkpoint

    dst = tmp_path / "ckpt"
    real_save = PreTrainedTokenizerFast.save_pretrained

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    assert main(["convert", str(tiny), str(dst)]) == 2
    one_error(capsys, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no destination, no partial sibling
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", real_save)
    assert main(["convert", str(tiny), str(dst)]) == 0  # the retry is not blocked
    assert is_checkpoint(dst)
    _, before, _ = load_model(dst, tokenizer=False)
    # Without --overwrite an existing checkpoint is refused; a failed --overwrite keeps it whole.
    assert main(["convert", str(tiny), str(dst)]) == 2
    one_error(capsys, str(dst), "--overwrite")
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    assert main(["convert", str(tiny), str(dst), "--overwrite"]) == 2
    one_error(capsys, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, after, _ = load_model(dst, tokenizer=False)
    np.testing.assert_array_equal(np.asarray(after.embed), np.asarray(before.embed))
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", real_save)
    assert main(["convert", str(tiny), str(dst), "--overwrite"]) == 0


# ----------------------------------------------------------------------------- whole processes

def run_cli(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dflash_jax.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)
    return proc, time.perf_counter() - t0


def test_a_process_prints_one_line_and_debug_the_traceback(tiny, tmp_path):
    d = variant(tiny, tmp_path / "bad", num_attention_heads="four")
    proc, _ = run_cli("generate", "--model", str(d), "--no-chat", "w1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dflash-jax generate: error: {d / 'config.json'}: field 'num_attention_heads' must be a whole number, "
        f"got 'four'"], proc.stderr
    proc, _ = run_cli("generate", "--model", str(d), "--no-chat", "w1", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "num_attention_heads" in proc.stderr


@pytest.fixture
def read_only_mount(tmp_path):
    """A directory on a read-only file system, where orbax's own writers fail (and, unchecked,
    leave the process waiting forever): a read-only tmpfs as root, permission bits otherwise."""
    d = tmp_path / "run" / "checkpoints"
    d.mkdir(parents=True)
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("running as root where a read-only tmpfs cannot be mounted: no unwritable directory")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_orbax_failing_to_write_is_an_error_not_a_hang(tiny, read_only_mount, tmp_path):
    """With the checks before it bypassed (the destination's writability, the temporary sibling
    placed on the read-only file system), orbax itself fails to write: the process still ends
    with one line and exit code 2 within 30 s."""
    code = ("import sys, convert.checkpoint as c; "
            "c.check_writable = lambda d, what: d; "
            f"c.tempfile.mkdtemp = lambda **kw: {str(read_only_mount)!r}; "
            "from dflash_jax.cli import main; sys.argv = ['dflash-jax'] + sys.argv[1:]; sys.exit(main())")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, "convert", str(tiny), str(tmp_path / "dst")],
                          capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("dflash-jax")]
    assert len(lines) == 1 and str(read_only_mount) in lines[0], proc.stderr
    assert not (tmp_path / "dst").exists()


def test_train_with_read_only_checkpoints_is_refused_before_loading(read_only_mount, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    assert main(["train", "--out", str(read_only_mount.parent)]) == 2
    one_error(capsys, str(read_only_mount), "cannot write there")


def test_absurd_training_sizes_are_refused_with_their_memory(tiny, tmp_path, capsys):
    from dflash_jax.train_data import TokenData

    data = TokenData.from_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, [0.0] * 4, [0] * 4, {})
    tokens = data.save(tmp_path / "tokens.npz")
    common = ["train", "--target", str(tiny), "--data", str(tokens), "--mask-token-id", "23", "--no-progress",
              "--seq-len", "32", "--block-size", "4", "--layers", "1"]
    assert main([*common, "--out", str(tmp_path / "a"), "--seq-len", "4096"]) == 2
    one_error(capsys, "seq_len (--seq-len) 4096 exceeds the target's max_position_embeddings 512")
    assert main([*common, "--out", str(tmp_path / "b"), "--batch", "1000000000000"]) == 2
    one_error(capsys, "batch_size (--batch) 1000000000000", "GB of activations a step, more than the device's")


def test_absurd_mtp_training_sizes_name_only_flags_an_mtp_run_takes(tiny, tmp_path, capsys):
    """An MTP head has no blocks (train refuses --blocks for it): the error must not ask for them."""
    from dflash_jax.train_data import TokenData

    data = TokenData.from_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, [0.0] * 4, [0] * 4, {})
    tokens = data.save(tmp_path / "tokens.npz")
    assert main(["train", "--drafter-kind", "mtp", "--target", str(tiny), "--data", str(tokens), "--no-progress",
                 "--seq-len", "32", "--batch", "1000000000000", "--out", str(tmp_path / "run")]) == 2
    line = one_error(capsys, "batch_size (--batch) 1000000000000 x seq_len (--seq-len) 32 needs",
                     "GB of activations a step, more than the device's")
    assert "--blocks" not in line


def test_taps_of_another_targets_width_are_refused_naming_taps(tiny, tmp_path, capsys):
    """Taps of the right layer ids and rows but another target's width fail as one --taps error,
    before the run directory is written (not as an einsum's shape error inside the step)."""
    from dflash_jax.train_data import TapStore, TokenData, build_sequences

    data = TokenData.from_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, [0.0] * 4, [0] * 4, {})
    tokens = data.save(tmp_path / "tokens.npz")
    last = json.loads((tiny / "config.json").read_text())["num_hidden_layers"] - 1
    rows = len(build_sequences(TokenData.load(tokens), 32))
    TapStore.create(tmp_path / "taps", rows, 32, 7, "float32", (last,)).mark_complete()
    out = tmp_path / "run"
    assert main(["train", "--drafter-kind", "mtp", "--target", str(tiny), "--data", str(tokens), "--no-progress",
                 "--seq-len", "32", "--batch", "2", "--steps", "2", "--val-fraction", "0", "--taps",
                 str(tmp_path / "taps"), "--out", str(out)]) == 2
    one_error(capsys, "taps (--taps)", "hold 7 features a token", "make-taps --target")
    assert not (out / "train_run.json").exists()


def test_mtp_taps_not_of_the_last_layer_are_refused_naming_the_layer_to_write(tiny, tmp_path, capsys):
    """An MTP head trains on the target's last layer: a store of another layer (make-taps' default
    taps of a DFlash drafter) is one --taps error that says which --tap-layers to write."""
    from dflash_jax.train_data import TapStore, TokenData, build_sequences

    data = TokenData.from_lists([[1, 2, 3]] * 4, [[4, 5, 6, 7]] * 4, [0.0] * 4, [0] * 4, {})
    tokens = data.save(tmp_path / "tokens.npz")
    hf = json.loads((tiny / "config.json").read_text())
    last = hf["num_hidden_layers"] - 1
    rows = len(build_sequences(TokenData.load(tokens), 32))
    TapStore.create(tmp_path / "taps", rows, 32, hf["hidden_size"], "float32", (last - 1,)).mark_complete()
    out = tmp_path / "run"
    assert main(["train", "--drafter-kind", "mtp", "--target", str(tiny), "--data", str(tokens), "--no-progress",
                 "--seq-len", "32", "--batch", "2", "--steps", "2", "--val-fraction", "0", "--taps",
                 str(tmp_path / "taps"), "--out", str(out)]) == 2
    one_error(capsys, "taps (--taps)", f"hold target layers [{last - 1}]", "target's last layer",
              f"make-taps --tap-layers {last}")
    assert not (out / "train_run.json").exists()


@pytest.mark.parametrize("environ,message", [
    ({"JAX_NUM_PROCESSES": "0"}, "--num-processes (JAX_NUM_PROCESSES) must be >= 1, got 0"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "--process-id (JAX_PROCESS_ID) must be in 0..1"),
    ({"JAX_PROCESS_ID": "-1"}, "--process-id (JAX_PROCESS_ID) must be >= 0, got -1"),
])
def test_coordinator_auto_checks_the_counts_it_is_given(environ, message, monkeypatch, capsys):
    """With --coordinator auto a given process count or id overrides jax's detection, so it is
    checked as with an address, before jax.distributed is asked to join anything."""
    from dflash_jax import distributed as dist

    def no_join(cluster):
        raise AssertionError(f"jax.distributed would be initialized with {cluster}")

    monkeypatch.setattr(dist, "initialize", no_join)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["decode", "--coordinator", "auto", "--input", "in.jsonl", "--output", "out.jsonl",
                 "--batch", "1"]) == 2
    one_error(capsys, message)


@pytest.mark.parametrize("drafter_config", [[1, 2], "mtp", None])
def test_resume_of_a_run_record_whose_drafter_config_is_no_object_is_one_error(drafter_config, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "5").mkdir(parents=True)
    (out / "train_run.json").write_text(json.dumps({"train_config": {}, "drafter_config": drafter_config}))
    assert main(["train", "--resume", "--out", str(out)]) == 2
    one_error(capsys, "train_run.json: not a readable run record")


@pytest.mark.parametrize("name,needle", [("code_heldout.jsonl:5", "a held-out set"),
                                         ("gsm8k/test.jsonl", "evaluation")])
def test_make_data_refuses_evaluation_prompt_files_before_the_target_loads(name, needle, tmp_path, capsys,
                                                                           monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    for path in (tmp_path / "code_heldout.jsonl", tmp_path / "gsm8k" / "test.jsonl"):
        path.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    refuse_loading(monkeypatch)
    assert main(["make-data", "--out", str(tmp_path / "t.npz"), "--prompts", str(tmp_path / name)]) == 2
    one_error(capsys, needle)


def test_train_with_a_taps_directory_that_holds_none_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from dflash_jax.train_data import TokenData

    refuse_loading(monkeypatch)
    (tmp_path / "empty").mkdir()
    tokens = TokenData.from_lists([[1, 2]], [[3, 4, 5]], [0.0], [0], {}).save(tmp_path / "tokens.npz")
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(tokens), "--taps",
                 str(tmp_path / "empty")]) == 2
    one_error(capsys, "--taps: ", "taps.json", "make-taps --out")


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_train_without_its_token_file_is_refused_before_loading(kind, tmp_path, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    missing = tmp_path / "tokens.npz"
    assert main(["train", "--drafter-kind", kind, "--out", str(tmp_path / "run"), "--data", str(missing)]) == 2
    one_error(capsys, f"{missing}: no token file", "--data-gen")

