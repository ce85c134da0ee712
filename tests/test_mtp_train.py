"""Training MTP heads (`train` with an `mtp.MTPConfig`, `dflash-jax train --drafter-kind mtp`): the
packed training pass is the inference draft step, a few steps lower the loss, a run resumes to
the same weights, and the exported head loads and drafts losslessly."""
from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.mtp import FILE, export_mtp, load_mtp
from dflash_jax import mtp
from dflash_jax import train as tr
from dflash_jax.generate import generate_ar
from dflash_jax.impl import Impl
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams
from dflash_jax.speculative import SpecSettings, generate_speculative, target_family
from tests.test_qwen3_5_speculative import target as hybrid_target
from tests.test_train import (target,  # noqa: F401 (a fixture)
                              SEQ, assert_loss_falls, forbid_loading, full_and_resumed, make_dcfg, toy_sequences)

TC = tr.TrainConfig(steps=10, batch_size=4, seq_len=SEQ, learning_rate=1e-2, warmup_fraction=0.1,
                    compute_dtype="float32", seed=3)


HEAD_CASES = [("dense", "post_norm"), ("dense", "pre_norm"), ("hybrid", "post_norm")]


def _head_case(target, kind: str, source: str):
    """A random head on the dense or hybrid tiny target, a 20-token sequence and the target's taps
    of it -> (cfg, params, mcfg, mparams, seq, tokens [1, 20], taps)."""
    cfg, params = target[1:] if kind == "dense" else hybrid_target("interval4")
    mcfg = mtp.MTPConfig(cfg, hidden_source=source)
    mparams = mtp.init_mtp_params(cfg, jax.random.key(5))
    seq = toy_sequences(1).tokens[0, :20] % cfg.vocab_size
    tokens = jnp.asarray(seq)[None]
    taps, _ = tr.target_taps(params, cfg, tokens, mcfg.target_layer_ids, last_pre_norm=source == "pre_norm")
    return cfg, params, mcfg, mparams, seq, tokens, taps


def _cache_after(cfg, params, mcfg, mparams, seq, t: int):
    """The head's cache of a generation whose committed prefix is seq[: t + 1] and whose root is
    seq[t + 1], seeded by `mtp.prefill` from the target's own prefill."""
    prompt = jnp.asarray(seq[:t + 1])[None]
    lens = jnp.asarray([t + 1], jnp.int32)
    pre_norm = mcfg.hidden_source == "pre_norm"
    _, ptaps, _ = target_family(cfg).prefill(params, cfg, prompt, lens, 32, mcfg.target_layer_ids, Impl(), pre_norm)
    return mtp.prefill(mparams, mcfg, params, mtp.MTPCache.create(cfg, 1, 32), prompt, lens, ptaps,
                       jnp.asarray([seq[t + 1]]))


@pytest.mark.parametrize("kind,source", HEAD_CASES)
def test_packed_training_rows_equal_the_inference_draft_step(target, kind, source):
    """Row t of the training pass == the first chained step of a generation whose committed prefix
    is tokens[: t + 1] and whose root is token t + 1 (the head's cache seeded by `mtp.prefill` from
    the target's prefill), at every t: what is trained is what drafts."""
    cfg, params, mcfg, mparams, seq, tokens, taps = _head_case(target, kind, source)
    packed = np.asarray(tr.mtp_packed_logits(mparams, mcfg, params, taps, tokens))[:, :, 0]
    for t in (0, 3, 11, 17):
        cache = _cache_after(cfg, params, mcfg, mparams, seq, t)
        logits, _, _ = mtp.draft_chain(mparams, mcfg, params, cache, jnp.asarray([seq[t + 1]], jnp.int32), 1,
                                       jax.random.key(0), SamplingParams(0.0), False)
        np.testing.assert_allclose(packed[0, t], np.asarray(logits[0, 0]), rtol=1e-4, atol=1e-4, err_msg=f"t={t}")


