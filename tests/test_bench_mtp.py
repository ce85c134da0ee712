"""The MTP round benchmark (bench/spec_round.py --mtp-steps / --mtp-budgets, runbook phase
mtp-rounds) on the tiny hybrid shape: the head's state at ctx, one round against a plain forward,
and the rows it reports."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import mtp
from dflash_jax import qwen3_5
from dflash_jax.bench import spec_round as sr
from dflash_jax.speculative import SPEC_COMPILER_OPTIONS, SpecSettings, spec_round

CTX, MAX_LEN = 24, 96


@pytest.fixture(scope="module")
def head():
    cfg = sr.target_shape("tiny-hybrid")
    return cfg, mtp.MTPConfig(cfg), mtp.init_mtp_params(cfg, jax.random.key(2)), sr.init_target(
        cfg, jax.random.key(0), jnp.float32)


def test_state_at_ctx_holds_a_random_head_cache_one_entry_behind(head):
    cfg, mcfg, _, _ = head
    state = sr.make_state(cfg, mcfg, CTX, MAX_LEN, 32, jnp.float32)
    assert isinstance(state.draft_cache, mtp.MTPCache)
    assert int(state.cache.lengths[0]) == CTX and int(state.draft_cache.lengths[0]) == CTX - 1
    assert float(jnp.std(state.draft_cache.k)) > 0.05
    again = sr.reset(state, CTX + 3)
    assert int(again.draft_cache.lengths[0]) == CTX + 2


@pytest.mark.parametrize("steps,budget", [(3, 0), (3, 6)])
def test_one_mtp_round_emits_the_targets_greedy_tokens(head, steps, budget):
    cfg, mcfg, mparams, target = head
    s = SpecSettings(method="mtp", mtp_steps=steps, budget=budget, max_new_tokens=32)
    state = sr.make_state(cfg, mcfg, CTX, MAX_LEN, s.max_new_tokens, jnp.float32)
    after = jax.jit(lambda st: spec_round(st, target, cfg, mparams, mcfg, s))(state)
    produced = int(after.count[0]) - 1
    assert 1 <= produced <= steps + 1
    emitted = np.asarray(after.out[0, 1:1 + produced])
    tokens = jnp.concatenate([state.root, jnp.asarray(emitted[:-1], jnp.int32)])[None]
    ref = qwen3_5.forward(target, cfg, tokens, CTX + jnp.arange(produced, dtype=jnp.int32)[None], state.cache)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(ref.logits[0], -1)), emitted)
    assert int(after.draft_cache.lengths[0]) == CTX + produced - 1


def test_rows_of_mtp_chains_and_trees(head):
    cfg, mcfg, mparams, target = head
    rows = [sr.bench_settings(target, cfg, mparams, mcfg,
                              SpecSettings(method="mtp", mtp_steps=2, budget=b, max_new_tokens=32),
                              CTX, MAX_LEN, profile=False, rounds=2) for b in (0, 4)]
    assert [r["method"] for r in rows] == ["mtp(k=2)", "mtp(k=2)"]
    assert [r["width"] for r in rows] == [3, 5] and [r["budget"] for r in rows] == [0, 4]
    # Compiled as decoding compiles them: every speculative program with the dot merger off.
    assert [r["dot_merger"] for r in rows] == ["off", "off"]
    assert sr.DOT_MERGER["off"].items() <= SPEC_COMPILER_OPTIONS.items()
    assert all(r["round_ms"] > 0 and r["kv_finite"] and r["gdn_state_finite"] for r in rows)


def test_mtp_budgets_need_steps(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["spec_round", "--model", "tiny-hybrid", "--mtp-budgets", "4"])
    with pytest.raises(SystemExit):
        sr.main()
    assert "--mtp-budgets needs --mtp-steps" in capsys.readouterr().err
