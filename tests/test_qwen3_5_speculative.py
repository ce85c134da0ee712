"""DFlash and DDTree on a Qwen3.5 / Qwen3.6 hybrid target: exact state rollback, lossless output.

Tiny random hybrids (dflash_jax.qwen3_5, CPU, float32). The verify runs every GDN layer over the
tree from the committed state and keeps what the commit needs; the commit must leave exactly the
cache that a plain forward over the accepted tokens alone leaves (rollback), and greedy speculative
decoding must give plain AR's tokens (`qwen3_5.generate`), with a random drafter and with an oracle
drafter that proposes AR's continuation with errors at chosen depths, so that every acceptance
length (and, for DDTree, paths through non-first children) occurs.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import drafter as dr
from dflash_jax import qwen3_5 as q35
from dflash_jax import speculative
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams, sampling_probs
from dflash_jax.speculative import SpecSettings, generate_speculative
from dflash_jax.tree import build_tree, chain_tree

L_, F_ = q35.LINEAR, q35.FULL
VOCAB = 8  # small, so that a random drafter's guesses are accepted often enough to matter
NEW = 32
# Committed states and K/V against a forward of the accepted tokens: float32 rounding of a W-node
# verify and a T-token forward differ (other matmul shapes), by up to 1.3e-5 of the scale on one
# CPU kind; a wrong path, slot or state is off by the order of the scale itself.
TOL = 1e-4
LOGIT_TOL = 1e-4  # logits and taps, as the model's own numerics tests


def tiny_config(layer_types: tuple[str, ...], tied: bool) -> q35.Qwen35Config:
    return q35.Qwen35Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, layer_types=layer_types,
                            num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=4, gdn_key_heads=2,
                            gdn_value_heads=4, gdn_key_dim=8, gdn_value_dim=6, rope=q35.RopeConfig(theta=10000.0),
                            tie_word_embeddings=tied)


def tiny_params(cfg: q35.Qwen35Config, seed: int) -> q35.Qwen35Params:
    """Random weights (the default draw) with non-trivial norms. Larger weights make the tiny
    stack chaotic: float32 rounding then grows ~1e-5 relative per layer, hiding what the
    rollback tests measure."""
    params = q35.init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            out.append(x + 0.3 * jax.random.normal(k, x.shape, x.dtype))
        else:
            out.append(x)
    return jax.tree.unflatten(treedef, out)


# Qwen3.5's pattern of 3 GDN + 1 attention (twice), and an irregular pattern with a tied head.
TARGETS = {
    "interval4": ((L_, L_, L_, F_) * 2, False),
    "aperiodic": ((F_, L_, F_, L_, L_), True),
}


@functools.lru_cache(maxsize=None)
def target(name: str) -> tuple[q35.Qwen35Config, q35.Qwen35Params]:
    layer_types, tied = TARGETS[name]
    cfg = tiny_config(layer_types, tied)
    return cfg, tiny_params(cfg, seed=len(layer_types))


def drafter_for(cfg: q35.Qwen35Config, block_size: int) -> tuple[dr.DraftConfig, dr.DraftParams]:
    n = cfg.num_layers
    dcfg = dr.DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=48, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                          target_layer_ids=(1, n - 2), num_target_layers=n, block_size=block_size,
                          layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    dr.validate_pair(dcfg, cfg)
    return dcfg, dr.init_draft_params(dcfg, jax.random.key(5))


def prompt_set(n: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, rng.randint(2, 20)).tolist() for _ in range(n)]


def run_batches(fn, prompts: list[list[int]], batch: int) -> list[list[int]]:
    """`fn(arr, lens)` -> (tokens [B, N], num_tokens [B]) over the prompts in batches -> token lists."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        chunk = chunk + [chunk[-1]] * (batch - len(chunk))  # one compiled shape
        arr, lens = pad_prompts(chunk, multiple=32)
        toks, n = (np.asarray(x) for x in fn(jnp.asarray(arr), jnp.asarray(lens)))
        out += [toks[b, :n[b]].tolist() for b in range(len(prompts[i:i + batch]))]
    return out