def _forced_chain(mparams, mcfg, params, cache, chain: list[int]) -> list[np.ndarray]:
    """`mtp.draft_chain`'s steps with the given tokens in place of its argmax ones: step j takes
    chain[j] and step j-1's state, at position lengths + j, over the cache and the chain's own
    scratch entries."""
    hidden, k_buf, v_buf, out_logits = cache.hidden, cache.k, cache.v, []
    for j, tok in enumerate(chain):
        pos = (cache.lengths + j)[:, None]
        nxt, out, k_buf, v_buf = mtp.step(mparams, mcfg, params, jnp.asarray([[tok]], jnp.int32), hidden[:, None],
                                          pos, k_buf, v_buf, cache.lengths + j)
        out_logits.append(np.asarray(mtp.logits(params, mcfg.target, out[:, 0]))[0])
        hidden = nxt[:, 0]
    return out_logits


@pytest.mark.parametrize("kind,source", HEAD_CASES)
def test_chained_training_steps_equal_the_inference_chain(target, kind, source):
    """Step i at row t of a 3-step training pass == step i of a generation's chain from the prefix
    tokens[: t + 1] fed the data's tokens t+1 .. t+3 (teacher forcing): each step sees the cache
    made from the target's states and the chain's own earlier entries, nothing else."""
    cfg, params, mcfg, mparams, seq, tokens, taps = _head_case(target, kind, source)
    packed = np.asarray(tr.mtp_packed_logits(mparams, mcfg, params, taps, tokens, steps=3))
    assert packed.shape[:3] == (1, 20, 3)
    np.testing.assert_allclose(packed[:, :, :1], np.asarray(tr.mtp_packed_logits(mparams, mcfg, params, taps, tokens)),
                               rtol=1e-5, atol=1e-5)
    for t in (0, 5, 16):
        cache = _cache_after(cfg, params, mcfg, mparams, seq, t)
        chain = _forced_chain(mparams, mcfg, params, cache, [int(x) for x in seq[t + 1:t + 4]])
        for j in range(3):
            np.testing.assert_allclose(packed[0, t, j], chain[j], rtol=1e-4, atol=1e-4, err_msg=f"t={t} step {j + 1}")


