"""MTP drafting (dflash_jax.mtp): lossless chains and trees on dense and hybrid targets, the head's
cache against a from-scratch pass over the target's states, and exact sampling at T > 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.hf_safetensors import load_hf
from dflash_jax import mtp
from dflash_jax import qwen3_5 as q35
from dflash_jax import speculative
from dflash_jax.generate import generate_ar
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams
from dflash_jax.speculative import SpecSettings, generate_speculative
from tests.spec_models import target_model
from tests.test_qwen3_5_speculative import target as hybrid_target
from tests.test_speculative import chi2_against, exact_token_probs

VOCAB = 8  # small, so that a random head's guesses are accepted often enough to matter
NEW = 24
PROMPTS = [[1, 5, 2, 6, 0], [3, 3], [7, 1, 4, 0, 2, 2, 5, 6, 1, 3, 0], [2, 6, 6, 1, 4, 7]]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dense")
    target_model(vocab=VOCAB).save_pretrained(directory)
    cfg, params = load_hf(directory)
    return cfg, params


def head(cfg, seed: int = 3):
    return mtp.MTPConfig(cfg), mtp.init_mtp_params(cfg, jax.random.key(seed))


def batches(prompts, batch):
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        chunk = chunk + [chunk[-1]] * (batch - len(chunk))
        arr, lens = pad_prompts(chunk, multiple=16)
        yield len(prompts[i:i + batch]), jnp.asarray(arr), jnp.asarray(lens)


def ar_tokens(kind, cfg, params, prompts):
    out = []
    for n, arr, lens in batches(prompts, len(prompts)):
        if kind == "dense":
            g = generate_ar(params, cfg, arr, lens, jax.random.key(0), max_new_tokens=NEW, max_len=128)
            toks, count = g.tokens, g.num_tokens
        else:
            toks, count = q35.generate(params, cfg, arr, lens, jax.random.key(0), max_new_tokens=NEW, max_len=128)
        toks, count = np.asarray(toks), np.asarray(count)
        out += [toks[b, :count[b]].tolist() for b in range(n)]
    return out


@pytest.mark.parametrize("kind,steps,budget,batch", [
    ("dense", 1, 0, 3), ("dense", 3, 0, 1), ("dense", 3, 6, 3),
    ("hybrid", 3, 0, 3), ("hybrid", 2, 0, 1), ("hybrid", 3, 6, 1), ("hybrid", 3, 6, 3)])
def test_greedy_mtp_equals_greedy_ar(dense, kind, steps, budget, batch):
    cfg, params = dense if kind == "dense" else hybrid_target("interval4")
    check_greedy_equals_ar(kind, cfg, params, *head(cfg), steps, budget, batch)


def check_greedy_equals_ar(kind, cfg, params, mcfg, mparams, steps, budget, batch):
    """Greedy MTP (a chain, or a tree when budget > 0) gives AR's tokens, and drafts get accepted."""
    want = ar_tokens(kind, cfg, params, PROMPTS)
    s = SpecSettings(method="mtp", mtp_steps=steps, budget=budget, max_new_tokens=NEW)
    got, accepted = [], []
    for n, arr, lens in batches(PROMPTS, batch):
        g = generate_speculative(params, cfg, mparams, mcfg, arr, lens, jax.random.key(0), settings=s, max_len=128)
        toks, count = np.asarray(g.tokens), np.asarray(g.num_tokens)
        got += [toks[b, :count[b]].tolist() for b in range(n)]
        accepted.append(np.asarray(g.accepted)[:n])
    assert got == want
    # Drafted tokens really were accepted (a round committed more than its bonus token).
    assert np.concatenate(accepted, None).max() >= 2