@functools.lru_cache(maxsize=None)
def ar_tokens(name: str, n_prompts: int) -> list[list[int]]:
    cfg, params = target(name)
    return run_batches(lambda a, l: q35.generate(params, cfg, a, l, jax.random.key(0), max_new_tokens=NEW,
                                                 max_len=a.shape[1] + NEW), prompt_set(n_prompts), n_prompts)


# ----------------------------------------------------------------------------- exact rollback

def prefilled(cfg: q35.Qwen35Config, params: q35.Qwen35Params, prompts: list[list[int]], max_len: int
              ) -> q35.HybridCache:
    """The cache after ragged prompts and then two one-token steps (so the states are not fresh)."""
    arr, lens = pad_prompts(prompts, multiple=8)
    batch, width = arr.shape
    cache = q35.HybridCache.create(cfg, batch, max_len)
    pos = jnp.broadcast_to(jnp.arange(width), (batch, width))
    cache = q35.forward(params, cfg, jnp.asarray(arr), pos, cache, jnp.asarray(lens)).cache
    for tok in (3, 5):
        tokens = jnp.full((batch, 1), tok, jnp.int32)
        cache = q35.forward(params, cfg, tokens, cache.lengths[:, None], cache).cache
    return cache


def assert_close_to_scale(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    """max |got - want| <= tol * max |want|: float32 rounding of the layers before differs between
    a W-node verify and a T-token forward (other matmul shapes), and it scales with the values."""
    err = float(np.abs(got - want).max(initial=0.0))
    scale = float(np.abs(want).max(initial=0.0))
    assert err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} against max |value| {scale:.3g}"


