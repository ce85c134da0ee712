"""The JAX target forward against transformers (float32), and the cached step against recompute."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward_jit as forward
from tests.hf_models import TINY, save_and_convert, tiny_hf_model


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=sorted(TINY))
def pair(request, tmp_path_factory):
    model = tiny_hf_model(request.param)
    cfg, params = save_and_convert(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, cfg, params


def test_logits_and_every_tap_match_transformers(pair):
    kind, model, cfg, params = pair
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        ref = model(torch.tensor(tokens), output_hidden_states=True)
    cache = KVCache.create(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(13), (2, 13))
    taps = tuple(range(cfg.num_layers))
    out = forward(params, cfg, jnp.asarray(tokens), positions, cache, tap_layers=taps)
    assert rel_err(out.logits, ref.logits.numpy()) <= 1e-5
    h = cfg.hidden_size
    for layer in taps:
        mine = np.asarray(out.taps)[..., layer * h:(layer + 1) * h]
        assert rel_err(mine, ref.hidden_states[layer + 1].numpy()) <= 1e-5, f"tap {layer}"


def test_cached_step_equals_full_recompute(pair):
    """Prefill a prefix, then run W-token steps (causal and tree-masked) over the cache."""
    _, _, cfg, params = pair
    rng = np.random.RandomState(2)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (3, 20)))
    lens = np.array([7, 11, 4])
    full = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(20), (3, 20)),
                   KVCache.create(cfg.num_layers, 3, 40, cfg.num_kv_heads, cfg.head_dim))
    cache = KVCache.create(cfg.num_layers, 3, 40, cfg.num_kv_heads, cfg.head_dim)
    # Prefill with right padding; every sequence keeps only its own length.
    pre = forward(params, cfg, tokens[:, :12], jnp.broadcast_to(jnp.arange(12), (3, 12)), cache)
    cache = dataclasses.replace(pre.cache, lengths=jnp.asarray(lens, jnp.int32))
    w = 5
    step_tokens = jnp.stack([tokens[b, lens[b]:lens[b] + w] for b in range(3)])
    positions = jnp.asarray(lens)[:, None] + jnp.arange(w)[None]
    step = forward(params, cfg, step_tokens, positions, cache)
    for b in range(3):
        ref = np.asarray(full.logits[b, lens[b]:lens[b] + w])
        assert rel_err(step.logits[b], ref) <= 1e-5
    # A tree mask where every node sees only the root and itself equals W separate 2-token chains.
    vis = np.eye(w, dtype=bool)
    vis[:, 0] = True
    tree = forward(params, cfg, step_tokens, jnp.asarray(lens)[:, None] + jnp.minimum(jnp.arange(w), 1)[None],
                   cache, jnp.asarray(np.broadcast_to(vis, (3, w, w))))
    # Reference: each (root, node) pair as its own 2-token causal step, batched over the pairs.
    pairs = [(b, node) for b in range(3) for node in range(1, w)]
    idx = np.array([b for b, _ in pairs])
    pair_tokens = jnp.stack([jnp.stack([step_tokens[b, 0], step_tokens[b, n]]) for b, n in pairs])
    pair_cache = dataclasses.replace(cache, lengths=jnp.asarray(lens[idx], jnp.int32),
                                     k=tuple(k[idx] for k in cache.k), v=tuple(v[idx] for v in cache.v))
    ref = forward(params, cfg, pair_tokens, jnp.asarray(lens[idx])[:, None] + jnp.arange(2)[None], pair_cache)
    for i, (b, node) in enumerate(pairs):
        assert rel_err(tree.logits[b, node], ref.logits[i, 1]) <= 1e-5


def test_tap_layers_out_of_range_is_an_error(pair):
    _, _, cfg, params = pair
    cache = KVCache.create(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="tap_layers"):
        forward(params, cfg, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache,
                tap_layers=(cfg.num_layers,))


def test_bf16_logits_round_as_transformers_lm_head(pair):
    """In bf16 the LM head's logits are rounded to bf16 as transformers' `lm_head` (a bf16
    Linear) rounds them, so greedy choices follow the reference's; float32 stays float32."""
    _, model, cfg, params = pair
    from dflash_jax.model import lm_head_weight, logits_from_hidden
    rng = np.random.RandomState(3)
    hidden = jnp.asarray(rng.randn(2, 9, cfg.hidden_size), jnp.bfloat16)
    w16 = lm_head_weight(params).astype(jnp.bfloat16)
    ours = np.asarray(logits_from_hidden(dataclasses.replace(params, lm_head=w16, embed=params.embed), hidden))
    assert ours.dtype == np.float32
    # Every value is a bf16 number: unrounded float32 products would fail this.
    assert np.array_equal(ours, np.asarray(jnp.asarray(ours).astype(jnp.bfloat16).astype(jnp.float32)))
    with torch.no_grad():
        ref = torch.nn.functional.linear(torch.tensor(np.asarray(hidden.astype(jnp.float32))).bfloat16(),
                                         torch.tensor(np.asarray(w16.astype(jnp.float32))).bfloat16().T)
    ref = ref.float().numpy()
    # Both accumulate in float32; a sum in another order may round to the neighbouring bf16.
    ulp = np.abs(ref) * 2.0 ** -7 + 1e-30
    assert (np.abs(ours - ref) <= ulp).all()
    assert np.mean(ours == ref) > 0.9
    h32 = hidden.astype(jnp.float32)
    exact = np.asarray(h32) @ np.asarray(lm_head_weight(params), np.float32)
    assert rel_err(logits_from_hidden(params, h32), exact) <= 1e-5
