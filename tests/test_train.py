"""Drafter training (dflash_jax.train): the packed pass, the loss going down, exact resume, export.

CPU, float32, tiny shapes. One TrainConfig is shared by every run so `train_step` compiles once.
The other training tests (test_mtp_train, test_train_dp, test_train_tp) take their target, data
and run helpers from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert.dflash_drafter import load_drafter
from convert.hf_safetensors import load_hf
from dflash_jax import drafter as dr
from dflash_jax import train as tr
from dflash_jax.params import is_spec
from dflash_jax.train_data import SequenceSet
from tests.spec_models import target_model

VOCAB, MASK, BS, SEQ = 32, 31, 8, 48
TC = tr.TrainConfig(steps=12, batch_size=4, seq_len=SEQ, num_blocks=5, learning_rate=1e-2,
                    warmup_fraction=0.05, compute_dtype="float32", seed=3)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen3 target (transformers), converted; the torch model is the reference."""
    model = target_model(seed=0, vocab=VOCAB)
    directory = tmp_path_factory.mktemp("target")
    model.save_pretrained(directory)
    cfg, params = load_hf(directory)
    return model, cfg, params


def make_dcfg(cfg, **overrides):
    fields = dict(num_layers=2, block_size=BS, mask_token_id=MASK, target_layer_ids=(1, 2),
                  layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    fields.update(overrides)
    return tr.drafter_config_for(cfg, **fields)


def numpy_init(dcfg, seed=0):
    """Drafter weights drawn with numpy (jax.random init compiles slowly on 2 CPU cores)."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        if spec.init == "ones":
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(spec.shape), jnp.float32)
        return jnp.asarray(rng.standard_normal(spec.shape) * spec.fan_in ** -0.5, jnp.float32)

    return jax.tree.map(draw, dr.draft_checkpoint_specs(dcfg), is_leaf=is_spec)


def toy_sequences(n=12, seed=0) -> SequenceSet:
    """Prompts of random tokens, then responses following t -> (5t + 3) mod 30 (learnable)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, SEQ), np.int32)
    plens, tlens = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for i in range(n):
        p, r = int(rng.integers(4, 12)), int(rng.integers(20, SEQ - 12))
        tokens[i, :p] = rng.integers(0, 30, p)
        t = int(rng.integers(0, 30))
        for j in range(r):
            tokens[i, p + j] = t
            t = (5 * t + 3) % 30
        plens[i], tlens[i] = p, p + r
    return SequenceSet(tokens, plens, tlens)


def stop_and_resume(params, cfg, dcfg, data, tc, directory, stop_at, resume_with=None, **kw):
    """A run in `directory` stopped at step `stop_at`, then resumed there to the end, both with
    plots off -> (stopped, resumed). resume_with: keyword arguments of `train` that the resumed
    call changes (another dp or tp)."""
    kw = {**kw, "plots": False}
    part = tr.train(params, cfg, dcfg, data, tc, directory, stop_at=stop_at, **kw)
    resumed = tr.train(params, cfg, dcfg, data, tc, directory, resume=True, **{**kw, **(resume_with or {})})
    return part, resumed


def full_and_resumed(params, cfg, dcfg, data, tc, tmp_path_factory, stop_at, **kw):
    """An uninterrupted run, and the same run in another directory stopped at step `stop_at` then
    resumed (`stop_and_resume`) -> (full, stopped, resumed)."""
    full = tr.train(params, cfg, dcfg, data, tc, tmp_path_factory.mktemp("full"), **kw)
    return (full, *stop_and_resume(params, cfg, dcfg, data, tc, tmp_path_factory.mktemp("resumed"), stop_at, **kw))


def assert_loss_falls(history: list[dict], steps: int) -> list[float]:
    """A run's log holds `steps` finite losses, and the last 3 average under 0.7 x the first 3 -> the losses."""
    losses = [r["loss"] for r in history]
    assert len(losses) == steps and all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    return losses


def time_boxed(target, directory, data, **kw):
    """A run of the make_dcfg drafter with a time limit of 0 (it stops after its first step), log
    every 100 steps and plots off."""
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    return tr.train(params, cfg, dcfg, data, TC, directory, init_params=numpy_init(dcfg), log_every=100,
                    time_limit=0.0, plots=False, progress=False, **kw)