def assert_committed_like_forward(cfg, params, cache0, committed, path_tokens, accepted):
    """committed (from verify + commit) equals a plain forward of each sequence's accepted tokens
    path_tokens[b, :accepted[b]] from cache0: GDN states, conv states, attention K/V, lengths."""
    lens0 = np.asarray(cache0.lengths)
    positions = cache0.lengths[:, None] + jnp.arange(path_tokens.shape[1])
    ref = q35.forward(params, cfg, jnp.asarray(path_tokens), positions, cache0, jnp.asarray(accepted, jnp.int32)).cache
    np.testing.assert_array_equal(np.asarray(committed.lengths), lens0 + accepted)
    for b in range(len(accepted)):
        for field in ("state", "conv"):
            assert_close_to_scale(np.asarray(getattr(committed, field))[:, b], np.asarray(getattr(ref, field))[:, b],
                                  TOL, f"{field} of sequence {b}, {accepted[b]} accepted")
        used = int(lens0[b] + accepted[b])
        for field in ("k", "v"):
            assert_close_to_scale(np.asarray(getattr(committed, field))[:, b, :used],
                                  np.asarray(getattr(ref, field))[:, b, :used], TOL, f"{field} of sequence {b}")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_chain_commit_equals_forward_over_the_accepted_tokens(name):
    """DFlash: for every accepted length m in 0..bs-1 (a different one per sequence), the committed
    cache equals a forward over the accepted tokens alone, and every chain node's logits and taps
    equal a forward's over the block. The chain has padding slots past the block (W > bs)."""
    cfg, params = target(name)
    bs, width = 6, 8
    cache0 = prefilled(cfg, params, [[1, 2, 3, 4, 5], [6, 0, 2], [4, 4, 1, 0, 3, 2, 7, 1, 5]], max_len=48)
    batch = 3
    block = jnp.asarray(np.random.RandomState(1).randint(0, VOCAB, (batch, bs)), jnp.int32)
    tree = chain_tree(block, width)
    taps = (1, cfg.num_layers - 1)
    logits, tap_out, verified = q35.verify(params, cfg, tree.tokens, cache0.lengths[:, None] + tree.depths,
                                           tree.visible, tree.parents, cache0, tap_layers=taps)
    ref = q35.forward(params, cfg, block, cache0.lengths[:, None] + jnp.arange(bs), cache0, tap_layers=taps)
    assert_close_to_scale(np.asarray(logits[:, :bs]), np.asarray(ref.logits), LOGIT_TOL, "chain logits")
    assert_close_to_scale(np.asarray(tap_out[:, :bs]), np.asarray(ref.taps), LOGIT_TOL, "chain taps")
    for m in range(bs):
        ms = np.array([m, bs - 1 - m, (m + 2) % bs])
        path = np.minimum(np.arange(bs)[None], ms[:, None])  # as dflash_jax.accept pads it
        committed = q35.commit(verified, jnp.asarray(path), jnp.asarray(ms + 1))
        assert_committed_like_forward(cfg, params, cache0, committed, np.asarray(block), ms + 1)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_tree_commit_equals_forward_along_the_accepted_path(name):
    """DDTree: for random trees and random accepted paths (any node may end the path), the committed
    cache equals a forward over the path's tokens alone, and each path node's logits equal that
    forward's; a sequence with accepted = 0 keeps its cache."""
    cfg, params = target(name)
    bs, budget, batch = 6, 12, 3
    rng = np.random.RandomState(2)
    cache0 = prefilled(cfg, params, [[1, 2, 3], [6, 0, 2, 5, 5, 1], [4, 4]], max_len=48)
    for trial in range(4):
        log_probs = jax.nn.log_softmax(jnp.asarray(2.0 * rng.randn(batch, bs - 1, VOCAB), jnp.float32), -1)
        tree = build_tree(log_probs, jnp.asarray(rng.randint(0, VOCAB, batch), jnp.int32), budget, budget + 1)
        logits, _, verified = q35.verify(params, cfg, tree.tokens, cache0.lengths[:, None] + tree.depths,
                                         tree.visible, tree.parents, cache0)
        parents, tokens, depths = (np.asarray(x) for x in (tree.parents, tree.tokens, tree.depths))
        last = rng.randint(0, budget + 1, batch)
        path = np.zeros((batch, bs), np.int32)
        for b in range(batch):
            node, nodes = last[b], []
            while node >= 0:
                nodes.append(node)
                node = parents[b, node]
            nodes = nodes[::-1]
            assert [depths[b, n] for n in nodes] == list(range(len(nodes)))
            path[b] = nodes + [nodes[-1]] * (bs - len(nodes))
        accepted = depths[np.arange(batch), last] + 1
        path_tokens = np.take_along_axis(tokens, path, 1)
        committed = q35.commit(verified, jnp.asarray(path), jnp.asarray(accepted))
        assert_committed_like_forward(cfg, params, cache0, committed, path_tokens, accepted)
        ref = q35.forward(params, cfg, jnp.asarray(path_tokens), cache0.lengths[:, None] + jnp.arange(bs), cache0)
        for b in range(batch):
            got = np.asarray(logits[b])[path[b, :accepted[b]]]
            assert_close_to_scale(got, np.asarray(ref.logits[b, :accepted[b]]), LOGIT_TOL, f"path logits of {b}")
        if trial == 0:
            kept = q35.commit(verified, jnp.asarray(path), jnp.asarray([0, accepted[1], 0]))
            for field in ("state", "conv"):
                got = np.stack([np.asarray(x) for x in getattr(kept, field)])  # [GDN layers, batch, ...]
                was = np.stack([np.asarray(x) for x in getattr(cache0, field)])
                np.testing.assert_array_equal(got[:, [0, 2]], was[:, [0, 2]])
                assert np.abs(got[:, 1] - was[:, 1]).max() > 1e-3  # the middle one did move
            np.testing.assert_array_equal(np.asarray(kept.lengths), np.asarray(cache0.lengths) + [0, accepted[1], 0])


def test_verify_and_commit_bad_arguments():
    cfg, params = target("interval4")
    cache = q35.HybridCache.create(cfg, 2, 32)
    tree = chain_tree(jnp.zeros((2, 4), jnp.int32))
    pos = tree.depths
    with pytest.raises(ValueError, match="visible must be bool"):
        q35.verify(params, cfg, tree.tokens, pos, tree.visible.astype(jnp.int32), tree.parents, cache)
    with pytest.raises(ValueError, match="parents must be"):
        q35.verify(params, cfg, tree.tokens, pos, tree.visible, tree.parents[:, :3], cache)
    with pytest.raises(ValueError, match="positions must be"):
        q35.verify(params, cfg, tree.tokens, pos[:, :2], tree.visible, tree.parents, cache)
    # Params or a cache of another layer pattern: named, not an index error deep in the layer loop.
    fewer = q35.HybridCache.create(dataclasses.replace(cfg, layer_types=cfg.layer_types[:4]), 2, 32)
    with pytest.raises(ValueError, match="verify: cache.k holds 1 layers; the config has 2 attention layers"):
        q35.verify(params, cfg, tree.tokens, pos, tree.visible, tree.parents, fewer)
    with pytest.raises(ValueError, match="forward: params.gdn holds 5 layers; the config has 6 GDN layers"):
        q35.forward(dataclasses.replace(params, gdn=params.gdn[:-1]), cfg, tree.tokens, pos, cache)
    _, _, verified = q35.verify(params, cfg, tree.tokens, pos, tree.visible, tree.parents, cache)
    with pytest.raises(ValueError, match="accepted must be"):
        q35.commit(verified, jnp.zeros((2, 4), jnp.int32), jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="path must be"):
        q35.commit(verified, jnp.zeros((4,), jnp.int32), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="Qwen35Config"):
        speculative.target_family(object())