@pytest.mark.parametrize("source", mtp.HIDDEN_SOURCES)
def test_head_cache_holds_the_entries_of_the_target_states(dense, source):
    """After a few rounds, the head's K/V for every committed entry t and its carried state equal
    a from-scratch pass of the head over the target's own states of the emitted sequence (entry t:
    state t with token t + 1), final-normed or not as `hidden_source` says: the draft's own entries
    are never kept, and the verify hands the head the state it asked for."""
    cfg, params = dense
    mcfg, mparams = mtp.MTPConfig(cfg, hidden_source=source), mtp.init_mtp_params(cfg, jax.random.key(3))
    s = SpecSettings(method="mtp", mtp_steps=3, budget=5, max_new_tokens=NEW)
    arr, lens = pad_prompts(PROMPTS[:3], multiple=16)
    arr, lens = jnp.asarray(arr), jnp.asarray(lens)
    state = speculative.start_state(params, cfg, mparams, mcfg, arr, lens, jax.random.key(0), 128, s)
    step = jax.jit(lambda st: speculative.spec_round(st, params, cfg, mparams, mcfg, s))
    for _ in range(4):
        state = step(state)
    cache = state.draft_cache
    committed = np.asarray(state.cache.lengths)
    np.testing.assert_array_equal(np.asarray(cache.lengths), committed - 1)
    out, count = np.asarray(state.out), np.asarray(state.count)
    for b in range(3):
        seq = PROMPTS[b] + out[b, :count[b]].tolist()  # the root is the last token, not in the cache
        assert len(seq) == committed[b] + 1
        tokens = jnp.asarray([seq])
        width = len(seq) - 1
        positions = jnp.arange(width)[None]
        ref = forward(params, cfg, tokens[:, :width], positions,
                      KVCache.create(cfg.num_layers, 1, width, cfg.num_kv_heads, cfg.head_dim),
                      tap_layers=(cfg.num_layers - 1,), last_tap_pre_norm=source == "pre_norm").taps
        empty = mtp.MTPCache.create(cfg, 1, width)
        _, _, k, v = mtp.step(mparams, mcfg, params, tokens[:, 1:], ref, positions, empty.k, empty.v,
                              jnp.zeros((1,), jnp.int32))
        n = width - 1  # committed entries; entry `width - 1` is the next draft's first step
        np.testing.assert_allclose(np.asarray(cache.k[b, :n]), np.asarray(k[0, :n]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(cache.v[b, :n]), np.asarray(v[0, :n]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(cache.hidden[b]), np.asarray(ref[0, -1]), rtol=1e-4, atol=1e-5)


PROMPT = [1, 5, 2, 6, 0]
N = 6000


def sample_tokens(cfg, params, mcfg, mparams, s, n, count, seed=0):
    arr = jnp.asarray(np.tile(np.asarray(PROMPT, np.int32), (count, 1)))
    lens = jnp.full((count,), len(PROMPT), jnp.int32)
    g = generate_speculative(params, cfg, mparams, mcfg, arr, lens, jax.random.key(seed), settings=s, max_len=32)
    assert (np.asarray(g.num_tokens) == n).all()
    return np.asarray(g.tokens[:, :n])


# Chains of 1 step commit at most 2 tokens a round, so the 4th token comes from a later round
# (drafted from the head's committed cache); a chain of 3 drafts the first round's tokens 2-4.
@pytest.mark.parametrize("steps,budget", [(1, 0), (3, 0), (1, 3)], ids=["chain1", "chain3", "tree1x3"])
def test_sampled_mtp_tokens_follow_the_target_distribution(dense, steps, budget):
    cfg, params = dense
    mcfg, mparams = head(cfg)
    sp = SamplingParams(1.0)
    s = SpecSettings(method="mtp", mtp_steps=steps, budget=budget, sampling=sp, max_new_tokens=4)
    p = exact_token_probs(cfg, params, PROMPT, sp, n=4)
    assert chi2_against(p, sample_tokens(cfg, params, mcfg, mparams, s, 4, N, seed=1)) > 1e-3


def test_chi2_detects_mtp_drafts_that_are_not_samples_of_their_probabilities(dense, monkeypatch):
    """Negative control: a chain that drafts the head's argmax but hands the rejection sampling
    the head's distribution (as if it had sampled) accepts its drafts too often; the same test
    must catch it."""
    real = mtp.draft_chain

    def greedy_drafts(*args, **kwargs):
        logits, _, probs = real(*args, **kwargs)
        return logits, jnp.argmax(logits, -1).astype(jnp.int32), probs

    monkeypatch.setattr(mtp, "draft_chain", greedy_drafts)
    jax.clear_caches()
    cfg, params = dense
    mcfg, mparams = head(cfg)
    sp = SamplingParams(1.0)
    s = SpecSettings(method="mtp", mtp_steps=3, sampling=sp, max_new_tokens=3)
    p = exact_token_probs(cfg, params, PROMPT, sp, n=3)
    assert chi2_against(p, sample_tokens(cfg, params, mcfg, mparams, s, 3, N, seed=1)) < 1e-3
    monkeypatch.undo()
    jax.clear_caches()


def test_bad_mtp_settings(dense):
    cfg, _ = dense
    with pytest.raises(ValueError, match="mtp_steps"):
        SpecSettings(method="mtp")
    with pytest.raises(ValueError, match="mtp_steps"):
        SpecSettings(method="dflash", mtp_steps=2)
    assert SpecSettings(method="mtp", mtp_steps=3).block_size == 4
    assert SpecSettings(method="mtp", mtp_steps=3, budget=0).is_chain
    assert not SpecSettings(method="mtp", mtp_steps=3, budget=8).is_chain
    with pytest.raises(ValueError, match="hidden_source"):
        mtp.MTPConfig(cfg, hidden_source="after")


def test_head_from_a_target_whose_last_layer_is_gdn_names_the_flag_that_avoids_it():
    cfg, params = hybrid_target("aperiodic")  # its last layer is a GDN layer
    with pytest.raises(ValueError, match=r"layer 4 is 'linear_attention'.*\(train --mtp-init random\)"):
        mtp.head_from_target(params, cfg, jax.random.key(1))


# ----------------------------------------------------------------------------- hidden_source "pre_norm"

@pytest.mark.parametrize("kind,steps,budget,batch", [("dense", 3, 0, 3), ("dense", 2, 5, 1), ("hybrid", 3, 0, 3),
                                                     ("hybrid", 2, 5, 3)])
def test_greedy_pre_norm_mtp_equals_greedy_ar(dense, kind, steps, budget, batch):
    cfg, params = dense if kind == "dense" else hybrid_target("interval4")
    mcfg, mparams = mtp.MTPConfig(cfg, hidden_source="pre_norm"), mtp.init_mtp_params(cfg, jax.random.key(3))
    check_greedy_equals_ar(kind, cfg, params, mcfg, mparams, steps, budget, batch)


def _final_norm_input(model, tokens: list[int]) -> np.ndarray:
    """transformers' residual stream entering the final norm (a forward hook): [T, embed]."""
    import torch

    seen = {}
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    hook.remove()
    return seen["x"][0].numpy()


def test_pre_norm_head_takes_the_state_before_the_final_norm_and_drafts_differently(dense):
    """The carried state after the prefill is transformers' residual stream before the final norm
    (pre_norm) or the final-normed one (post_norm), and the two settings draft differently."""
    cfg, params = dense
    mparams = mtp.init_mtp_params(cfg, jax.random.key(3))
    prompt = PROMPTS[2]
    arr, lens = pad_prompts([prompt], multiple=16)
    arr, lens = jnp.asarray(arr), jnp.asarray(lens)
    pre_ref = _final_norm_input(target_model(vocab=VOCAB), prompt)[-1]
    states, logits = {}, {}
    for source in mtp.HIDDEN_SOURCES:
        mcfg = mtp.MTPConfig(cfg, hidden_source=source)
        s = SpecSettings(method="mtp", mtp_steps=3, max_new_tokens=NEW)
        state = speculative.start_state(params, cfg, mparams, mcfg, arr, lens, jax.random.key(0), 64, s)
        states[source] = np.asarray(state.draft_cache.hidden[0])
        logits[source], _, _ = mtp.draft_chain(mparams, mcfg, params, state.draft_cache, state.root, 3,
                                               jax.random.key(0), SamplingParams(0.0), False)
    np.testing.assert_allclose(states["pre_norm"], pre_ref, rtol=1e-4, atol=1e-4)
    w = np.asarray(params.final_norm)
    normed = pre_ref / np.sqrt(np.mean(pre_ref ** 2) + cfg.rms_norm_eps) * w
    np.testing.assert_allclose(states["post_norm"], normed, rtol=1e-4, atol=1e-4)
    assert np.abs(states["pre_norm"] - states["post_norm"]).max() > 0.1
    assert np.abs(np.asarray(logits["pre_norm"]) - np.asarray(logits["post_norm"])).max() > 1e-2


def test_hybrid_last_tap_pre_norm_is_the_state_the_final_norm_takes():
    """qwen3_5.forward and verify: the last layer's tap with last_tap_pre_norm, put through the
    final norm, is the default (final-normed) tap, and differs from it."""
    cfg, params = hybrid_target("interval4")
    tokens = jnp.asarray([[1, 5, 2, 6, 0, 3]])
    positions = jnp.arange(6)[None]
    last = (cfg.num_layers - 1,)
    taps = {}
    for pre in (False, True):
        cache = q35.HybridCache.create(cfg, 1, 16)
        taps[pre] = q35.forward(params, cfg, tokens, positions, cache, tap_layers=last, last_tap_pre_norm=pre).taps
    np.testing.assert_allclose(np.asarray(q35.zero_centred_rms_norm(taps[True], params.final_norm, cfg.rms_norm_eps)),
                               np.asarray(taps[False]), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(taps[True] - taps[False])).max() > 0.1