def forbid_loading(monkeypatch, checked: str) -> None:
    """Loading a target (`convert.load_model`) fails the test: the CLI must refuse what `checked`
    names before it loads anything."""
    import convert

    def no_load(*a, **k):
        raise AssertionError(f"the target was loaded before checking {checked}")

    monkeypatch.setattr(convert, "load_model", no_load)


# ----------------------------------------------------------------------------- the packed mask

def explicit_block_mask(anchors, seq_len, bs, causal, window):
    """Per block, drafter.draft's rules written out: context slots < anchor, then its own keys."""
    b_, n_ = anchors.shape
    out = np.zeros((b_, n_ * bs, seq_len + bs), bool)
    for b in range(b_):
        for n in range(n_):
            p = int(anchors[b, n])
            for j in range(bs):
                q = p + j
                for t in range(seq_len):
                    ok = t < p
                    if window is not None:
                        ok = ok and q - t < window and (t <= q if causal else t - q < window)
                    out[b, n * bs + j, t] = ok
                for i in range(bs):
                    k = p + i
                    ok = (i <= j) if causal else True
                    if window is not None:
                        ok = ok and q - k < window and k - q < window
                    out[b, n * bs + j, seq_len + i] = ok
    return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 3), (True, 11)])
def test_packed_block_mask_equals_per_block_construction(causal, window):
    anchors = np.array([[0, 3, 9], [5, 6, 17]], np.int32)
    got = np.asarray(tr.packed_block_mask(jnp.asarray(anchors), 20, 4, causal=causal, window=window))
    np.testing.assert_array_equal(got, explicit_block_mask(anchors, 20, 4, causal, window))


def test_anchors_stay_inside_the_response():
    prompt_lens = jnp.array([3, 10, 7, 30], jnp.int32)
    total_lens = jnp.array([40, 14, 7 + 2, 40], jnp.int32)  # responses of 37, 4, 2, 10 tokens
    sample = jax.jit(tr.sample_anchors, static_argnums=(3, 4))
    for seed in range(5):
        anchors, valid = map(np.asarray, sample(jax.random.key(seed), prompt_lens, total_lens, 40, 6))
        for b in range(4):
            a = anchors[b][valid[b]]
            # p in [prompt_len, total_len - 2]: the root is a response token with a next token.
            assert (a >= int(prompt_lens[b])).all() and (a <= int(total_lens[b]) - 2).all()
            assert len(set(a.tolist())) == len(a) and (np.diff(a) > 0).all()
            assert valid[b].sum() == min(6, int(total_lens[b] - prompt_lens[b]) - 1)
            assert (anchors[b] >= 0).all() and (anchors[b] < 40).all()
    targets, mask = tr.block_targets(jnp.arange(40)[None] * jnp.ones((4, 1), jnp.int32), jnp.asarray(anchors),
                                     jnp.asarray(valid), total_lens, BS)
    t, m = np.asarray(targets), np.asarray(mask)
    # Targets are the tokens at anchor + k (here token == position); none past the response.
    np.testing.assert_array_equal(t[m], (anchors[:, :, None] + np.arange(1, BS))[m])
    assert ((anchors[:, :, None] + np.arange(1, BS) < np.asarray(total_lens)[:, None, None]) | ~m).all()


# ----------------------------------------------------------------------------- the packed pass

def test_packed_forward_equals_draft_on_every_block(target):
    """The training pass over packed blocks == drafter.draft run block by block (inference).

    A causal sliding layer (window 5 < block 8) and a bidirectional full layer; the other
    mask rules are covered by the mask test above.
    """
    _, cfg, params = target
    dcfg = make_dcfg(cfg, input_embedding_scale=1.5)
    dparams = numpy_init(dcfg, seed=1)
    seqs = toy_sequences(3, seed=1)
    tokens = jnp.asarray(seqs.tokens)
    p0, t0 = seqs.prompt_lens[:, None], seqs.total_lens[:, None]
    # First and last possible anchors, overlapping blocks, blocks running past the response.
    anchors = jnp.asarray(np.concatenate([p0, p0 + 1, p0 + 9, t0 - 2], axis=1), jnp.int32)

    @jax.jit
    def training(dparams, tokens, anchors):
        taps, _ = tr.target_taps(params, cfg, tokens, dcfg.target_layer_ids)
        return tr.packed_forward(dparams, dcfg, params, taps, tokens, anchors), taps

    packed, taps = training(dparams, tokens, anchors)

    @jax.jit
    def inference(dparams, taps, tokens, anchors):
        """One sequence per block, its context = the target taps of positions < anchor."""
        b, n = anchors.shape
        flat = anchors.reshape(-1)
        cache = dr.append_context(dparams, dcfg, dr.DraftCache.create(dcfg, batch=b * n, max_len=SEQ + BS),
                                  jnp.repeat(taps, n, axis=0), jnp.broadcast_to(jnp.arange(SEQ), (b * n, SEQ)),
                                  flat)
        blocks = tr.block_tokens(tokens, anchors, dcfg).reshape(b * n, BS)
        return dr.draft(dparams, dcfg, params, cache, blocks, flat)

    ref = inference(dparams, taps, tokens, anchors)
    b, n = anchors.shape
    got, ref = np.asarray(packed).reshape(b * n, BS, -1), np.asarray(ref)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


