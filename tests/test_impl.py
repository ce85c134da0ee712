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
