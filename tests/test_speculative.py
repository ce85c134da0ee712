"""DFlash and DDTree decoding: lossless against AR, equal to dflash 0.1.0, exact sampling."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import speculative
from dflash_jax.generate import generate_ar
from dflash_jax.impl import Impl
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward_jit as forward
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams, sampling_probs
from dflash_jax.speculative import SpecSettings, generate_speculative
from tests.spec_models import convert_pair, drafter_model, target_model

NEW = 40
SMALL_VOCAB = 8  # a random drafter then lands on the target's choice often, so deep paths occur


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return convert_pair(target_model(vocab=SMALL_VOCAB), drafter_model(16, vocab=SMALL_VOCAB),
                        tmp_path_factory.mktemp("pair"))


def prompts_20(vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(7)
    return [rng.randint(0, vocab, rng.randint(2, 20)).tolist() for _ in range(20)]


def run_batches(fn, prompts, batch):
    """Runs `fn(arr, lens)` over the prompts in batches of `batch` -> list of token lists."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        chunk = chunk + [chunk[-1]] * (batch - len(chunk))  # keep one compiled shape
        arr, lens = pad_prompts(chunk, multiple=32)
        g = fn(jnp.asarray(arr), jnp.asarray(lens))
        toks, n = np.asarray(g.tokens), np.asarray(g.num_tokens)
        out += [toks[b, :n[b]].tolist() for b in range(len(prompts[i:i + batch]))]
    return out


@pytest.fixture(scope="module")
def ar_tokens(pair):
    cfg, params, _, _ = pair
    prompts = prompts_20(SMALL_VOCAB)
    return run_batches(lambda a, l: generate_ar(params, cfg, a, l, jax.random.key(0), max_new_tokens=NEW,
                                                max_len=256), prompts, 20)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method,size", [("dflash", 2), ("dflash", 4), ("dflash", 16),
                                         ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_greedy_speculative_equals_greedy_ar(pair, ar_tokens, method, size, batch):
    cfg, params, dcfg, dparams = pair
    s = (SpecSettings(method="dflash", block_size=size, max_new_tokens=NEW) if method == "dflash"
         else SpecSettings(method="ddtree", block_size=16, budget=size, max_new_tokens=NEW))
    rounds = []

    def fn(a, l):
        g = generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0), settings=s, max_len=256)
        rounds.append(np.asarray(g.accepted)[np.asarray(g.accepted) > 0])
        return g

    got = run_batches(fn, prompts_20(SMALL_VOCAB), batch)
    assert got == ar_tokens
    acc = np.concatenate(rounds)
    # Drafted tokens really were accepted (and, for wide trees, paths of several nodes).
    assert acc.max() >= (3 if method == "ddtree" and size >= 16 else 2)


@pytest.mark.parametrize("budget,batch", [(4, 3), (16, 1), (31, 1)])
def test_greedy_ddtree_equals_greedy_ar_at_any_width(pair, ar_tokens, budget, batch):
    """Widths of no particular multiple (W = 5, 17, 32 here): the verify kernels pad their own
    rows, so the tree has no padding slots (W = 1 + budget)."""
    cfg, params, dcfg, dparams = pair
    s = SpecSettings(method="ddtree", block_size=16, budget=budget, max_new_tokens=NEW)
    assert s.width == budget + 1
    got = run_batches(lambda a, l: generate_speculative(params, cfg, dparams, dcfg, a, l, jax.random.key(0),
                                                        settings=s, max_len=256), prompts_20(SMALL_VOCAB), batch)
    assert got == ar_tokens


@pytest.mark.parametrize("method,temperature", [("ddtree", 0.0), ("dflash", 1.0)])
def test_rounds_between_checks_change_nothing_but_time(pair, ar_tokens, method, temperature):
    """`Impl.rounds_per_check` > 1: the loop reads `done` every k rounds, and the rounds run after every
    sequence is done change nothing: the same tokens, counts, rounds and acceptance (greedy: AR's
    tokens; sampled: the same draws), over 20 prompts in one batch, which end in different rounds."""
    cfg, params, dcfg, dparams = pair
    arr, lens = pad_prompts(prompts_20(SMALL_VOCAB), multiple=32)
    sampling = SamplingParams(temperature=temperature)

    def run(k):
        s = (SpecSettings(method="ddtree", block_size=16, budget=16, max_new_tokens=NEW)
             if method == "ddtree" else
             SpecSettings(method="dflash", block_size=4, max_new_tokens=NEW, sampling=sampling))
        g = generate_speculative(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens),
                                 jax.random.key(3), settings=s, max_len=256, impl=Impl(rounds_per_check=k))
        return {f: np.asarray(getattr(g, f)) for f in ("tokens", "num_tokens", "accepted", "rounds")}

    one = run(1)
    assert len(set(one["rounds"].tolist())) > 1  # the sequences end in different rounds
    k = next(k for k in (3, 4, 5, 7) if one["rounds"].max() % k)  # so rounds past the end do run
    more = run(k)
    for field in one:
        np.testing.assert_array_equal(more[field], one[field], err_msg=f"{field}, rounds_per_check={k}")
    if temperature == 0.0:
        assert [one["tokens"][b, :one["num_tokens"][b]].tolist() for b in range(20)] == ar_tokens