def test_chained_scores_label_each_step_inside_the_response(target):
    """With mtp_steps 3, step i at t learns token t+i+1 while it is a response token, from the last
    prompt position; step 1's scores are those of a one-step run; the tau estimate counts the
    leading correct steps."""
    _, cfg, params = target
    mcfg = mtp.MTPConfig(cfg)
    mparams = mtp.init_mtp_params(cfg, jax.random.key(5))
    data = toy_sequences(2)
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.arange(2)).items()}
    taps, _ = tr.target_taps(params, cfg, batch["tokens"], mcfg.target_layer_ids)
    tc3 = dataclasses.replace(TC, labels="response", mtp_steps=3)
    s3 = tr.mtp_scores(mparams, params, taps, batch, mcfg=mcfg, tc=tc3)
    s1 = tr.mtp_scores(mparams, params, taps, batch, mcfg=mcfg, tc=dataclasses.replace(tc3, mtp_steps=1))
    assert s3["ce"].shape == (2, SEQ, 3) and s1["ce"].shape == (2, SEQ, 1)
    np.testing.assert_allclose(np.asarray(s3["ce"][..., 0]), np.asarray(s1["ce"][..., 0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(s3["valid"]), np.asarray(s1["valid"]))
    logits = np.asarray(tr.mtp_packed_logits(mparams, mcfg, params, taps, batch["tokens"], steps=3))
    tokens = np.asarray(batch["tokens"])
    for b in range(2):
        p, n = int(data.prompt_lens[b]), int(data.total_lens[b])
        for i in range(1, 4):
            want = np.zeros(SEQ, bool)
            want[p - 1:n - i - 1] = True
            np.testing.assert_array_equal(np.asarray(s3["m"][b, :, i - 1]) > 0, want, err_msg=f"step {i}")
            t = p + 1
            row = logits[b, t, i - 1].astype(np.float64)
            nll = np.log(np.exp(row - row.max()).sum()) + row.max() - row[tokens[b, t + i + 1]]
            np.testing.assert_allclose(float(s3["ce"][b, t, i - 1]), nll, rtol=1e-4)
    correct = np.asarray(s3["correct"])
    run = np.asarray(s3["run"])
    np.testing.assert_array_equal(run, np.cumprod(correct, axis=-1).sum(-1))
    w = np.asarray(s3["w"])[0, int(data.prompt_lens[0]) - 1]  # a block whose three steps all count
    assert w[0] == 1.0 and 1.0 > w[1] > w[2] > 0  # the first step weighs most


def test_mtp_scores_take_the_token_two_ahead_inside_the_response(target):
    """Rows from the last prompt position while t + 2 is a response token; the label is token t + 2
    (response labels) or the target's argmax after t + 1 (target labels); the cross-entropy is
    that of the packed logits."""
    _, cfg, params = target
    mcfg = mtp.MTPConfig(cfg)
    mparams = mtp.init_mtp_params(cfg, jax.random.key(5))
    data = toy_sequences(2)
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.arange(2)).items()}
    taps, greedy = tr.target_taps(params, cfg, batch["tokens"], mcfg.target_layer_ids, labels="target")
    logits = np.asarray(tr.mtp_packed_logits(mparams, mcfg, params, taps, batch["tokens"]))[:, :, 0]
    log_q = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1,
                                                                                                          keepdims=True)
    tokens, greedy = np.asarray(batch["tokens"]), np.asarray(greedy)
    for labels, label_of in (("response", lambda b, t: tokens[b, t + 2]), ("target", lambda b, t: greedy[b, t + 1])):
        s = tr.mtp_scores(mparams, params, taps, batch, mcfg=mcfg, tc=dataclasses.replace(TC, labels=labels),
                          source=None if labels == "response" else jnp.asarray(greedy))
        for b in range(2):
            p, n = int(data.prompt_lens[b]), int(data.total_lens[b])
            want = np.zeros(SEQ, bool)
            want[p - 1:n - 2] = True
            np.testing.assert_array_equal(np.asarray(s["valid"][b]), want)
            for t in (p - 1, p + 4, n - 3):
                np.testing.assert_allclose(float(s["ce"][b, t, 0]), -log_q[b, t, label_of(b, t)], rtol=1e-4,
                                           err_msg=labels)


def _random_ops(fn, *args) -> set[str]:
    """The random-number primitives in fn's traced program (nested jaxprs included)."""
    return set(re.findall(r"\b(random_\w+|threefry\w*)", str(jax.make_jaxpr(fn)(*args))))


def test_an_mtp_step_draws_no_anchors(target):
    """An MTP head scores every response position: its train and eval steps draw no random numbers
    (a DFlash step, the control, draws its anchors), so --blocks is nothing to it, even past
    seq_len, and the step's loss is `loss_fn`'s whatever the key."""
    _, cfg, params = target
    batch = {k: jnp.asarray(v) for k, v in toy_sequences(4).batch(np.arange(4)).items()}
    tc = dataclasses.replace(TC, num_blocks=2 * SEQ)  # more anchors than positions: drawing them fails
    mcfg = mtp.MTPConfig(cfg)
    state = tr.init_state(mtp.head_from_target(params, cfg, jax.random.key(1)), tc)
    assert _random_ops(functools.partial(tr.train_step, cfg=cfg, dcfg=mcfg, tc=tc), state, params, batch) == set()
    assert _random_ops(functools.partial(tr.eval_step, cfg=cfg, dcfg=mcfg, tc=tc), state.params, params, batch,
                       jax.random.key(0)) == set()
    dcfg = make_dcfg(cfg)
    dstate = tr.init_state(tr.fresh_params(dcfg, jax.random.key(0)), TC)
    assert "random_bits" in _random_ops(functools.partial(tr.train_step, cfg=cfg, dcfg=dcfg, tc=TC), dstate, params,
                                        batch)
    _, metrics = tr.train_step(state, params, batch, cfg=cfg, dcfg=mcfg, tc=tc)
    taps, _ = tr.target_taps(params, cfg, batch["tokens"], mcfg.target_layer_ids)
    for key in (jax.random.key(0), jax.random.key(7), None):
        loss, _ = tr.loss_fn(state.params, params, taps, batch, key, dcfg=mcfg, tc=tc)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)