# ----------------------------------------------------------------------------- lossless, random drafter

SETTINGS = {
    "dflash4": SpecSettings(method="dflash", block_size=4, max_new_tokens=NEW),
    "dflash16": SpecSettings(method="dflash", block_size=16, max_new_tokens=NEW),
    "ddtree1": SpecSettings(method="ddtree", block_size=8, budget=1, max_new_tokens=NEW),
    "ddtree4": SpecSettings(method="ddtree", block_size=8, budget=4, max_new_tokens=NEW),
    "ddtree16": SpecSettings(method="ddtree", block_size=8, budget=16, max_new_tokens=NEW),
    "ddtree64": SpecSettings(method="ddtree", block_size=8, budget=64, max_new_tokens=NEW),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_speculative_equals_greedy_ar_random_drafter(setting, batch):
    name = "interval4" if batch == 3 else "aperiodic"
    cfg, params = target(name)
    s = SETTINGS[setting]
    dcfg, dparams = drafter_for(cfg, s.block_size)
    accepted = []

    def fn(a, l):
        g = generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0), settings=s,
                                 max_len=a.shape[1] + NEW + s.cache_slack())
        accepted.append(np.asarray(g.accepted))
        return g.tokens, g.num_tokens

    assert run_batches(fn, prompt_set(20), batch) == ar_tokens(name, 20)
    assert np.concatenate(accepted).max() >= 2  # drafted tokens really were accepted


@pytest.mark.parametrize("setting", ["dflash4", "ddtree16"])
def test_greedy_speculative_with_the_attention_kernel_equals_greedy_ar(setting):
    """The attention layers through the Triton tree-attention kernel (interpreted: Impl(attention=
    "interpret")), in the AR loop and in the rounds' verify, give greedy AR's tokens."""
    from dflash_jax.impl import Impl

    name, batch, n = "interval4", 3, 6
    cfg, params = target(name)
    s = SETTINGS[setting]
    dcfg, dparams = drafter_for(cfg, s.block_size)
    impl = Impl(attention="interpret")

    def spec(a, l):
        g = generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0), settings=s,
                                 max_len=a.shape[1] + NEW + s.cache_slack(), impl=impl)
        return g.tokens, g.num_tokens

    def ar(a, l):
        return q35.generate(params, cfg, a, l, jax.random.key(0), max_new_tokens=NEW, max_len=a.shape[1] + NEW,
                            attn_impl=impl.attention)

    want = ar_tokens(name, 20)[:n]
    assert run_batches(ar, prompt_set(n), batch) == want
    assert run_batches(spec, prompt_set(n), batch) == want


def test_attention_layers_run_the_impl_they_are_given():
    """forward and verify put the attention core through `pallas_kernels.tree_attention` with the
    impl they are given: a Pallas call for "interpret", none for "reference"."""
    cfg, params = target("aperiodic")
    tree = chain_tree(jnp.zeros((1, 3), jnp.int32))
    tokens, width = tree.tokens, tree.tokens.shape[1]
    pos = jnp.arange(width, dtype=jnp.int32)[None]
    cache = q35.HybridCache.create(cfg, 1, width + 8)
    for impl, calls in (("interpret", True), ("reference", False)):
        fwd = str(jax.make_jaxpr(lambda c: q35.forward(params, cfg, tokens, pos, c, attn_impl=impl).logits)(cache))
        ver = str(jax.make_jaxpr(lambda c: q35.verify(params, cfg, tokens, pos, tree.visible, tree.parents, c,
                                                      attn_impl=impl)[0])(cache))
        assert ("pallas_call" in fwd, "pallas_call" in ver) == (calls, calls), impl


