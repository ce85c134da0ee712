"""Autoregressive decoding on device: equals transformers `generate`, batching, stops, sampling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.generate import PAD, check_prompts, generate_ar
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams, sampling_probs
from tests.hf_models import save_and_convert, tiny_hf_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model = tiny_hf_model("qwen3", seed=3)
    cfg, params = save_and_convert(model, tmp_path_factory.mktemp("q"))
    return model, cfg, params


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_batch_equals_transformers_and_single_sequences(qwen):
    model, cfg, params = qwen
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (3, 17, 9, 30)]
    arr, lens = pad_prompts(prompts, multiple=16)
    batch = generate_ar(params, cfg, jnp.asarray(arr), jnp.asarray(lens), jax.random.key(0),
                        max_new_tokens=10, max_len=64)
    for b, p in enumerate(prompts):
        assert np.asarray(batch.tokens[b]).tolist() == hf_greedy(model, p, 10)
        a1, l1 = pad_prompts([p], multiple=8)
        single = generate_ar(params, cfg, jnp.asarray(a1), jnp.asarray(l1), jax.random.key(0),
                             max_new_tokens=10, max_len=64)
        assert np.asarray(single.tokens[0]).tolist() == np.asarray(batch.tokens[b]).tolist()


def test_stop_tokens_end_each_sequence_on_its_own(qwen):
    model, cfg, params = qwen
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (5, 12)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    stop = refs[0][4]  # sequence 0 must stop at its 5th token (or earlier if it repeats)
    arr, lens = pad_prompts(prompts, multiple=16)
    g = generate_ar(params, cfg, jnp.asarray(arr), jnp.asarray(lens), jax.random.key(0), max_new_tokens=12,
                    max_len=64, stop_tokens=(stop,))
    for b, ref in enumerate(refs):
        n = ref.index(stop) + 1 if stop in ref else 12
        assert int(g.num_tokens[b]) == n
        assert np.asarray(g.tokens[b, :n]).tolist() == ref[:n]
        assert (np.asarray(g.tokens[b, n:]) == PAD).all()


def test_sampling_filters_match_reference_definition():
    """top-k then top-p as in dflash 0.1.0's `_sampling_probs`."""
    from dflash.model import _sampling_probs

    logits = np.random.RandomState(0).randn(4, 50).astype(np.float32) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)]:
        ref = _sampling_probs(torch.tensor(logits), t, p, k).numpy()
        mine = np.asarray(sampling_probs(jnp.asarray(logits), SamplingParams(t, k, p)))
        np.testing.assert_allclose(mine, ref, atol=1e-6)


def test_sampled_first_tokens_follow_the_model_distribution(qwen):
    """Over many keys, the first sampled token's frequencies match the model's probabilities."""
    _, cfg, params = qwen
    prompt = np.array([[5, 9, 2, 7]], np.int32)
    sp = SamplingParams(temperature=1.0, top_k=8)
    n = 3000
    keys = jax.random.split(jax.random.key(0), n)
    gen = jax.vmap(lambda k: generate_ar(params, cfg, jnp.asarray(prompt), jnp.asarray([4]), k,
                                         max_new_tokens=1, max_len=16, sampling=sp).tokens[0, 0])
    draws = np.asarray(gen(keys))
    from dflash_jax.model import forward
    from dflash_jax.kv_cache import KVCache
    out = forward(params, cfg, jnp.asarray(prompt), jnp.arange(4)[None],
                  KVCache.create(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim))
    probs = np.asarray(sampling_probs(out.logits[0, -1], sp))
    counts = np.bincount(draws, minlength=cfg.vocab_size)
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    assert chi2 < 30.0  # 7 degrees of freedom: p < 1e-4 to exceed by chance


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_lens=np.array([0, 3]), prompt_width=4, max_new_tokens=4, max_len=32), "at least one token"),
    (dict(prompt_lens=np.array([30]), prompt_width=32, max_new_tokens=8, max_len=32), "max_len"),
    (dict(prompt_lens=np.array([3]), prompt_width=4, max_new_tokens=0, max_len=32), "max_new_tokens"),
])
def test_bad_generation_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_prompts(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
])
def test_bad_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