def test_mtp_training_under_data_parallelism_equals_one_device(target, tmp_path):
    """dp = 2 splits only the batch (an MTP step passes no anchors to split): the same losses and
    validation losses as dp = 1, up to the order of the float32 batch sums."""
    _, cfg, params = target
    tc = dataclasses.replace(TC, steps=3)
    kw = dict(init_params=mtp.head_from_target(params, cfg, jax.random.key(1)), log_every=1, progress=False,
              plots=False, export=False, val_fraction=0.2, eval_every=3)
    one = tr.train(params, cfg, mtp.MTPConfig(cfg), toy_sequences(), tc, tmp_path / "dp1", dp=1, **kw)
    two = tr.train(params, cfg, mtp.MTPConfig(cfg), toy_sequences(), tc, tmp_path / "dp2", dp=2, **kw)
    for key in ("loss", "val_loss"):
        a, b = ([r[key] for r in run.history if key in r] for run in (one, two))
        assert len(a) == len(b) > 0, key
        np.testing.assert_allclose(b, a, rtol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def runs(target, tmp_path_factory):
    """A run from the target's last layer, and the same run stopped at step 4 and resumed."""
    _, cfg, params = target
    mcfg = mtp.MTPConfig(cfg)
    init = mtp.head_from_target(params, cfg, jax.random.key(1))
    data = toy_sequences()
    kw = dict(init_params=init, log_every=1, save_every=3, progress=False, val_fraction=0.2, eval_every=5)
    full, _, resumed = full_and_resumed(params, cfg, mcfg, data, TC, tmp_path_factory, 4, **kw)
    return mcfg, init, full, resumed


def test_training_an_mtp_head_reduces_the_loss_and_records_the_run(runs):
    _, _, full, _ = runs
    assert_loss_falls(full.history, TC.steps)
    last = full.history[-1]
    assert len(last["acc_by_pos"]) == 1 and last["tau_estimate"] == pytest.approx(1 + last["acc_by_pos"][0])
    assert any("val_loss" in r for r in full.history)
    record = json.loads((full.out_dir / tr.RUN_FILE).read_text())
    assert record["drafter_config"] == {"kind": "mtp", "hidden_source": "post_norm"}
    assert record["result"]["export"] == str(full.out_dir / "mtp")
    assert (full.out_dir / "plots" / "loss.png").stat().st_size > 0
    assert (full.out_dir / "mtp" / FILE).is_file()


def test_resumed_mtp_training_equals_uninterrupted(runs):
    _, _, full, resumed = runs
    assert int(resumed.state.step) == TC.steps
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(full.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_head_from_target_copies_the_last_layer(target, tmp_path):
    """The exported initial head's layer tensors are transformers' last layer's, name for name."""
    model, cfg, params = target
    export_mtp(mtp.head_from_target(params, cfg, jax.random.key(1)), cfg, tmp_path)
    from safetensors.numpy import load_file

    head = load_file(str(tmp_path / FILE))
    last = {n: p.detach().numpy() for n, p in model.model.layers[-1].named_parameters()}
    assert len(last) == 11  # q, k, v, o, q_norm, k_norm, gate, up, down, two norms
    for name, value in last.items():
        np.testing.assert_array_equal(head[f"mtp.layers.0.{name}"], value, err_msg=name)


def test_hybrid_head_from_target_copies_the_last_full_attention_layer():
    cfg, params = hybrid_target("interval4")
    head = mtp.head_from_target(params, cfg, jax.random.key(1))
    common, attn = head.layer
    for got, want in ((common, params.layers[-1]), (attn, params.attn[-1])):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    cfg5, params5 = hybrid_target("aperiodic")  # its last layer is a GDN layer
    with pytest.raises(ValueError, match="layer 4 is 'linear_attention'"):
        mtp.head_from_target(params5, cfg5, jax.random.key(1))


def test_exported_head_loads_and_drafts_losslessly(runs, target):
    """export -> load_mtp gives the trained weights, and greedy MTP with it == greedy AR, with
    drafted tokens accepted."""
    _, cfg, params = target
    mcfg, _, full, _ = runs
    loaded = load_mtp(full.out_dir / "mtp", cfg)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(full.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    data = toy_sequences(3, seed=7)
    prompts = [data.tokens[i, :data.prompt_lens[i] + 3].tolist() for i in range(3)]
    arr, lens = pad_prompts(prompts, multiple=16)
    arr, lens = jnp.asarray(arr), jnp.asarray(lens)
    ar = generate_ar(params, cfg, arr, lens, jax.random.key(0), max_new_tokens=16, max_len=96)
    s = SpecSettings(method="mtp", mtp_steps=2, max_new_tokens=16)
    g = generate_speculative(params, cfg, loaded, mcfg, arr, lens, jax.random.key(0), settings=s, max_len=96)
    np.testing.assert_array_equal(np.asarray(g.num_tokens), np.asarray(ar.num_tokens))
    for b in range(3):
        n = int(ar.num_tokens[b])
        np.testing.assert_array_equal(np.asarray(g.tokens[b, :n]), np.asarray(ar.tokens[b, :n]))
    assert np.asarray(g.accepted).max() >= 2


def test_pre_norm_head_trains_and_loads_as_pre_norm(target, tmp_path):
    """A pre_norm run takes the target's state before its final norm and exports that setting,
    so `bench --mtp-head` drafts with it; a head without the metadata is post_norm."""
    from dflash_jax.cli import _load_mtp_head_for

    _, cfg, params = target
    mcfg = mtp.MTPConfig(cfg, hidden_source="pre_norm")
    run = tr.train(params, cfg, mcfg, toy_sequences(), dataclasses.replace(TC, steps=2), tmp_path / "run",
                   log_every=1, progress=False, plots=False)
    assert json.loads((run.out_dir / tr.RUN_FILE).read_text())["drafter_config"]["hidden_source"] == "pre_norm"
    loaded_cfg, _ = _load_mtp_head_for(str(run.export_dir), "unused", cfg, jnp.float32)
    assert loaded_cfg == mcfg
    # The two settings train on different states: the same start and data give other losses.
    post = tr.train(params, cfg, mtp.MTPConfig(cfg), toy_sequences(), dataclasses.replace(TC, steps=2),
                    tmp_path / "post", log_every=1, progress=False, plots=False, export=False)
    assert abs(post.history[0]["loss"] - run.history[0]["loss"]) > 1e-3
    from safetensors.numpy import load_file, save_file

    save_file(load_file(str(run.export_dir / FILE)), str(tmp_path / FILE))  # no metadata
    assert _load_mtp_head_for(str(tmp_path), "unused", cfg, jnp.float32)[0].hidden_source == "post_norm"


def test_mtp_pre_norm_refuses_stored_taps(target, tmp_path):
    _, cfg, _ = target

    class Store:
        path, tap_layers = tmp_path, (cfg.num_layers - 1,)

    tr.check_taps(Store(), mtp.MTPConfig(cfg), TC)
    with pytest.raises(ValueError, match="--taps.*pre_norm"):
        tr.check_taps(Store(), mtp.MTPConfig(cfg, hidden_source="pre_norm"), TC)


def test_runbook_mtp_phases_dry(tmp_path):
    """DRY=1 runs mtp-train then eval-mtp on the CPU with SmolLM2 (a few prompts written here):
    `train --drafter-kind mtp` from make-data's token file, the head exported in parts small
    enough to copy back with the run's record, then one bench of every method on it, each
    method's output equal to AR's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "data"
    rows = {"gsm8k/train.jsonl": [{"question": f"Tom has {n} apples and buys {n + 3} more. How many now?"}
                                  for n in range(3)],
            "alpaca_eval/instructions.jsonl": [{"instruction": "Name three colours."}],
            "gsm8k/test.jsonl": [{"question": "A box holds 4 pens. How many pens are in 3 boxes?"}] * 2,
            "spec_bench/question.jsonl": [{"question_id": 1, "category": "writing", "turns": ["Write a haiku."]}] * 2}
    for name, lines in rows.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out"
    env = {**os.environ, "DRY": "1", "JAX_PLATFORMS": "cpu", "DATA": str(data),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", "dflash_jax/bench/gpu_runbook.sh", "mtp-train,eval-mtp", str(out)], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    parts = sorted(out.glob("mtp.safetensors.part_*"))
    assert parts and all(p.stat().st_size <= 16 * 2 ** 20 for p in parts)
    head = out / "run" / "mtp" / "mtp" / FILE
    assert b"".join(p.read_bytes() for p in parts) == head.read_bytes()
    record = json.loads((out / "run" / "mtp" / tr.RUN_FILE).read_text())
    assert record["drafter_config"]["kind"] == "mtp" and record["result"]["finished"]
    assert record["train_config"]["labels"] == "target-soft" and record["init"] == {"mtp_init": "target"}
    report = json.loads((out / "eval_mtp" / "report.json").read_text())
    names = set(report["methods"])
    assert {"ar", "mtp(k=1)", "mtp(k=2)", "mtp(k=2,budget=8)", "dflash(bs=16)", "ddtree(bs=16,budget=16)"} <= names
    assert all(m["matches_ar"] == 1.0 for k, m in report["methods"].items() if k != "ar")


def test_cli_refuses_dflash_settings_and_another_kind_before_loading(runs, tmp_path, capsys, monkeypatch):
    from dflash_jax.cli import main

    forbid_loading(monkeypatch, "the flags")
    assert main(["train", "--drafter-kind", "mtp", "--out", str(tmp_path), "--layers", "2"]) == 2
    assert "--layers is a DFlash drafter's setting; --drafter-kind mtp" in capsys.readouterr().err
    _, _, full, _ = runs
    assert main(["train", "--out", str(full.out_dir), "--resume", "--drafter-kind", "dflash"]) == 2
    assert f"--drafter-kind dflash disagrees with the run in {full.out_dir} (mtp)" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--hidden-source", "pre_norm"]) == 2
    assert "--hidden-source is an MTP head's setting: pass --drafter-kind mtp" in capsys.readouterr().err
    assert main(["train", "--out", str(full.out_dir), "--resume", "--mtp-init", "random"]) == 2
    assert "--mtp-init starts a run; --resume continues" in capsys.readouterr().err


def test_cli_trains_chained_steps_and_refuses_them_for_dflash(tmp_path, capsys):
    """`train --drafter-kind mtp --mtp-train-steps 2` records the setting, logs one accuracy per
    step and exports a head; the flag on a DFlash run is one error, before anything is loaded."""
    from dflash_jax.cli import main
    from dflash_jax.train_data import TokenData
    from tests.test_bad_input import VOCAB, WORDS, save_tokenizer, target_model

    tiny = tmp_path / "tiny"
    target_model(vocab=VOCAB).save_pretrained(tiny)
    save_tokenizer(tiny, WORDS)
    rng = np.random.default_rng(0)
    data = TokenData.from_lists([list(rng.integers(3, 60, 6)) for _ in range(8)],
                                [list(rng.integers(3, 60, 20)) for _ in range(8)], [0.0] * 8, [0] * 8, {})
    tokens = data.save(tmp_path / "tokens.npz")
    out = tmp_path / "run"
    assert main(["train", "--drafter-kind", "mtp", "--mtp-train-steps", "2", "--target", str(tiny), "--data",
                 str(tokens), "--no-progress", "--seq-len", "32", "--batch", "2", "--steps", "3", "--log-every", "1",
                 "--val-fraction", "0", "--out", str(out)]) == 0
    record = json.loads((out / tr.RUN_FILE).read_text())
    assert record["train_config"]["mtp_steps"] == 2
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert logged and all(len(r["acc_by_pos"]) == 2 for r in logged if "acc_by_pos" in r)
    assert (out / "mtp" / FILE).is_file()
    capsys.readouterr()
    assert main(["train", "--mtp-train-steps", "2", "--out", str(tmp_path / "dflash")]) == 2
    assert "--mtp-train-steps is an MTP head's setting: pass --drafter-kind mtp" in capsys.readouterr().err