# ----------------------------------------------------------------------------- training runs

@pytest.fixture(scope="module")
def runs(target, tmp_path_factory):
    """An uninterrupted run, and the same run stopped at step 5 then resumed."""
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    init = numpy_init(dcfg)
    data = toy_sequences()
    kw = dict(init_params=init, log_every=1, save_every=4, progress=False)
    full, part, resumed = full_and_resumed(params, cfg, dcfg, data, TC, tmp_path_factory, 5, **kw)
    return dcfg, full, part, resumed


def test_training_reduces_the_loss(runs):
    _, full, _, _ = runs
    assert_loss_falls(full.history, TC.steps)
    last = full.history[-1]
    assert len(last["acc_by_pos"]) == BS - 1 and last["tau_estimate"] >= 1.0
    assert (full.out_dir / "plots" / "loss.png").stat().st_size > 0
    assert (full.out_dir / "plots" / "accuracy_by_position.png").stat().st_size > 0


def test_resumed_training_equals_uninterrupted(runs):
    _, full, part, resumed = runs
    assert int(part.state.step) == 5 and part.export_dir is None
    assert int(resumed.state.step) == int(full.state.step) == TC.steps
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(full.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The log continues where the checkpoint stopped: same records as the uninterrupted run.
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    logged = [json.loads(l) for l in (resumed.out_dir / tr.LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, TC.steps + 1))


def test_resume_refuses_other_settings(runs, target):
    _, cfg, params = target
    dcfg, _, part, _ = runs
    with pytest.raises(ValueError, match="different train_config.*learning_rate"):
        tr.train(params, cfg, dcfg, toy_sequences(), dataclasses.replace(TC, learning_rate=1e-3), part.out_dir,
                 resume=True, progress=False)
    with pytest.raises(ValueError, match="--resume"):
        tr.train(params, cfg, dcfg, toy_sequences(), TC, part.out_dir, progress=False)


def test_export_loads_in_dflash_and_equals_our_forward(runs, target):
    """The exported run: dflash 0.1.0 DFlashDraftModel.from_pretrained == our drafter (float32)."""
    dflash_model = pytest.importorskip("dflash.model")
    t_model, cfg, params = target
    dcfg, full, _, _ = runs
    assert full.export_dir is not None
    dcfg2, loaded = load_drafter(full.export_dir, training=True)
    assert dcfg2 == dcfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(full.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    model = dflash_model.DFlashDraftModel.from_pretrained(full.export_dir).float().eval()
    seq = toy_sequences(1, seed=5)
    tokens, p = seq.tokens[0], int(seq.prompt_lens[0]) + 6
    block = np.asarray(tr.block_tokens(jnp.asarray(tokens)[None], jnp.array([[p]]), dcfg))[0, 0]
    with torch.no_grad():
        out = t_model(torch.tensor(tokens[None], dtype=torch.long), output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, model.target_layer_ids)[:, :p]
        noise = dflash_model._raw_input_embeddings(t_model, torch.tensor(block[None], dtype=torch.long))
        cache = dflash_model._make_cache(model.config)
        hidden = model(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(p + BS)[None],
                       past_key_values=cache, use_cache=True)
        ref_logits = model.compute_logits(hidden[:, 1:], dflash_model._output_head(t_model))[0].numpy()

    # Ours, as inference runs it (prefill taps -> drafter context -> one draft pass).
    def infer(dparams, tokens, p):
        taps, _ = tr.target_taps(params, cfg, tokens, dcfg.target_layer_ids)
        cache = dr.append_context(dparams, dcfg, dr.DraftCache.create(dcfg, 1, SEQ + BS), taps,
                                  jnp.arange(SEQ)[None], p)
        hidden = dr.draft(dparams, dcfg, params, cache, tr.block_tokens(tokens, p[:, None], dcfg)[:, 0], p)
        return dr.draft_logits(dparams, dcfg, params, hidden)

    # The drafter as inference loads it: the decoding layout.
    ours = np.asarray(jax.jit(infer)(load_drafter(full.export_dir)[1], jnp.asarray(tokens)[None], jnp.array([p])))[0]
    assert np.max(np.abs(ours - ref_logits)) <= 1e-4 * np.max(np.abs(ref_logits))


def test_time_limit_stops_saves_and_exports(target, tmp_path):
    """A time-boxed run ends at the first step past the limit, logs it, and still exports."""
    out = time_boxed(target, tmp_path, toy_sequences())
    assert int(out.state.step) == 1 < TC.steps
    assert [r["step"] for r in out.history] == [1]  # the last step is logged even off log_every
    assert out.export_dir is not None and (out.export_dir / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- validation and keep-best

VAL = dict(val_fraction=0.34, eval_every=3, keep_best=True)  # 6 prompts x 2 rows: 2 prompts held out
# Scripted validation tau by step (the real val_loss / val_acc_by_pos are kept). Step 5 is where
# the interrupted run stops: were its off-schedule evaluation checkpointed as the best, the
# resumed run would export step 5 instead of the uninterrupted run's step 6.
SCRIPTED_TAU = {3: 2.0, 5: 3.5, 6: 3.0, 9: 2.5, 12: 2.2}


def paired_sequences():
    """toy_sequences with 2 rows (samples) per prompt id."""
    data = toy_sequences()
    return dataclasses.replace(data, prompt_ids=np.arange(len(data), dtype=np.int32) // 2)


@pytest.fixture(scope="module")
def val_runs(target, tmp_path_factory):
    """With validation and keep-best: an uninterrupted run, and one stopped at step 5 then resumed.

    train_step is wrapped to record every training batch and the step of each new parameter
    pytree; evaluate keeps its real metrics but reports SCRIPTED_TAU for that step.
    """
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    init = numpy_init(dcfg)
    data = paired_sequences()
    seen_tokens, step_of = [], {}
    real_step, real_eval = tr.train_step, tr.evaluate

    def recording_step(state, target, batch, **kw):
        new, metrics = real_step(state, target, batch, **kw)
        seen_tokens.append(np.asarray(batch["tokens"]))
        step_of[id(new.params)] = (int(new.step), new.params)  # the pytree keeps its id alive
        return new, metrics

    def scripted_eval(params, *args, **kw):
        out = real_eval(params, *args, **kw)
        real_tau = out["val_tau_estimate"]
        out["val_tau_estimate"] = SCRIPTED_TAU.get(step_of[id(params)][0], 1.0)
        out["real_tau"] = real_tau
        return out

    kw = dict(init_params=init, log_every=2, save_every=1, keep=20, progress=False, **VAL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "train_step", recording_step)
        mp.setattr(tr, "evaluate", scripted_eval)
        full, part, resumed = full_and_resumed(params, cfg, dcfg, data, TC, tmp_path_factory, 5, **kw)
    return dcfg, data, full, part, resumed, np.concatenate(seen_tokens)


def test_validation_rows_never_train(val_runs):
    _, data, full, _, _, seen = val_runs
    train_rows, val_rows = tr.split_by_prompt(data.prompt_ids, VAL["val_fraction"], TC.seed)
    assert len(np.unique(data.prompt_ids[val_rows])) == 2 and len(val_rows) == 4
    assert full.summary["val_rows"] == 4 and full.summary["train_rows"] == 8
    assert len(seen) == (TC.steps + 5 + 7) * TC.batch_size  # every training batch of the three runs
    rows = {data.tokens[i].tobytes(): i for i in range(len(data))}
    used = {rows[t.tobytes()] for t in seen}
    assert used == set(train_rows.tolist())  # all training rows used, no validation row ever


def test_validation_metrics_at_the_eval_cadence(val_runs):
    _, _, full, part, resumed, _ = val_runs
    logged = [json.loads(l) for l in (full.out_dir / tr.LOG_FILE).read_text().splitlines()]
    # Every 3 steps (also where the log cadence of 2 does not fall) and at the last step.
    assert [r["step"] for r in logged if "val_loss" in r] == [3, 6, 9, 12]
    assert [r["step"] for r in logged] == [2, 3, 4, 6, 8, 9, 10, 12]
    for r in logged:
        if "val_loss" in r:
            assert np.isfinite(r["val_loss"]) and np.isfinite(r["real_tau"]) and r["real_tau"] >= 1.0
            assert len(r["val_acc_by_pos"]) == BS - 1 and np.isfinite(r["val_acc_by_pos"]).all()
    # The interrupted call also evaluates where it stops; the resumed log keeps that record.
    assert [r["step"] for r in part.history if "val_loss" in r] == [3, 5]
    assert [r["step"] for r in resumed.history if "val_loss" in r] == [3, 5, 6, 9, 12]
    # Same parameters, same fixed batches and anchors: identical validation metrics.
    by_step = {r["step"]: r for r in full.history if "val_loss" in r}
    for r in resumed.history:
        if r["step"] in by_step:
            for k in ("val_loss", "val_acc_by_pos", "real_tau", "loss"):
                assert r[k] == by_step[r["step"]][k]
    summary = json.loads((full.out_dir / tr.RUN_FILE).read_text())["result"]
    assert summary["val_step"] == 12 and summary["val_loss"] == by_step[12]["val_loss"]
    assert (full.out_dir / "plots" / "loss.png").stat().st_size > 0


def test_resume_with_validation_equals_uninterrupted(val_runs):
    _, _, full, part, resumed, _ = val_runs
    assert int(part.state.step) == 5 and part.export_dir is None
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(full.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert part.best_step == 5  # the stopped call's own pick (not exported)
    assert full.best_step == resumed.best_step == 6  # not 5: that evaluation was off schedule
    for a, b in zip(jax.tree.leaves(load_drafter(resumed.export_dir)[1]),
                    jax.tree.leaves(load_drafter(full.export_dir)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_best_exports_the_best_validation_step(val_runs):
    import orbax.checkpoint as ocp

    _, _, full, _, _, _ = val_runs
    summary = json.loads((full.out_dir / tr.RUN_FILE).read_text())["result"]
    assert summary["best_step"] == summary["exported_step"] == 6 and summary["best_val_tau_estimate"] == 3.0
    with ocp.CheckpointManager(full.out_dir / "checkpoints") as mngr:
        saved = mngr.restore(6, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(tr._abstract(full.state))))["state"]
    assert int(saved.step) == 6
    _, exported = load_drafter(full.export_dir, training=True)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and not the last parameters.
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(full.state.params)))


def test_evaluate_uses_the_training_formulas(target):
    """One full validation batch == loss_fn's metrics on it with the same key; filler rows add nothing."""
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    dparams = numpy_init(dcfg, seed=2)
    data = toy_sequences()
    vset = tr.validation_set(data, np.array([1, 4, 6, 7]), TC, max_batches=4)
    got = tr.evaluate(dparams, params, vset, cfg=cfg, dcfg=dcfg, tc=TC)

    @jax.jit
    def train_metrics(dparams, batch, key):
        taps, _ = tr.target_taps(params, cfg, batch["tokens"], dcfg.target_layer_ids)
        return tr.loss_fn(dparams, params, taps, batch, key, dcfg=dcfg, tc=TC)[1]

    ref = jax.device_get(train_metrics(dparams, vset.batches[0], vset.keys[0]))
    assert got["val_loss"] == pytest.approx(float(ref["loss"]), rel=1e-6)
    assert got["val_tau_estimate"] == pytest.approx(float(ref["tau_estimate"]), rel=1e-6)
    np.testing.assert_allclose(got["val_acc_by_pos"], ref["acc_by_pos"], rtol=1e-6)
    # 5 rows -> 2 batches; the second holds row 9 and 3 filler rows without blocks.
    vset = tr.validation_set(data, np.array([1, 4, 6, 7, 9]), TC, max_batches=4)
    assert len(vset.batches) == 2
    sums = tr.eval_step(dparams, params, vset.batches[1], vset.keys[1], cfg=cfg, dcfg=dcfg, tc=TC)
    response = int(data.total_lens[9] - data.prompt_lens[9])
    assert int(sums["blocks"]) == min(TC.num_blocks, response - 1)
    # A fixed set: the same batches and anchors every time.
    again = tr.evaluate(dparams, params, tr.validation_set(data, np.array([1, 4, 6, 7]), TC, 4),
                        cfg=cfg, dcfg=dcfg, tc=TC)
    assert again == got


def test_time_limit_with_keep_best_exports_its_last_evaluation(target, tmp_path):
    out = time_boxed(target, tmp_path, paired_sequences(), **VAL)
    assert int(out.state.step) == 1 and out.best_step == 1
    assert "val_loss" in out.history[-1] and out.summary["exported_step"] == 1
    _, exported = load_drafter(out.export_dir, training=True)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(out.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- target labels

def test_target_labels_take_the_greedy_token_before_each_row():
    """labels="target": row k of the block at p learns greedy[p+k-1], with the same mask."""
    anchors, valid = jnp.array([[2, 9]], jnp.int32), jnp.array([[True, True]])
    tokens = jnp.arange(20, dtype=jnp.int32)[None]
    greedy = 100 + tokens  # greedy[t] = 100 + t: a label's source position is then explicit
    total = jnp.array([14], jnp.int32)
    t, m = map(np.asarray, tr.block_targets(tokens, anchors, valid, total, 4, greedy))
    np.testing.assert_array_equal(t, [[[102, 103, 104], [109, 110, 111]]])
    np.testing.assert_array_equal(m, [[[True] * 3, [True, True, True]]])
    _, m_resp = tr.block_targets(tokens, anchors, valid, jnp.array([11], jnp.int32), 4, greedy)
    np.testing.assert_array_equal(np.asarray(m_resp), [[[True] * 3, [True, False, False]]])
    with pytest.raises(ValueError, match=r"labels \(--labels\) must be one of"):
        tr.TrainConfig(labels="teacher")


def test_target_labels_equal_the_response_on_a_greedy_response(target):
    """On a response the target itself decoded greedily, its greedy next token at every response
    position is the response's next token (float32), so both label sources agree there."""
    from dflash_jax.generate import generate_ar

    _, cfg, params = target
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, 30, (2, 6)), jnp.int32)
    gen = generate_ar(params, cfg, prompt, jnp.array([6, 6], jnp.int32), jax.random.key(0),
                      max_new_tokens=12, max_len=24)
    tokens = jnp.concatenate([prompt, jnp.asarray(gen.tokens)], 1)
    _, greedy = tr.target_taps(params, cfg, tokens, (1, 2), labels="target")
    # greedy[t] predicts token t+1: from the last prompt position to the second-last token.
    np.testing.assert_array_equal(np.asarray(greedy)[:, 5:17], np.asarray(tokens)[:, 6:18])
    taps_only, none = tr.target_taps(params, cfg, tokens, (1, 2))
    assert none is None and taps_only.shape == (2, 18, 2 * cfg.hidden_size)


def test_soft_labels_are_the_kl_to_the_target_at_each_rows_position(target):
    """labels="target-soft": row k of the block at p scores KL(softmax(target logits at p+k-1) ||
    drafter), checked against numpy on the same logits; with a near one-hot target it is the
    hard cross-entropy against the target's greedy token, and `correct` and the mask are those
    of labels="target"."""
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    dparams = numpy_init(dcfg)
    data = toy_sequences()
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.arange(TC.batch_size)).items()}
    tc_soft = dataclasses.replace(TC, labels="target-soft", compute_dtype="float32")
    tc_hard = dataclasses.replace(tc_soft, labels="target")
    taps, logits = tr.target_taps(params, cfg, batch["tokens"], dcfg.target_layer_ids, labels="target-soft")
    assert logits.shape == batch["tokens"].shape + (cfg.vocab_size,)
    key = jax.random.key(3)
    soft = tr.block_scores(dparams, params, taps, batch, key, dcfg=dcfg, tc=tc_soft, source=logits)
    # The drafter's own row logits, recomputed the way block_scores makes them.
    anchors, _ = tr.sample_anchors(key, batch["prompt_lens"], batch["total_lens"], batch["tokens"].shape[1],
                                   TC.num_blocks)
    hidden = tr.packed_forward(dparams, dcfg, params, taps, batch["tokens"], anchors)
    b, n = anchors.shape
    q = np.asarray(dr.draft_logits(dparams, dcfg, params, hidden.reshape(b * n, dcfg.block_size, -1)),
                   np.float64).reshape(b, n, dcfg.block_size - 1, -1)
    lg, an = np.asarray(logits, np.float64), np.asarray(anchors)
    seq = lg.shape[1]
    expected = np.zeros(q.shape[:3])
    for i in range(b):
        for j in range(n):
            for k in range(1, dcfg.block_size):
                p = np.exp(lg[i, min(an[i, j] + k - 1, seq - 1)] - lg[i, min(an[i, j] + k - 1, seq - 1)].max())
                p /= p.sum()
                lq = q[i, j, k - 1] - q[i, j, k - 1].max()
                lq -= np.log(np.exp(lq).sum())
                expected[i, j, k - 1] = np.sum(p * (np.log(p + 1e-300) - lq))
    m = np.asarray(soft["m"]) > 0
    np.testing.assert_allclose(np.asarray(soft["ce"])[m], expected[m], rtol=1e-4, atol=1e-5)
    # A near one-hot target: KL -> the hard cross-entropy on the target's greedy tokens.
    sharp = 1e3 * jax.nn.one_hot(jnp.argmax(logits, -1), cfg.vocab_size)
    soft_sharp = tr.block_scores(dparams, params, taps, batch, key, dcfg=dcfg, tc=tc_soft, source=sharp)
    hard = tr.block_scores(dparams, params, taps, batch, key, dcfg=dcfg, tc=tc_hard,
                           source=jnp.argmax(logits, -1).astype(jnp.int32))
    np.testing.assert_allclose(np.asarray(soft_sharp["ce"])[m], np.asarray(hard["ce"])[m], rtol=1e-4, atol=1e-4)
    for name in ("m", "correct", "run"):
        np.testing.assert_array_equal(np.asarray(soft[name]), np.asarray(hard[name]), err_msg=name)


def assert_few_steps_lower_the_loss(target, out, labels: str) -> None:
    """8 steps with `labels` from the same start: the last 3 losses average < 0.8x the first 3."""
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    tc = dataclasses.replace(TC, labels=labels, steps=8)
    run = tr.train(params, cfg, dcfg, toy_sequences(), tc, out, init_params=numpy_init(dcfg),
                   log_every=1, progress=False, plots=False)
    losses = [r["loss"] for r in run.history]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), (labels, losses)