def test_lossless_check_catches_a_state_that_keeps_rejected_drafts(monkeypatch):
    """A commit whose GDN state runs over the whole verified block (rejected drafts included, as
    a cache crop that trims only the conv state would leave it) must fail the greedy check."""
    from dflash_jax import gdn

    real = gdn.commit_state

    def whole_block(state0, kept, path_mask, last):
        width = path_mask.shape[1]
        return real(state0, kept, jnp.ones_like(path_mask), jnp.full_like(last, width - 1))

    monkeypatch.setattr(gdn, "commit_state", whole_block)
    jax.clear_caches()  # generate_speculative's program was traced with the exact commit
    name = "interval4"
    cfg, params = target(name)
    s = SETTINGS["dflash4"]
    dcfg, dparams = drafter_for(cfg, s.block_size)

    def fn(a, l):
        g = generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0), settings=s,
                                 max_len=a.shape[1] + NEW + s.cache_slack())
        return g.tokens, g.num_tokens

    # The same run as test_greedy_speculative_equals_greedy_ar_random_drafter[dflash4-3], which matches.
    assert run_batches(fn, prompt_set(20), 3) != ar_tokens(name, 20)
    monkeypatch.undo()
    jax.clear_caches()


def test_stage_times_run_hybrid_rounds():
    """Stage by stage (`stage_times.time_stages`, each stage its own program), a hybrid target's
    rounds give the fused generation's tokens and acceptance, every stage is timed, and the verify
    is split into its attention, GDN and other work, parts that sum to the verify."""
    from dflash_jax.stage_times import STAGES, VERIFY_PARTS, time_stages

    cfg, params = target("interval4")
    s = SpecSettings(method="ddtree", block_size=8, budget=8, max_new_tokens=16)
    dcfg, dparams = drafter_for(cfg, s.block_size)
    arr, lens = (jnp.asarray(x) for x in pad_prompts(prompt_set(3), multiple=32))
    fused = generate_speculative(params, cfg, dparams, dcfg, arr, lens, jax.random.key(3), settings=s, max_len=64)
    staged = time_stages(params, cfg, dparams, dcfg, arr, lens, jax.random.key(3), settings=s, max_len=64,
                         rounds=32, warmup=1)
    assert bool(staged.state.done.all())
    np.testing.assert_array_equal(np.asarray(staged.state.out), np.asarray(fused.tokens))
    np.testing.assert_array_equal(np.asarray(staged.state.accepted), np.asarray(fused.accepted))
    assert set(staged.ms) == set(STAGES) and all(v > 0 for v in staged.ms.values())
    parts = staged.verify_parts
    assert tuple(parts) == VERIFY_PARTS == ("attention", "gdn", "rest")
    assert all(v > 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(staged.ms["verify"], rel=1e-2)
    assert staged.round_ms == pytest.approx(sum(staged.ms.values()))  # the parts are not counted twice
    verify = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
    assert f"verify {staged.ms['verify']:.2f} ({verify}), accept " in staged.summary()


def test_verify_split_follows_the_scopes_work():
    """`stage_times.profile_verify_parts` on a program whose "gdn" scope does ~4 large matmuls, its
    "attention" scope one small add, and the rest one matmul: the parts rank by that work and sum
    to the given ms; a profile that maps nothing to HLO instructions is refused."""
    from dflash_jax.stage_times import profile_verify_parts

    def f(x, small):
        with jax.named_scope(q35.GDN_SCOPE):
            for _ in range(4):
                x = jnp.tanh(x @ x)
        with jax.named_scope(q35.ATTENTION_SCOPE):
            small = small + 1.0
        return jnp.tanh(x @ x), small

    x, small = jnp.ones((384, 384)) / 384, jnp.ones((8,))
    compiled = jax.jit(f).lower(x, small).compile()
    parts = profile_verify_parts(10.0, lambda: compiled(x, small), compiled.as_text())
    assert sum(parts.values()) == pytest.approx(10.0, rel=1e-2)
    assert parts["gdn"] > 2 * parts["rest"] > 0 and parts["rest"] > 10 * parts["attention"], parts
    with pytest.raises(RuntimeError, match="hybrid verify's profile gives no split"):
        profile_verify_parts(10.0, lambda: compiled(x, small), "")


# ----------------------------------------------------------------------------- lossless, oracle drafter

# A fixed pseudo-random schedule per (round, sequence). It must not depend on what the rounds
# accepted: a formula in (round, length) falls into short cycles, since each round's accepted
# length feeds the next round's length.
_SCHEDULE = np.random.RandomState(3).randint(0, 720, 97)


def oracle_schedule(state: speculative.SpecState, bs: int) -> tuple[jax.Array, jax.Array]:
    """([B] the depth 1..bs-1 at which the oracle drafter errs in this round, or bs for none;
    [B] bool, whether the right token ranks second there, else last). lengths - count is the
    prompt length - 1 in every round of a sequence."""
    offset = state.cache.lengths - state.count
    v = jnp.asarray(_SCHEDULE)[(state.rounds + 7 * offset) % len(_SCHEDULE)]
    return 1 + v % bs, (v // bs) % 3 == 0


def oracle_logits(state: speculative.SpecState, table: jax.Array, bs: int) -> jax.Array:
    """Drafter logits [B, bs-1, V] that propose AR's continuation (table [B, T]: prompt then AR
    tokens), wrong at the depth `oracle_schedule` says, where the right token ranks second (a
    DDTree path then goes through a non-first child) or last (the tree misses it)."""
    depth = jnp.arange(1, bs)[None, :]
    right = jnp.take_along_axis(table, state.cache.lengths[:, None] + depth, axis=1)  # [B, bs-1]
    error, through = oracle_schedule(state, bs)
    at_error = depth == error[:, None]
    top = jnp.where(at_error, (right + 1) % VOCAB, right)
    second = jnp.where(through[:, None, None], 6.0, -8.0) * jax.nn.one_hot(right, VOCAB)
    logits = 8.0 * jax.nn.one_hot(top, VOCAB)
    return jnp.where(at_error[..., None], logits + second, logits)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "s"))