def test_greedy_dflash_matches_dflash_generate(tmp_path, monkeypatch):
    """Same weights: our tokens and per-round acceptance lengths equal the PyTorch reference's."""
    import dflash.model as ref
    import time

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its stats path assumes CUDA
    vocab = SMALL_VOCAB
    target, drafter = target_model(vocab=vocab), drafter_model(16, vocab=vocab)
    cfg, params, dcfg, dparams = convert_pair(target, drafter, tmp_path)
    s = SpecSettings(method="dflash", block_size=16, max_new_tokens=NEW, stop_tokens=(3,))
    rng = np.random.RandomState(11)
    for _ in range(10):
        prompt = rng.randint(0, vocab, rng.randint(3, 15)).tolist()
        r = ref.dflash_generate(drafter, target, torch.tensor([prompt]), NEW, [3], return_stats=True)
        arr, lens = pad_prompts([prompt], multiple=32)
        g = generate_speculative(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens),
                                 jax.random.key(0), settings=s, max_len=256)
        n, rounds = int(g.num_tokens[0]), int(g.rounds[0])
        assert np.asarray(g.tokens[0, :n]).tolist() == r.output_ids[0, len(prompt):].tolist()
        assert np.asarray(g.accepted[0, :rounds]).tolist() == list(r.acceptance_lengths)


# ----------------------------------------------------------------------------- sampling

def chi2_pvalue(stat: float, dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square upper tail."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_token_probs(cfg, params, prompt, sp: SamplingParams, n: int = 3) -> np.ndarray:
    """AR probability of every first-n-token sequence, [V] * n, under the sampling filters."""
    v = cfg.vocab_size
    prefixes = np.stack(np.meshgrid(*[np.arange(v)] * (n - 1), indexing="ij"), -1).reshape(-1, n - 1)
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], 1)
    width = seqs.shape[1]
    out = forward(params, cfg, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(width), seqs.shape),
                  KVCache.create(cfg.num_layers, len(seqs), width, cfg.num_kv_heads, cfg.head_dim))
    # probs[t1, .., t_{n-1}, j] is the distribution of token j + 1 after the prompt and t1..tj.
    probs = np.asarray(sampling_probs(out.logits[:, -n:], sp), np.float64).reshape((v,) * (n - 1) + (n, v))
    joint = probs[(0,) * (n - 1) + (0,)]
    for j in range(1, n):
        joint = joint[..., None] * probs[(slice(None),) * j + (0,) * (n - 1 - j) + (j,)]
    return joint


def sample_tokens(pair, s: SpecSettings, prompt, n: int, count: int, seed: int = 0) -> np.ndarray:
    """[count, n]: the first n tokens of `count` independent generations of the prompt."""
    cfg, params, dcfg, dparams = pair
    arr = np.tile(np.asarray(prompt, np.int32), (count, 1))
    lens = np.full((count,), len(prompt), np.int32)
    g = generate_speculative(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens),
                             jax.random.key(seed), settings=s, max_len=64)
    assert (np.asarray(g.num_tokens) == n).all()
    return np.asarray(g.tokens[:, :n])


def chi2_against(expected_p: np.ndarray, draws: np.ndarray) -> float:
    """p-value of the draws [count, n] against the joint distribution [V] * n (cells expecting
    fewer than 5 draws pooled into one)."""
    idx = np.ravel_multi_index(tuple(draws.T), expected_p.shape)
    counts = np.bincount(idx, minlength=expected_p.size).astype(np.float64)
    expected = expected_p.reshape(-1) * len(draws)
    assert counts[expected == 0].sum() == 0, "a sequence the target can't produce was sampled"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum())
    return chi2_pvalue(stat, int(keep.sum()) - 1)