def test_training_on_soft_labels_reduces_the_loss(target, tmp_path):
    assert_few_steps_lower_the_loss(target, tmp_path / "s", "target-soft")


def test_training_on_target_labels_reduces_the_loss_and_resumes_old_records(target, tmp_path):
    """A few steps with labels="target" lower the loss; a run recorded before `labels` existed
    resumes (the missing setting is its default), and another labels value is refused."""
    assert_few_steps_lower_the_loss(target, tmp_path / "t", "target")
    _, cfg, params = target
    dcfg = make_dcfg(cfg)
    part = tmp_path / "old"
    tr.train(params, cfg, dcfg, toy_sequences(), dataclasses.replace(TC, steps=4), part,
             init_params=numpy_init(dcfg), stop_at=2, progress=False, plots=False)
    record = json.loads((part / tr.RUN_FILE).read_text())
    del record["train_config"]["labels"]
    (part / tr.RUN_FILE).write_text(json.dumps(record))
    resumed = tr.train(params, cfg, dcfg, toy_sequences(), dataclasses.replace(TC, steps=4), part, resume=True,
                       progress=False, plots=False)
    assert int(resumed.state.step) == 4
    with pytest.raises(ValueError, match=r"different train_config.*labels"):
        tr.train(params, cfg, dcfg, toy_sequences(), dataclasses.replace(TC, steps=4, labels="target"), part,
                 resume=True, progress=False, plots=False)