def oracle_round(state, table, params, dparams, cfg, dcfg, s):
    """`speculative.spec_round` with the oracle in place of the drafter pass."""
    draft, key = speculative.propose(state, oracle_logits(state, table, s.block_size), s)
    logits, taps, verified = speculative.verify_stage(state, draft, params, cfg, dcfg)
    key, k_accept = jax.random.split(key)
    path, m, bonus = speculative.accept_stage(k_accept, draft, logits, s)
    return speculative.commit_stage(state, draft, path, m, bonus, taps, verified, cfg, dparams, dcfg, s, key)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_greedy_speculative_equals_greedy_ar_oracle_drafter(method, batch):
    """Each round accepts exactly what the oracle's error says: up to the error (DFlash, and DDTree
    when the tree misses the right token), or the whole block (no error, or DDTree with the right
    token as a second child); every length 1..bs occurs; the output is AR's."""
    name = "interval4"
    cfg, params = target(name)
    bs = 6
    s = SpecSettings(method=method, block_size=bs, budget=2 * bs, max_new_tokens=NEW)
    dcfg, dparams = drafter_for(cfg, bs)
    prompts = prompt_set(10, seed=11)
    ar = run_batches(lambda a, l: q35.generate(params, cfg, a, l, jax.random.key(0), max_new_tokens=NEW,
                                               max_len=a.shape[1] + NEW), prompts, len(prompts))
    start = jax.jit(speculative.start_state, static_argnames=("cfg", "dcfg", "max_len", "s"))
    seen = []

    def fn(a, l):
        batch_, width = a.shape
        table = np.zeros((batch_, width + NEW + 2 * bs), np.int32)
        for b in range(batch_):
            prompt = np.asarray(a[b, :int(l[b])]).tolist()
            full = prompt + ar[prompts.index(prompt)]
            table[b, :len(full)] = full
        state = start(params, cfg, dparams, dcfg, a, l, jax.random.key(0), max_len=width + NEW + s.cache_slack(),
                      s=s)
        while not bool(np.asarray(state.done).all()):
            rounds, count = np.asarray(state.rounds), np.asarray(state.count)
            error, through = (np.asarray(x) for x in oracle_schedule(state, bs))
            uncut = ~np.asarray(state.done) & (NEW - count >= bs)  # max_new_tokens cannot shorten the round
            state = oracle_round(state, jnp.asarray(table), params, dparams, cfg, dcfg, s)
            got = np.asarray(state.accepted)[np.arange(batch_), rounds]
            for b in np.flatnonzero(uncut):
                want = bs if method == "ddtree" and through[b] else error[b]
                assert got[b] == want, (b, int(rounds[b]), int(error[b]), int(got[b]))
                seen.append(int(got[b]))
        return state.out, state.count

    assert run_batches(fn, prompts, batch) == ar
    assert set(seen) == set(range(1, bs + 1)), sorted(set(seen))  # every m in 0..bs-1


