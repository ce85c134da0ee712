"""The round benchmarks on a hybrid shape (tiny-hybrid, CPU): the state they time from, one round's
tokens and committed state against a plain forward, the rows they report, and the refusals."""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import qwen3_5
from dflash_jax.bench import decode_loop, spec_round as sr
from dflash_jax.qwen3_5 import HybridCache
from dflash_jax.speculative import SpecSettings, spec_round

CTX, MAX_LEN = 24, 96


@pytest.fixture(scope="module")
def pair():
    """tiny-hybrid target and 5-layer drafter, float32 so that a round can be checked against a forward."""
    cfg = sr.target_shape("tiny-hybrid")
    dcfg = sr.drafter_config(cfg)
    from dflash_jax import drafter as dr
    dparams = dr.init_draft_params(dcfg, jax.random.key(1), jnp.float32)
    return cfg, dcfg, dparams, sr.init_target(cfg, jax.random.key(0), jnp.float32)


def test_state_at_ctx_holds_random_kv_and_gdn_states(pair):
    cfg, dcfg, _, _ = pair
    state = sr.make_state(cfg, dcfg, CTX, MAX_LEN, 32, jnp.float32)
    cache = state.cache
    assert isinstance(cache, HybridCache)
    assert [x.shape for x in cache.k] == [(1, MAX_LEN, cfg.num_kv_heads, cfg.head_dim)] * len(cfg.attn_layers)
    assert [x.shape for x in cache.state] == [(1, cfg.gdn_value_heads, cfg.gdn_key_dim,
                                               cfg.gdn_value_dim)] * len(cfg.gdn_layers)
    assert int(cache.lengths[0]) == CTX and int(state.draft_cache.lengths[0]) == CTX
    for x in cache.k + cache.conv + cache.state:
        assert float(jnp.std(x)) > 0.05  # random, not the zeros a fresh cache holds
    # GDN layers differ from one another, so a rollback that mixed layers up would show.
    assert not np.allclose(cache.state[0], cache.state[1])


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 16)])
def test_one_round_commits_what_a_forward_over_the_emitted_tokens_gives(pair, method, budget):
    """Greedy round from the random state: the emitted tokens are the target's own greedy tokens,
    and the committed cache (GDN states rolled back to the accepted path) is the cache a plain
    forward over the root and the accepted tokens leaves."""
    cfg, dcfg, dparams, target = pair
    s = SpecSettings(method=method, budget=budget, block_size=dcfg.block_size, max_new_tokens=32)
    state = sr.make_state(cfg, dcfg, CTX, MAX_LEN, s.max_new_tokens, jnp.float32)
    after = jax.jit(lambda st: spec_round(st, target, cfg, dparams, dcfg, s))(state)
    produced = int(after.count[0]) - 1  # the accepted drafted tokens and the bonus
    assert 1 <= produced <= dcfg.block_size
    emitted = np.asarray(after.out[0, 1:1 + produced])
    assert ((emitted >= 0) & (emitted < cfg.vocab_size)).all()
    # The committed tokens: the root, then all emitted but the bonus (the next round's root).
    tokens = jnp.concatenate([state.root, jnp.asarray(emitted[:-1], jnp.int32)])[None]
    positions = CTX + jnp.arange(produced, dtype=jnp.int32)[None]
    ref = qwen3_5.forward(target, cfg, tokens, positions, state.cache)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(ref.logits[0], -1)), emitted)
    assert int(after.cache.lengths[0]) == CTX + produced == int(ref.cache.lengths[0])
    assert not np.allclose(after.cache.state, state.cache.state, atol=1e-3)  # the round moved the states
    np.testing.assert_allclose(after.cache.state, ref.cache.state, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(after.cache.conv, ref.cache.conv, rtol=1e-5, atol=1e-5)
    end = CTX + produced
    for got, want in zip(after.cache.k, ref.cache.k):
        np.testing.assert_allclose(got[:, :end], want[:, :end], rtol=1e-5, atol=1e-5)


def test_rows_of_ar_rounds_and_prefill(pair):
    cfg, dcfg, dparams, target = pair
    ar = sr.bench_ar(target, cfg, CTX, MAX_LEN, profile=False)
    assert ar["method"] == "ar" and ar["round_ms"] > 0
    rows = [sr.bench_settings(target, cfg, dparams, dcfg,
                              SpecSettings(method=m, budget=b, block_size=dcfg.block_size, max_new_tokens=32),
                              CTX, MAX_LEN, profile=False, rounds=2) for m, b in (("dflash", 0), ("ddtree", 4))]
    for row, width in zip(rows, (dcfg.block_size, 5)):
        assert row["width"] == width and row["ctx"] == CTX and row["round_ms"] > 0
        assert row["kv_finite"] and row["gdn_state_finite"]
    pre = sr.bench_prefill(target, cfg, dcfg, 40)
    assert "error" not in pre, pre
    assert pre["ctx"] == 40 and pre["logits_finite"]
    assert pre["tokens_per_s"] == pytest.approx(40 / (pre["prefill_ms"] * 1e-3))


def test_prefill_reports_a_failing_length_instead_of_raising(pair, monkeypatch):
    cfg, dcfg, _, target = pair

    def no_memory(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    monkeypatch.setattr(sr, "time_fn", no_memory)
    row = sr.bench_prefill(target, cfg, dcfg, 16)
    assert "RESOURCE_EXHAUSTED" in row["error"] and "tokens_per_s" not in row


def test_unknown_shape_and_hybrid_ar_in_decode_loop_are_refused(monkeypatch, capsys):
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        sr.target_shape("nope")
    monkeypatch.setattr(sys, "argv", ["decode_loop", "--model", "tiny-hybrid", "--method", "ar"])
    with pytest.raises(SystemExit):
        decode_loop.main()
    assert "ar_decode --models tiny-hybrid" in capsys.readouterr().err


def test_dense_state_is_unchanged_in_kind():
    cfg = sr.target_shape("tiny")
    state = sr.make_state(cfg, sr.drafter_config(cfg), 8, 64, 16, jnp.float32)
    assert not isinstance(state.cache, HybridCache) and len(state.cache.k) == cfg.num_layers
    assert dataclasses.is_dataclass(state)


def test_weight_shares_count_the_drawn_weights(pair):
    """The shares come from the config's declarations; the weights actually drawn must give the
    same fractions (GDN mixers, attention mixers, the rest without an untied embedding table)."""
    cfg, _, _, target = pair

    def size(tree):
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    rest = size(target.layers) + size(target.final_norm) + size(target.lm_head if target.lm_head is not None
                                                                 else target.embed)
    total = size(target.gdn) + size(target.attn) + rest
    shares = sr.weight_shares(cfg)
    assert shares == pytest.approx({"gdn": size(target.gdn) / total, "attention": size(target.attn) / total,
                                    "rest": rest / total})
    assert sum(shares.values()) == pytest.approx(1.0)


def test_profiled_round_splits_the_verify_by_layer_kind(pair, capsys):
    """A profiled hybrid round reports the verify's attention and GDN layers under verify/attention
    and verify/gdn, inside the whole verify's time, and the report sets the GDN layers' share of
    that time beside their share of the weight bytes."""
    cfg, dcfg, dparams, target = pair
    s = SpecSettings(method="ddtree", budget=4, block_size=dcfg.block_size, max_new_tokens=32)
    row = sr.bench_settings(target, cfg, dparams, dcfg, s, CTX, MAX_LEN, profile=True, rounds=2)
    split = row["profile"]["by_scope"]
    assert split["verify/attention"] > 0 and split["verify/gdn"] > 0
    assert split["verify"] > split["verify/attention"] + split["verify/gdn"]  # the MLPs and the head too
    assert "attention" not in split and "gdn" not in split
    share = row["gdn_share"]
    assert share["time"] == pytest.approx(split["verify/gdn"] / split["verify"])
    assert share["bytes"] == pytest.approx(sr.weight_shares(cfg)["gdn"])
    sr.print_hybrid_split([row], cfg)
    out = capsys.readouterr().out
    assert f"gdn {share['bytes']:.1%}" in out and f"| {share['time']:.1%} | {share['bytes']:.1%} |" in out


def test_split_verify_keeps_dense_profiles_as_they_are():
    assert sr.split_verify({"draft": 1.0, "verify": 2.0}) == {"draft": 1.0, "verify": 2.0}
    assert sr.split_verify({"verify": 2.0, "attention": 0.5, "gdn": 1.5}) == {
        "verify": 4.0, "verify/attention": 0.5, "verify/gdn": 1.5}