# ----------------------------------------------------------------------------- --init

def test_init_continues_from_an_exported_drafter(runs, target, tmp_path):
    """`train --init`: a run starts from an exported drafter's weights, so its first loss is the
    trained run's level, far below a random start's; its shape comes from the export."""
    _, cfg, params = target
    dcfg, full, _, _ = runs
    dcfg2, init = tr.drafter_from_init(full.export_dir, cfg)
    assert dcfg2 == dcfg
    import hashlib
    record = tr.init_record(full.export_dir)
    weights = (full.export_dir / "model.safetensors").read_bytes()
    assert record["weights_sha256"] == hashlib.sha256(weights).hexdigest()
    assert record["drafter"] == str(full.export_dir)
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(full.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    warm = tr.train(params, cfg, dcfg2, toy_sequences(), TC, tmp_path / "warm", init_params=init, log_every=1,
                    stop_at=2, progress=False, plots=False)
    first_warm, first_fresh = warm.history[0]["loss"], full.history[0]["loss"]
    assert first_warm < 0.7 * first_fresh, (first_warm, first_fresh)


def test_init_refuses_a_drafter_that_does_not_fit(runs, target):
    _, cfg, _ = target
    dcfg, full, _, _ = runs
    with pytest.raises(ValueError, match=r"--layers 3 disagrees with the --init drafter .* \(2\)"):
        tr.drafter_from_init(full.export_dir, cfg, num_layers=3)
    with pytest.raises(ValueError, match=r"--block-size 16 disagrees"):
        tr.drafter_from_init(full.export_dir, cfg, block_size=16)
    wider = dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2)
    with pytest.raises(ValueError, match=r"--init drafter .* does not fit the target: drafter hidden_size"):
        tr.drafter_from_init(full.export_dir, wider)
    assert tr.drafter_from_init(full.export_dir, cfg, num_layers=dcfg.num_layers, block_size=BS)[0] == dcfg


