"""`impl.Impl`: the implementation choices, apart from the decoding semantics of `SpecSettings`."""
from __future__ import annotations

import jax
import pytest

from dflash_jax.impl import ATTENTION_IMPLS, Impl


def test_impl_is_a_hashable_static_argument():
    assert hash(Impl()) == hash(Impl("auto", 1)) and Impl("triton") != Impl("pallas")
    assert {Impl(): 1}[Impl(attention="auto", rounds_per_check=1)] == 1
    assert ATTENTION_IMPLS == ("auto", "pallas", "triton", "reference", "interpret")


def test_bad_impl_names_the_field():
    for gone in ("pallas-triton", "pallas-unfused", "xla"):
        with pytest.raises(ValueError, match="Impl.attention must be one of"):
            Impl(attention=gone)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="Impl.rounds_per_check"):
            Impl(rounds_per_check=bad)


def test_defaults_resolve_per_backend():
    assert Impl().resolved("gpu") == Impl("pallas")
    assert Impl().resolved("cpu") == Impl("reference")
    assert Impl(rounds_per_check=4).resolved("gpu") == Impl("pallas", 4)
    assert Impl("triton").resolved("cpu") == Impl("triton")  # an explicit choice stays
    assert Impl().resolved() == Impl("pallas" if jax.default_backend() == "gpu" else "reference")


def test_round_kernels_follow_the_attention():
    """"reference" and "interpret" keep the whole round in XLA (the K/V compaction and the
    drafter's context epilogue too); every kernel path lets them run where they apply."""
    assert [Impl(a).round_kernels for a in ATTENTION_IMPLS] == [True, True, True, False, False]


def test_generations_run_the_attention_impl_they_are_given(monkeypatch):
    """`Impl.attention` reaches every attention of AR and speculative decoding: "interpret" (the
    Triton kernel in Pallas' interpreter) is what runs, and its tokens are the reference's
    (random float32 weights at the benchmarks' tiny shape, head_dim 32)."""
    import importlib

    import jax.numpy as jnp

    from dflash_jax.bench.spec_round import decoding_pair
    from dflash_jax.generate import generate_ar
    from dflash_jax.speculative import SpecSettings, generate_speculative

    dispatch = importlib.import_module("pallas_kernels.tree_attention")
    cfg, dcfg, dparams, target = decoding_pair("tiny", jnp.float32)
    prompts = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size - 1, jnp.int32)
    lens = jnp.asarray([8, 5], jnp.int32)
    interpreted = []
    real = dispatch.tree_attention_pallas
    monkeypatch.setattr(dispatch, "tree_attention_pallas",
                        lambda *a, **kw: interpreted.append(kw["interpret"]) or real(*a, **kw))
    settings = SpecSettings(method="ddtree", block_size=dcfg.block_size, budget=4, max_new_tokens=6)
    for run in (lambda impl: generate_ar(target, cfg, prompts, lens, jax.random.key(0), max_new_tokens=6,
                                         max_len=64, impl=impl),
                lambda impl: generate_speculative(target, cfg, dparams, dcfg, prompts, lens, jax.random.key(0),
                                                  settings=settings, max_len=64, impl=impl)):
        interpreted.clear()
        ref = run(Impl("reference"))
        assert not interpreted
        got = run(Impl("interpret"))
        assert interpreted and all(interpreted)
        assert (jax.device_get(got.tokens) == jax.device_get(ref.tokens)).all()
