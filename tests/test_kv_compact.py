"""The one-launch K/V compaction (`pallas_kernels/kv_compact.py`) and the commit's use of it.

On CPU: the kernel in interpret mode against its jnp reference (the commit's former gather +
row write), its input checks, its lowering for cuda, when the commit takes it, and whole
generations with the kernel in the commit against the XLA path. On a GPU: the compiled kernel
against the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import speculative
from dflash_jax.impl import Impl
from dflash_jax.kv_cache import KVCache
from dflash_jax.sharding import make_mesh, use_mesh
from pallas_kernels import kv_compact as kc

ON_GPU = jax.default_backend() == "gpu"


def make_case(seed, count, batch, max_len, kv_heads, head_dim, bs, dtype, spread=8):
    """`count` random buffers (no zeros) and an increasing path per sequence: path[:, 0] = 0,
    later nodes among tree slots 1 .. bs-1+spread (so sources overlap destinations)."""
    rng = np.random.default_rng(seed)
    shape = (batch, max_len, kv_heads, head_dim)
    buffers = tuple(jnp.asarray(rng.uniform(0.5, 4.0, shape) * rng.choice([-1, 1], shape), dtype)
                    for _ in range(count))
    width = bs + spread
    starts = jnp.asarray(rng.integers(0, max_len - width + 1, batch), jnp.int32)
    path = np.stack([np.concatenate([[0], np.sort(rng.choice(np.arange(1, width), bs - 1, replace=False))])
                     for _ in range(batch)]).astype(np.int32)
    return buffers, starts[:, None] + jnp.asarray(path), starts


def assert_moved(got, want, before, starts, bs):
    """Exactly the reference, and untouched outside the destination rows."""
    assert len(got) == len(want)
    for g, w, x in zip(got, want, before):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        for b, start in enumerate(np.asarray(starts)):
            outside = np.r_[0:start, start + bs:x.shape[1]]
            np.testing.assert_array_equal(np.asarray(g[b, outside], np.float32), np.asarray(x[b, outside], np.float32))


# (count, batch, max_len, kv_heads, head_dim, bs)
CASES = [
    (4, 1, 64, 2, 64, 16),    # one sequence, bs 16, C = 128
    (6, 3, 80, 2, 128, 16),   # three sequences at different starts
    (4, 2, 48, 3, 64, 5),     # bs 5 (8 rows, 3 repeated), C = 192: not a power of two
    (2, 3, 40, 1, 128, 11),   # bs 11
    (3, 2, 40, 5, 64, 16),    # C = 320 over two 256-column blocks, the second partial
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("count,batch,max_len,kv_heads,head_dim,bs", CASES)
def test_kernel_matches_reference(count, batch, max_len, kv_heads, head_dim, bs, dtype):
    buffers, slots, starts = make_case(bs + count, count, batch, max_len, kv_heads, head_dim, bs, dtype)
    got = kc.kv_compact(buffers, slots, starts, interpret=True)
    want = kc.compact_reference(buffers, slots, starts)
    assert_moved(got, want, buffers, starts, bs)


@pytest.mark.parametrize("block", [16, 64])
def test_kernel_small_column_blocks(block):
    """Several column blocks per sequence, the last one partial (C = 96)."""
    buffers, slots, starts = make_case(3, 2, 2, 40, 3, 32, 7, jnp.float32)
    got = kc.kv_compact(buffers, slots, starts, block=block, interpret=True)
    assert_moved(got, kc.compact_reference(buffers, slots, starts), buffers, starts, 7)


def test_kernel_overlap_and_edges():
    """Paths that move every row one slot down (each source is the next row's destination), the
    identity path, and the destination ending at max_len."""
    bs, max_len = 16, 40
    buffers, _, _ = make_case(0, 2, 3, max_len, 2, 64, bs, jnp.float32)
    starts = jnp.asarray([3, 0, max_len - bs - 1], jnp.int32)
    j = jnp.arange(bs, dtype=jnp.int32)
    path = jnp.stack([jnp.where(j == 0, 0, j + 1), j, jnp.where(j == 0, 0, j + 1)])
    slots = starts[:, None] + path
    got = kc.kv_compact(buffers, slots, starts, interpret=True)
    assert_moved(got, kc.compact_reference(buffers, slots, starts), buffers, starts, bs)
    # Row j of sequence 0 now holds the former row j + 1 (j >= 1); sequence 1 is unchanged.
    np.testing.assert_array_equal(np.asarray(got[0][0, 4:3 + bs]), np.asarray(buffers[0][0, 5:4 + bs]))
    np.testing.assert_array_equal(np.asarray(got[1][1]), np.asarray(buffers[1][1]))
    starts = jnp.asarray([0, 5, max_len - bs], jnp.int32)  # the last sequence ends at max_len
    slots = starts[:, None] + j[None]
    got = kc.kv_compact(buffers, slots, starts, interpret=True)
    assert_moved(got, buffers, buffers, starts, bs)


def test_kernel_under_jit_with_donation():
    buffers, slots, starts = make_case(5, 4, 2, 64, 2, 64, 16, jnp.bfloat16)
    want = kc.compact_reference(buffers, slots, starts)
    fn = jax.jit(functools.partial(kc.kv_compact, interpret=True), donate_argnums=(0,))
    got = fn(tuple(jnp.array(x) for x in buffers), slots, starts)
    assert_moved(got, want, buffers, starts, 16)


def test_kernel_checks_its_inputs():
    buffers, slots, starts = make_case(0, 3, 2, 32, 2, 64, 6, jnp.float32)
    with pytest.raises(ValueError, match=r"buffers\[2\]"):
        kc.kv_compact(buffers[:2] + (buffers[2][:, :16],), slots, starts, interpret=True)
    with pytest.raises(ValueError, match=r"buffers\[1\]"):
        kc.kv_compact((buffers[0], buffers[1].astype(jnp.bfloat16)), slots, starts, interpret=True)
    with pytest.raises(ValueError, match="buffers is empty"):
        kc.kv_compact((), slots, starts, interpret=True)
    with pytest.raises(ValueError, match="slots"):
        kc.kv_compact(buffers, slots[:1], starts, interpret=True)  # batch 1 against 2
    with pytest.raises(ValueError, match="slots"):
        kc.kv_compact(buffers, slots[0], starts, interpret=True)
    with pytest.raises(ValueError, match="slots"):
        kc.kv_compact(buffers, slots.astype(jnp.float32), starts, interpret=True)
    with pytest.raises(ValueError, match="starts"):
        kc.kv_compact(buffers, slots, starts[:1], interpret=True)
    with pytest.raises(ValueError, match="block=24"):
        kc.kv_compact(buffers, slots, starts, block=24, interpret=True)
    with pytest.raises(ValueError, match="dtype int32"):
        kc.kv_compact(tuple(x.astype(jnp.int32) for x in buffers), slots, starts, interpret=True)
    assert kc.applies(buffers, 6) and kc.applies(buffers, 32)
    assert not kc.applies(buffers, 33)  # deeper than max_len
    assert not kc.applies(buffers, 0) and not kc.applies((), 6)
    assert not kc.applies((buffers[0], buffers[1][:, :16]), 6)
    assert not kc.applies((buffers[0], buffers[1].astype(jnp.bfloat16)), 6)
    assert not kc.applies((buffers[0][:, :, 0, 0],), 6)  # [batch, max_len]: no rows


def test_kernel_lowers_for_cuda():
    """Qwen3-8B's 72 buffers trace and lower for cuda without a GPU: one launch, every buffer
    updated in place."""
    s = jax.ShapeDtypeStruct
    buffers = (s((1, 5120, 8, 128), jnp.bfloat16),) * 72
    fn = jax.jit(kc.kv_compact, donate_argnums=(0,))
    text = fn.trace(buffers, s((1, 16), jnp.int32), s((1,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("tf.aliasing_output") == 72
    assert text.count("stablehlo.custom_call") == 1 and "kv_compact" in text
    # A non-power-of-two bs and C, float32, batch 3.
    buffers = (s((3, 96, 3, 64), jnp.float32),) * 4
    text = fn.trace(buffers, s((3, 5), jnp.int32), s((3,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("tf.aliasing_output") == 4


def test_commit_takes_the_kernel_where_it_applies():
    cache = KVCache.create(3, 2, 64, 2, 64, jnp.bfloat16)
    assert not speculative.compact_in_one_launch(cache, 16)  # tests run on CPU
    assert speculative.compact_in_one_launch(cache, 16, backend="gpu")
    assert speculative.compact_in_one_launch(cache, 16, Impl("triton"), backend="gpu")
    assert not speculative.compact_in_one_launch(cache, 16, Impl("reference"), backend="gpu")
    assert not speculative.compact_in_one_launch(cache, 16, Impl("interpret"), backend="gpu")
    mixed = dataclasses.replace(cache, v=tuple(v.astype(jnp.float32) for v in cache.v))
    assert not speculative.compact_in_one_launch(mixed, 16, backend="gpu")
    with use_mesh(make_mesh(dp=2)):
        assert not speculative.compact_in_one_launch(cache, 16, backend="gpu")


# ----------------------------------------------------------------------------- whole generations

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    spec_models = pytest.importorskip("tests.spec_models")
    return spec_models.convert_pair(spec_models.target_model(vocab=8), spec_models.drafter_model(16, vocab=8),
                                    tmp_path_factory.mktemp("pair"))


def test_generation_with_the_kernel_in_the_commit(pair, monkeypatch):
    """A greedy DDTree generation with the commit on the kernel (interpret mode) equals the one on
    XLA's path (DFlash commits through the same code)."""
    cfg, params, dcfg, dparams = pair
    s = speculative.SpecSettings(method="ddtree", block_size=16, budget=8, max_new_tokens=24)
    rng = np.random.default_rng(3)
    lens = jnp.asarray([5, 17, 9], jnp.int32)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 32)), jnp.int32)

    def generate():  # a new function each time: the commit's choice is made when the round is traced
        fn = jax.jit(lambda p, d, a, n, k: speculative._generate(p, cfg, d, dcfg, a, n, k, settings=s, max_len=128))
        return fn(params, dparams, prompts, lens, jax.random.key(0))

    usual = generate()
    calls = []
    real = kc.kv_compact
    monkeypatch.setattr(speculative, "compact_in_one_launch", lambda *a, **kw: True)
    monkeypatch.setattr(kc, "kv_compact", lambda *a, **kw: calls.append(1) or real(*a, **kw, interpret=True))
    fused = generate()
    assert calls
    np.testing.assert_array_equal(np.asarray(fused.tokens), np.asarray(usual.tokens))
    np.testing.assert_array_equal(np.asarray(fused.accepted), np.asarray(usual.accepted))
    assert int(np.asarray(usual.accepted).max()) >= 2  # paths of several nodes were compacted


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("count,batch,max_len,kv_heads,head_dim,bs", CASES + [(72, 1, 5120, 8, 128, 16)])
def test_gpu_kernel_matches_reference(count, batch, max_len, kv_heads, head_dim, bs, dtype):
    buffers, slots, starts = make_case(bs, count, batch, max_len, kv_heads, head_dim, bs, dtype)
    want = kc.compact_reference(buffers, slots, starts)
    got = jax.jit(kc.kv_compact)(buffers, slots, starts)
    assert_moved(got, want, buffers, starts, bs)