# ----------------------------------------------------------------------------- sampling

CHI_PROMPT = [1, 5, 2, 6, 0]
CHI_N = 4000


def exact_three_token_probs(cfg: q35.Qwen35Config, params: q35.Qwen35Params, prompt: list[int],
                            sp: SamplingParams) -> np.ndarray:
    """[V, V, V]: AR's probability of each first three tokens under the sampling filters, from
    one forward over every prompt + t1 + t2."""
    v = cfg.vocab_size
    pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)  # t1-major
    seqs = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], 1)
    n = seqs.shape[1]
    out = q35.forward(params, cfg, jnp.asarray(seqs, jnp.int32), jnp.broadcast_to(jnp.arange(n), seqs.shape),
                      q35.HybridCache.create(cfg, len(seqs), n))
    probs = np.asarray(sampling_probs(out.logits[:, -3:], sp), np.float64)  # [V*V, 3, V]
    first = probs[0, 0]  # after the prompt
    second = probs[::v, 1]  # [V (t1), V]: rows with t2 = 0
    third = probs[:, 2].reshape(v, v, v)
    return first[:, None, None] * second[:, :, None] * third


def sampled_three(cfg, params, s: SpecSettings, n: int) -> np.ndarray:
    dcfg, dparams = drafter_for(cfg, s.block_size)
    arr = jnp.asarray(np.tile(np.asarray(CHI_PROMPT, np.int32), (n, 1)))
    lens = jnp.full((n,), len(CHI_PROMPT), jnp.int32)
    g = generate_speculative(params, cfg, dparams, dcfg, arr, lens, jax.random.key(1), settings=s,
                             max_len=len(CHI_PROMPT) + s.max_new_tokens + s.cache_slack())
    return np.asarray(g.tokens[:, :3])


CHI_SETTINGS = {
    "dflash-t1": SpecSettings(method="dflash", block_size=4, sampling=SamplingParams(1.0), max_new_tokens=3),
    "ddtree-topk4": SpecSettings(method="ddtree", block_size=8, budget=8, sampling=SamplingParams(1.0, top_k=4),
                                 max_new_tokens=3),
}


@pytest.mark.parametrize("setting", sorted(CHI_SETTINGS))
def test_sampled_tokens_follow_the_target_distribution(setting):
    from tests.test_speculative import chi2_against

    cfg, params = target("interval4")
    s = CHI_SETTINGS[setting]
    p = exact_three_token_probs(cfg, params, CHI_PROMPT, s.sampling)
    assert chi2_against(p, sampled_three(cfg, params, s, CHI_N)) > 1e-3


def test_chi2_detects_a_wrong_acceptance_rule(monkeypatch):
    """The ratio test against the target's own probabilities (q := p) keeps every drafted token,
    so the output follows the drafter: the same test must reject it."""
    from dflash_jax.accept import chain_rejection
    from tests.test_speculative import chi2_against

    def keep_all(key, chain_tokens, target_probs, draft_probs, limit):
        return chain_rejection(key, chain_tokens, target_probs, target_probs[:, :-1], limit)

    monkeypatch.setattr(speculative, "chain_rejection", keep_all)
    jax.clear_caches()  # generate_speculative's program was traced with the right rule
    cfg, params = target("interval4")
    s = CHI_SETTINGS["dflash-t1"]
    p = exact_three_token_probs(cfg, params, CHI_PROMPT, s.sampling)
    assert chi2_against(p, sampled_three(cfg, params, s, CHI_N)) < 1e-3
    monkeypatch.undo()
    jax.clear_caches()