def test_cli_init_with_resume_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from dflash_jax.cli import main

    forbid_loading(monkeypatch, "--init / --resume")
    assert main(["train", "--out", str(tmp_path), "--resume", "--init", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "--init starts a run; --resume continues" in err


# ----------------------------------------------------------------------------- shared by the dp and tp tests

def mesh_run_setup(cfg):
    """The drafter, data and `train` keywords of test_train_dp's and test_train_tp's runs: the
    make_dcfg drafter from numpy_init, paired_sequences, validation and keep-best on, plots off
    -> (dcfg, data, kw)."""
    dcfg = make_dcfg(cfg)
    kw = dict(init_params=numpy_init(dcfg), log_every=1, save_every=4, plots=False, progress=False, **VAL)
    return dcfg, paired_sequences(), kw


@contextlib.contextmanager
def recording_first_inputs(seen: dict):
    """Inside: `train` runs as it does, and `seen` gets what its first train_step call receives
    ("state_in", "target", "batch") and the first validation batch ("val_batch")."""
    real_step, real_eval = tr.train_step, tr.evaluate

    def recording_step(state, target, batch, **k):
        seen.setdefault("state_in", state)
        seen.setdefault("target", target)
        seen.setdefault("batch", batch)
        return real_step(state, target, batch, **k)

    def recording_eval(params, target, vset, **k):
        seen.setdefault("val_batch", vset.batches[0])
        return real_eval(params, target, vset, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "train_step", recording_step)
        mp.setattr(tr, "evaluate", recording_eval)
        yield seen


def assert_refused_before_writing(target, directory, message, tc=TC, cfg=None, **mesh) -> None:
    """`train` (the make_dcfg drafter on paired_sequences, with dp / tp in `mesh`) raises one
    ValueError matching `message` and writes nothing. cfg: the target's config as train is told it
    (default: the target's own)."""
    _, own_cfg, params = target
    with pytest.raises(ValueError, match=message):
        tr.train(params, cfg or own_cfg, make_dcfg(own_cfg), paired_sequences(), tc, directory, progress=False, **mesh)
    assert not directory.exists()


def max_rel_diff(a, b) -> float:
    """max |a - b| / max |b| of one array (0 when both are all zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if a.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


def assert_states_close(got: tr.TrainState, ref: tr.TrainState, rel: float) -> None:
    """Every leaf (params, AdamW moments, step, rng) within `rel` of the reference, relative to its scale."""
    flat, _ = jax.tree_util.tree_flatten_with_path(got)
    assert len(flat) == len(jax.tree.leaves(ref))
    for (path, a), b in zip(flat, jax.tree.leaves(ref)):
        assert np.shape(a) == np.shape(b), jax.tree_util.keystr(path)
        assert max_rel_diff(a, b) <= rel, (jax.tree_util.keystr(path), max_rel_diff(a, b))