PROMPT = [1, 5, 2, 6, 0]
N = 6000
SAMPLERS = [SamplingParams(1.0), SamplingParams(1.0, top_k=4), SamplingParams(1.0, top_p=0.8)]


@pytest.mark.parametrize("sp", SAMPLERS, ids=["t1", "topk4", "topp0.8"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampled_tokens_follow_the_target_distribution(pair, sp, method):
    """The first three tokens: the prefill's and the first round's (block 4 / 16)."""
    cfg, params, _, _ = pair
    s = SpecSettings(method=method, block_size=4 if method == "dflash" else 16, budget=8, sampling=sp,
                     max_new_tokens=3)
    p = exact_token_probs(cfg, params, PROMPT, sp)
    assert chi2_against(p, sample_tokens(pair, s, PROMPT, 3, N)) > 1e-3


# Block size 2: a round commits at most 2 tokens, so the 4th token always comes from a later round
# (drafted from the context the first round committed, verified against the cache it wrote).
LATER_N = 8000


def later_round_settings(method: str, sp: SamplingParams) -> SpecSettings:
    return SpecSettings(method=method, block_size=2, budget=4, sampling=sp, max_new_tokens=4)


@pytest.mark.parametrize("sp", SAMPLERS[:2], ids=["t1", "topk4"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_tokens_after_the_first_round_follow_the_target_distribution(pair, sp, method):
    cfg, params, _, _ = pair
    p = exact_token_probs(cfg, params, PROMPT, sp, n=4)
    draws = sample_tokens(pair, later_round_settings(method, sp), PROMPT, 4, LATER_N, seed=1)
    assert chi2_against(p, draws) > 1e-3


def test_chi2_detects_a_wrong_acceptance_rule(pair, monkeypatch):
    """Ratio test against the target's own probabilities (q := p): every drafted token is kept,
    so the output follows the drafter. The same test must catch it."""
    from dflash_jax.accept import chain_rejection

    def wrong(key, chain_tokens, target_probs, draft_probs, limit):
        return chain_rejection(key, chain_tokens, target_probs, target_probs[:, :-1], limit)

    monkeypatch.setattr(speculative, "chain_rejection", wrong)
    jax.clear_caches()
    cfg, params, _, _ = pair
    sp = SamplingParams(1.0)
    s = SpecSettings(method="dflash", block_size=4, sampling=sp, max_new_tokens=3)
    p = exact_token_probs(cfg, params, PROMPT, sp)
    assert chi2_against(p, sample_tokens(pair, s, PROMPT, 3, N)) < 1e-3
    monkeypatch.undo()
    jax.clear_caches()


def test_chi2_detects_a_ddtree_sampler_that_reuses_its_noise(pair, monkeypatch):
    """DDTree's target samples at the tree's nodes drawn with one Gumbel noise shared by every
    node (a reused key): each node's token alone is still an exact target sample, but a child's
    token depends on its parent's. The test of tokens after the first round must reject it."""
    from dflash_jax.sampling import sample

    def shared_noise(key, logits, sp):
        if logits.ndim == 2:  # the prefill's token: unchanged
            return sample(key, logits, sp)
        probs = sampling_probs(logits, sp)
        noise = jax.random.gumbel(key, (logits.shape[0], 1, logits.shape[-1]))
        return jnp.argmax(jnp.where(probs > 0, jnp.log(probs), -jnp.inf) + noise, -1).astype(jnp.int32)

    monkeypatch.setattr(speculative, "sample", shared_noise)
    jax.clear_caches()
    cfg, params, _, _ = pair
    sp = SamplingParams(1.0)
    p = exact_token_probs(cfg, params, PROMPT, sp, n=4)
    draws = sample_tokens(pair, later_round_settings("ddtree", sp), PROMPT, 4, LATER_N, seed=1)
    assert chi2_against(p, draws) < 1e-3
    monkeypatch.undo()
    jax.clear_caches()


def test_bad_settings():
    with pytest.raises(ValueError, match="budget"):
        SpecSettings(method="ddtree", budget=0)
    with pytest.raises(ValueError, match="method"):
        SpecSettings(method="medusa")
    with pytest.raises(ValueError, match="block_size"):
        SpecSettings(block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        SpecSettings(block_size=4.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpecSettings(max_new_tokens=0)
    with pytest.raises(ValueError, match="stop_tokens"):
        SpecSettings(stop_tokens=[2])
    with pytest.raises(ValueError, match="sampling"):
        SpecSettings(sampling=0.7)
    for knob in ("attn_impl", "row_block", "preselect", "residual", "rounds_per_check"):
        with pytest.raises(TypeError, match=knob):  # implementation choices live in `Impl`
            SpecSettings(**{knob: 1})


@pytest.mark.parametrize("method,temperature", [("ddtree", 0.0), ("dflash", 1.0)])
def test_stage_times_run_the_same_rounds_as_the_fused_generation(pair, method, temperature):
    """Stage by stage (each stage its own program), the tokens and per-round acceptance equal the
    fused `generate_speculative`'s, sampled runs included (same PRNG keys), and every stage is timed."""
    from dflash_jax.stage_times import STAGES, time_stages

    cfg, params, dcfg, dparams = pair
    s = SpecSettings(method=method, block_size=16, budget=8, max_new_tokens=24,
                     sampling=SamplingParams(temperature=temperature))
    arr, lens = pad_prompts(prompts_20(SMALL_VOCAB)[:3], multiple=32)
    arr, lens = jnp.asarray(arr), jnp.asarray(lens)
    fused = generate_speculative(params, cfg, dparams, dcfg, arr, lens, jax.random.key(3), settings=s, max_len=128)
    staged = time_stages(params, cfg, dparams, dcfg, arr, lens, jax.random.key(3), settings=s, max_len=128,
                         rounds=64, warmup=1)
    assert bool(staged.state.done.all())
    np.testing.assert_array_equal(np.asarray(staged.state.out), np.asarray(fused.tokens))
    np.testing.assert_array_equal(np.asarray(staged.state.accepted), np.asarray(fused.accepted))
    assert staged.rounds == int(np.asarray(fused.rounds).max()) - 1  # the warm-up round is not timed
    assert set(staged.ms) == set(STAGES) and all(v > 0 for v in staged.ms.values())
    assert staged.round_ms == pytest.approx(sum(staged.ms.values()))
    # A dense target's verify is one stage: no parts, and the summary line names the five stages only.
    assert staged.verify_parts == {}
    split = ", ".join(f"{k} {staged.ms[k]:.2f}" for k in STAGES)
    assert staged.summary() == (f"stages: median ms over {staged.rounds} rounds, each stage its own program: "
                                f"{split} (sum {staged.round_ms:.2f}; the fused round pays no per-stage launch)")


def test_stage_times_bad_arguments(pair):
    from dflash_jax.stage_times import time_stages

    cfg, params, dcfg, dparams = pair
    s = SpecSettings(method="dflash", block_size=4, max_new_tokens=8)
    arr, lens = pad_prompts([[1, 2, 3]], multiple=32)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        time_stages(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens), jax.random.key(0),
                    settings=s, max_len=128, rounds=0)
    with pytest.raises(ValueError, match="max_len 16 is too small"):
        time_stages(params, cfg, dparams, dcfg, jnp.asarray(arr), jnp.asarray(lens), jax.random.key(0),
                    settings=s, max_len=16)


def test_speculative_compiler_options_are_xla_options():
    """Every method's generation compiles with these options (dot merger off, command buffers for
    every command type, the loops included), and its profiled benches with command buffers off; XLA
    rejects a misspelt name or value with INVALID_ARGUMENT, here as on a GPU."""
    from dflash_jax.speculative import SPEC_COMPILER_OPTIONS, SPEC_PROFILED_OPTIONS

    assert set(SPEC_COMPILER_OPTIONS) == {"xla_gpu_dot_merger_threshold_mb", "xla_gpu_enable_command_buffer",
                                            "xla_gpu_graph_min_graph_size"}
    assert {"WHILE", "CONDITIONAL"} <= set(SPEC_COMPILER_OPTIONS["xla_gpu_enable_command_buffer"].split(","))
    assert SPEC_PROFILED_OPTIONS["xla_gpu_enable_command_buffer"] == ""
    for options in (SPEC_COMPILER_OPTIONS, SPEC_PROFILED_OPTIONS):
        compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=options)
        np.testing.assert_array_equal(np.asarray(compiled(jnp.ones(3))), 2.0)
    with pytest.raises(Exception, match="xla_gpu_enable_command_buffer"):
        jax.jit(lambda x: x).lower(jnp.ones(3)).compile(compiler_options={"xla_gpu_enable_command_buffer": "GRAPHS"})
