"""Tree attention: Pallas kernel (interpret mode) vs the jnp reference vs float64 numpy.

Cache slots at or past L_b + W are poisoned with NaN (the kernel must never read them), and
interpret-mode outputs start as NaN, so an unwritten or wrongly indexed row shows up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.bench.tree_attention_bench import random_tree_visibility as random_trees
from pallas_kernels import (
    H200,
    GpuLimits,
    default_block_sizes,
    gpu_limits,
    resolve_impl,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

ON_GPU = jax.default_backend() == "gpu"


def random_tree_visibility(rng: np.random.Generator, batch: int, width: int,
                           num_padding: int = 0) -> np.ndarray:
    """Random trees (the benchmark's generator); the last num_padding nodes of sequence 0 are
    padding: they see nothing in the tree."""
    visible = random_trees(rng, batch, width)
    if num_padding:
        visible[0, width - num_padding:, :] = False
    return visible


def make_case(seed: int, batch: int, width: int, kv_heads: int, group: int, head_dim: int,
              max_len: int, lens: list[int], dtype, tree: bool, num_padding: int = 0):
    """Random q/k/v (slots >= L+W are NaN), lens [batch] and visibility (None when causal)."""
    assert len(lens) == batch and all(l + width <= max_len for l in lens)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, width, kv_heads * group, head_dim))
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    for b, l in enumerate(lens):
        k[b, l + width:] = np.nan
        v[b, l + width:] = np.nan
    visible = random_tree_visibility(rng, batch, width, num_padding) if tree else None
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lens, jnp.int32), None if visible is None else jnp.asarray(visible))


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out32, ref32 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out32)), "non-finite output (unwritten row or NaN leak)"
    return float(np.max(np.abs(out32 - ref32)) / np.max(np.abs(ref32)))


def tolerance(dtype) -> float:
    return 1e-5 if dtype == jnp.float32 else 1.5e-2


# (batch, width, kv_heads, group, head_dim, max_len, lens, dtype, tree, split_k, blocks)
# blocks: explicit (block_q, block_k) or None for the defaults. Small blocks force several row
# blocks, several key blocks and a prefix that ends mid-block.
CASES = [
    (2, 1, 2, 4, 64, 64, [0, 37], jnp.float32, False, 1, None),
    (2, 1, 1, 8, 128, 128, [100, 5], jnp.bfloat16, False, 3, None),
    (1, 1, 2, 1, 64, 96, [77], jnp.float32, False, 4, (16, 16)),
    (2, 16, 2, 1, 64, 96, [0, 45], jnp.float32, True, 1, None),
    (2, 16, 1, 4, 128, 96, [17, 80], jnp.float32, False, 2, (16, 32)),
    (2, 16, 1, 8, 64, 80, [33, 3], jnp.bfloat16, True, 1, None),
    (1, 48, 1, 4, 64, 128, [51], jnp.float32, True, 2, (64, 16)),
    (2, 64, 1, 4, 64, 160, [0, 96], jnp.float32, True, 1, (64, 32)),
    (1, 64, 2, 1, 128, 96, [29], jnp.bfloat16, False, 2, None),
    (2, 256, 1, 1, 64, 288, [0, 19], jnp.float32, True, 1, None),
    (1, 256, 1, 4, 64, 272, [13], jnp.bfloat16, False, 3, None),
    (1, 64, 2, 4, 64, 2048, [1900], jnp.float32, True, 5, None),   # 5 splits, 2 kv heads
    (2, 48, 2, 5, 64, 512, [0, 400], jnp.bfloat16, True, 3, None),  # group 5, padded rows, split
    (2, 17, 2, 4, 64, 200, [123, 0], jnp.float32, True, 2, None),   # W = 1 + budget 16 (row block 1)
]


@pytest.mark.parametrize(
    "batch,width,kv_heads,group,head_dim,max_len,lens,dtype,tree,split_k,blocks", CASES)
def test_interpret_kernel_matches_reference(batch, width, kv_heads, group, head_dim, max_len,
                                            lens, dtype, tree, split_k, blocks):
    q, k, v, prefix_lens, visible = make_case(
        len(lens) + width + group + head_dim, batch, width, kv_heads, group, head_dim, max_len,
        lens, dtype, tree)
    block_q, block_k = blocks or (None, None)
    out = tree_attention_pallas(q, k, v, prefix_lens, visible, split_k=split_k,
                                block_q=block_q, block_k=block_k, interpret=True)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("split_k", [1, 2])
def test_rows_without_visible_keys_are_zero(split_k):
    # Sequence 0 has an empty prefix and 3 padding nodes that see nothing: their rows must be
    # exactly 0, not NaN, while every other row stays a proper attention output.
    q, k, v, lens, visible = make_case(7, 2, 16, 1, 4, 64, 64, [0, 21], jnp.float32, True,
                                       num_padding=3)
    out = tree_attention_pallas(q, k, v, lens, visible, split_k=split_k, interpret=True)
    ref = tree_attention_reference(q, k, v, lens, visible)
    np.testing.assert_array_equal(np.asarray(out[0, -3:]), 0.0)
    np.testing.assert_array_equal(np.asarray(ref[0, -3:]), 0.0)
    assert np.all(np.abs(np.asarray(out[0, :-3])).sum(-1) > 0)
    assert rel_err(out, ref) < 1e-5


def numpy_tree_attention(q, k, v, lens, visible) -> np.ndarray:
    """Float64 loop-per-row attention, written independently of the reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, width, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        l = int(lens[b])
        for t in range(width):
            slots = list(range(l)) + [l + s for s in range(width)
                                      if (s <= t if visible is None else visible[b, t, s])]
            for h in range(q_heads):
                if not slots:
                    continue
                keys = k[b, slots, h // group]
                scores = keys @ q[b, t, h] / np.sqrt(head_dim)
                w = np.exp(scores - scores.max())
                out[b, t, h] = (w / w.sum()) @ v[b, slots, h // group]
    return out


@pytest.mark.parametrize("tree", [True, False])
def test_reference_matches_float64_numpy(tree):
    q, k, v, lens, visible = make_case(3, 2, 16, 2, 4, 64, 80, [0, 41], jnp.float32, tree)
    ref = tree_attention_reference(q, k, v, lens, visible)
    expected = numpy_tree_attention(q, k, v, np.asarray(lens),
                                    None if visible is None else np.asarray(visible))
    assert rel_err(ref, expected) < 1e-5


# (batch, width, q_heads, kv_heads, head_dim, max_len, dtype, tree, split_k)
LOWER_CASES = [
    (1, 1, 32, 8, 128, 4096, jnp.bfloat16, False, None),     # AR decode, default split
    (2, 1, 32, 8, 64, 1000, jnp.bfloat16, False, 1),
    (1, 16, 32, 8, 128, 4096, jnp.bfloat16, True, None),
    (1, 272, 32, 8, 128, 8192, jnp.bfloat16, True, None),    # width not a power of two
    (2, 272, 16, 2, 64, 700, jnp.bfloat16, True, 1),
    (1, 512, 32, 8, 128, 2048, jnp.bfloat16, False, 2),
    (1, 48, 40, 8, 128, 512, jnp.float32, True, 1),           # group 5: not a power of two
]


@pytest.mark.parametrize("batch,width,q_heads,kv_heads,head_dim,max_len,dtype,tree,split_k",
                         LOWER_CASES)
def test_kernel_lowers_for_cuda(batch, width, q_heads, kv_heads, head_dim, max_len, dtype, tree,
                                split_k):
    q = jax.ShapeDtypeStruct((batch, width, q_heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, max_len, kv_heads, head_dim), dtype)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = [q, kv, kv, lens]
    if tree:
        args.append(jax.ShapeDtypeStruct((batch, width, width), jnp.bool_))
    fn = functools.partial(tree_attention_pallas, split_k=split_k)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_non_power_of_two_block_is_rejected():
    q, k, v, lens, _ = make_case(0, 1, 16, 1, 4, 64, 64, [5], jnp.float32, False)
    with pytest.raises(ValueError, match="power of two"):
        tree_attention_pallas(q, k, v, lens, block_q=48, interpret=True)


def test_default_block_sizes_are_valid():
    for width in (1, 16, 48, 64, 256, 272, 512):
        for group in (1, 4, 5, 8):
            for max_len in (64, 1000, 4096, 40000):
                for itemsize in (2, 4):
                    bs = default_block_sizes(1, width, group, 8, 128, max_len, itemsize)
                    for size in (bs.block_q, bs.block_k):
                        assert size >= 16 and size & (size - 1) == 0
                    assert bs.split_k >= 1
                    # K and V tiles of every pipeline stage fit in Hopper's shared memory.
                    smem = (bs.num_stages * 2 * bs.block_k + bs.block_q) * 128 * itemsize
                    assert smem <= 220 * 1024 and bs.num_stages >= 1
                    # A split grid stays within one wave of resident programs (132 SMs).
                    programs = 8 * -(-width * group // bs.block_q) * bs.split_k
                    assert bs.split_k == 1 or programs <= 132 * ((228 * 1024) // smem), (width, group, bs)
    # Decode at long context splits the keys; a big tree at short context does not.
    assert default_block_sizes(1, 1, 4, 8, 128, 32768).split_k > 1
    assert default_block_sizes(1, 512, 4, 8, 128, 1024).split_k == 1
    assert default_block_sizes(1, 256, 4, 8, 128, 32768).split_k == 1


def test_small_trees_split_128_row_blocks_over_the_sms():
    """Trees with fewer 64-row blocks than a full grid (W 32-128 at the 8B heads: DDTree budgets
    16-64) take 128-row blocks with two warpgroups (8 warps) and split the keys until there is
    about one program per SM, never more; W 256 (128 blocks of 64 rows) keeps 64-row blocks."""
    for width in (32, 48, 64, 80, 128):
        for ctx in (4096, 32768):
            bs = default_block_sizes(1, width, 4, 8, 128, ctx + width)
            programs = 8 * -(-width * 4 // bs.block_q) * bs.split_k
            assert (bs.block_q, bs.num_warps) == (128, 8), (width, bs)
            assert 132 // 2 < programs <= 132, (width, ctx, bs)
    wide = default_block_sizes(1, 256, 4, 8, 128, 4096 + 256)
    assert (wide.block_q, wide.num_warps, wide.split_k) == (64, 4, 1)


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    if ON_GPU:
        pytest.skip("CPU-only check")
    assert resolve_impl("auto") == "reference"
    q, k, v, lens, visible = make_case(5, 2, 16, 1, 4, 64, 64, [3, 30], jnp.float32, True)
    ref = tree_attention_reference(q, k, v, lens, visible)
    np.testing.assert_array_equal(np.asarray(tree_attention(q, k, v, lens, visible)),
                                  np.asarray(ref))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto") == "pallas"
    assert resolve_impl("interpret") == "interpret"
    assert resolve_impl("triton") == "triton"
    with pytest.raises(ValueError):
        resolve_impl("mosaic")


def test_dispatcher_falls_back_for_head_sizes_no_kernel_takes(monkeypatch):
    """On a GPU, "auto" runs the reference where neither kernel takes the head size (8: under the
    Triton kernel's 16-wide blocks), where "pallas" names the problem."""
    q, k, v, lens, visible = make_case(3, 1, 4, 1, 2, 8, 32, [7], jnp.float32, True)
    assert q.shape[-1] == 8
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a Triton launch would fail on the CPU
    out = tree_attention(q, k, v, lens, visible)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tree_attention_reference(q, k, v, lens, visible)))
    with pytest.raises(ValueError, match="head_dim=8 must be a power of two >= 16"):
        tree_attention(q, k, v, lens, visible, impl="pallas")


def test_dispatcher_interpret_matches_reference():
    q, k, v, lens, visible = make_case(11, 1, 16, 1, 4, 64, 64, [9], jnp.float32, True)
    out = tree_attention(q, k, v, lens, visible, impl="interpret")
    ref = tree_attention(q, k, v, lens, visible, impl="reference")
    assert rel_err(out, ref) < 1e-5


# (batch, width, kv_heads, group, head_dim, max_len, lens, dtype, tree, split_k)
GPU_CASES = [
    (1, 1, 8, 4, 128, 4100, [4000], jnp.bfloat16, False, None),
    (3, 1, 8, 4, 128, 3000, [0, 1234, 2999], jnp.bfloat16, False, None),
    (2, 16, 8, 4, 128, 2000, [0, 1777], jnp.float32, True, None),
    (2, 272, 8, 4, 128, 5000, [4001, 77], jnp.bfloat16, True, None),
    (2, 272, 8, 4, 128, 5000, [4001, 77], jnp.bfloat16, True, 1),
    (2, 264, 8, 4, 128, 5000, [4001, 77], jnp.bfloat16, True, None),  # budget 256, row block 8
    (1, 257, 8, 4, 128, 5000, [4001], jnp.bfloat16, True, None),       # budget 256, row block 1
    (1, 17, 8, 4, 128, 5000, [4001], jnp.bfloat16, True, None),        # budgets 16 and 64 at
    (1, 65, 8, 4, 128, 5000, [4001], jnp.bfloat16, True, None),        # row block 1
    (1, 64, 2, 8, 64, 700, [300], jnp.float32, False, 3),
    (2, 48, 8, 5, 128, 900, [500, 0], jnp.bfloat16, True, None),
    (1, 64, 8, 4, 128, 4200, [4100], jnp.bfloat16, True, None),    # 128-row blocks, split 8
    (1, 80, 8, 4, 128, 3000, [2900], jnp.float32, True, None),
    (1, 1, 4, 6, 256, 4200, [4100], jnp.bfloat16, False, None),    # the hybrids' head_dim 256,
    (1, 17, 4, 6, 256, 4200, [4100], jnp.bfloat16, True, None),    # 24 / 4 heads: AR step, DDTree
    (2, 257, 4, 6, 256, 4400, [4100, 33], jnp.bfloat16, True, None),  # budgets 16 and 256
]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,lens,dtype,tree,split_k",
                         GPU_CASES)
def test_gpu_kernel_matches_reference(batch, width, kv_heads, group, head_dim, max_len, lens,
                                      dtype, tree, split_k):
    q, k, v, prefix_lens, visible = make_case(1, batch, width, kv_heads, group, head_dim,
                                              max_len, lens, dtype, tree, num_padding=2)
    out = jax.jit(functools.partial(tree_attention_pallas, split_k=split_k))(
        q, k, v, prefix_lens, visible)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert rel_err(out, ref) < tolerance(dtype)


def test_triton_impl_keeps_the_triton_kernel_where_hopper_applies(monkeypatch):
    """impl="triton" (the path of GPUs other than Hopper) runs the Triton kernel, with the tail
    launch its default tiling has at W 272, even where "pallas" takes the Hopper kernel."""
    import importlib

    hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")
    monkeypatch.setattr(hopper, "available", lambda: True)
    q = jax.ShapeDtypeStruct((1, 272, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4368, 8, 128), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 272, 272), jnp.bool_)]
    texts = {impl: jax.jit(functools.partial(tree_attention, impl=impl)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text() for impl in ("pallas", "triton")}
    assert texts["triton"].count("__gpu$xla.gpu.triton") == 2 and "mosaic_gpu" not in texts["triton"]
    assert "mosaic_gpu" in texts["pallas"]
    for gone in ("pallas-triton", "pallas-one-launch", "pallas-unfused"):
        with pytest.raises(ValueError, match="impl must be one of auto, pallas, triton, reference, interpret"):
            resolve_impl(gone)


# (batch, width, kv_heads, group, head_dim, max_len, lens, dtype, tree, block_q, tail_split)
TAIL_CASES = [
    (2, 20, 2, 4, 64, 200, [0, 137], jnp.float32, True, 16, 3),    # 5 row blocks, tail of 1
    (1, 20, 2, 4, 64, 200, [150], jnp.bfloat16, False, 32, 4),     # causal, padded tail block
    (2, 17, 1, 5, 64, 160, [61, 0], jnp.float32, True, 16, 2),     # group 5: the tail starts at token 16
    (1, 64, 2, 4, 128, 300, [199], jnp.bfloat16, True, 64, 5),     # 4 row blocks of 64
]


@pytest.mark.parametrize(
    "batch,width,kv_heads,group,head_dim,max_len,lens,dtype,tree,block_q,tail_split", TAIL_CASES)
def test_tail_launch_matches_reference(batch, width, kv_heads, group, head_dim, max_len, lens, dtype,
                                       tree, block_q, tail_split):
    """The last row block of each kv head as a second, split-K launch (tail_split): every row is
    written once by the right launch (interpret outputs start as NaN) and equals the reference."""
    q, k, v, prefix_lens, visible = make_case(
        width + group + head_dim + tail_split, batch, width, kv_heads, group, head_dim, max_len,
        lens, dtype, tree)
    out = tree_attention_pallas(q, k, v, prefix_lens, visible, block_q=block_q, block_k=32,
                                tail_split=tail_split, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, tree_attention_reference(q, k, v, prefix_lens, visible)) < tolerance(dtype)


def _waves(programs: int, per_sm: int = 1) -> int:
    return -(-programs // (132 * per_sm))


def test_default_tail_split_saves_a_wave():
    """Budget 256 (W 272) at the 8B head shape, and Qwen3-32B's at tp 1 and 2, get a tail launch:
    without the last row block of each kv head the rest runs one wave fewer. W 256 and 512
    already fill whole waves and get none; neither do split-K shapes."""
    for width, group, kv_heads in ((272, 4, 8), (272, 8, 8), (272, 8, 4)):
        for ctx in (4096, 32768):
            bs = default_block_sizes(1, width, group, kv_heads, 128, ctx + width)
            assert bs.split_k == 1 and bs.tail_split >= 2, (width, group, kv_heads, ctx, bs)
            blocks = -(-width * group // bs.block_q)
            assert _waves(kv_heads * (blocks - 1)) < _waves(kv_heads * blocks)
            assert kv_heads * bs.tail_split <= 132  # the tail itself is one wave
    for width in (1, 16, 64, 256, 512):
        assert default_block_sizes(1, width, 4, 8, 128, 4096 + width).tail_split == 0, width
    # Too few keys to split: no second launch.
    assert default_block_sizes(1, 272, 4, 8, 128, 300).tail_split == 0


def test_tail_launch_lowers_and_validates():
    q = jax.ShapeDtypeStruct((1, 272, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4368, 8, 128), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 272, 272), jnp.bool_)]
    text = jax.jit(tree_attention_pallas).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the main launch and the tail's
    case = make_case(0, 1, 20, 2, 4, 64, 64, [5], jnp.float32, False)
    with pytest.raises(ValueError, match="tail_split=2 .* needs split_k=1"):
        tree_attention_pallas(*case[:4], split_k=2, tail_split=2, interpret=True)


ADA = GpuLimits(num_sms=142, smem_per_block=99 * 1024, smem_per_sm=100 * 1024)  # L40S-class


def test_limits_read_from_the_device():
    """Compute capability and SM count pick the shared-memory limits; without a GPU the tiling
    assumes an H200, where it was tuned."""
    from types import SimpleNamespace

    from pallas_kernels.tree_attention import limits_of

    assert limits_of(SimpleNamespace(compute_capability="8.9", core_count=142)) == ADA
    assert limits_of(SimpleNamespace(compute_capability="9.0", core_count=132)) == H200
    # Unknown architectures (or ROCm names) get the smallest shared memory in the table.
    assert limits_of(SimpleNamespace(compute_capability="gfx942", core_count=304)).smem_per_block == 99 * 1024
    if not ON_GPU:
        assert gpu_limits() == H200


@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_tiles_fit_a_smaller_gpu(itemsize):
    """On a 99 KB-per-block GPU (Ada) every default tile fits its shared memory (Hopper's 208 KB
    tiles would not compile there), and split grids stay within one wave of its 142 SMs."""
    for width in (1, 16, 64, 80, 256, 272, 512):
        for group in (1, 4, 8):
            for max_len in (1000, 4096 + width, 32768 + width):
                bs = default_block_sizes(1, width, group, 8, 128, max_len, itemsize, limits=ADA)
                smem = (bs.num_stages * 2 * bs.block_k + bs.block_q) * 128 * itemsize
                assert smem <= ADA.smem_budget, (width, group, max_len, bs)
                programs = 8 * -(-width * group // bs.block_q) * bs.split_k
                assert bs.split_k == 1 or programs <= 142 * (ADA.smem_per_sm // smem), (width, group, bs)
    # The same shapes on an H200 keep Hopper's larger tiles.
    assert default_block_sizes(1, 272, 4, 8, 128, 4368, limits=H200).block_k == 128
    assert default_block_sizes(1, 272, 4, 8, 128, 4368, limits=ADA).block_k < 128


def test_smaller_gpu_tiling_matches_reference():
    """The Ada tiling (smaller key blocks) computes the same attention (interpret mode)."""
    import dataclasses

    q, k, v, lens, visible = make_case(31, 2, 48, 2, 4, 64, 400, [0, 311], jnp.bfloat16, True)
    blocks = default_block_sizes(2, 48, 4, 2, 64, 400, 2, limits=ADA)
    out = tree_attention_pallas(q, k, v, lens, visible, interpret=True, **dataclasses.asdict(blocks))
    assert rel_err(out, tree_attention_reference(q, k, v, lens, visible)) < tolerance(jnp.bfloat16)


def test_bench_tiling_specs():
    """The kernel benchmark's --tiling values: parsed into the kernel's keyword arguments, and a
    malformed one is refused with the flag's expected form."""
    from dflash_jax.bench.tree_attention_bench import parse_tilings

    assert parse_tilings(["64:128,64,8,2,8", "272:64,128,4,3,1,16"]) == [
        (64, dict(block_q=128, block_k=64, num_warps=8, num_stages=2, split_k=8)),
        (272, dict(block_q=64, block_k=128, num_warps=4, num_stages=3, split_k=1, tail_split=16))]
    for bad in ("64:128,64,8", "128,64,8,2,8", "64:a,64,8,2,8", "272:64,128,4,3,1,16,64"):
        with pytest.raises(SystemExit, match="--tiling .*expected W:block_q"):
            parse_tilings([bad])


# ----------------------------------------------------------------------------- head_dim 256
# The Qwen3.5 / 3.6 hybrids' gated attention: head_dim 256, 24 q heads over 4 kv heads (group 6)
# at the 27B shape. The Triton kernel serves it on every GPU (`hopper_takes` leaves it out).
A6000 = GpuLimits(num_sms=84, smem_per_block=99 * 1024, smem_per_sm=100 * 1024)  # sm_86, the users' GPU

# (width, lens, dtype, limits): W 1 (an AR step), 16 (a DFlash chain as a tree) and 64 (a tree).
WIDE_HEAD_CASES = [
    (1, [40, 0], jnp.float32, H200),
    (16, [3, 51], jnp.float32, H200),
    (64, [70, 9], jnp.bfloat16, H200),
    (16, [3, 51], jnp.bfloat16, A6000),
    (64, [70, 9], jnp.float32, A6000),
]


@pytest.mark.parametrize("width,lens,dtype,limits", WIDE_HEAD_CASES)
def test_head_dim_256_matches_reference(width, lens, dtype, limits):
    """Interpret mode at head_dim 256, GQA group 6, random trees (two padding nodes), with the
    tiles `default_block_sizes` picks for an H200 and for an RTX A6000."""
    import dataclasses

    batch, kv_heads, group, head_dim, max_len = 2, 1, 6, 256, 160
    q, k, v, lens_, visible = make_case(width + len(lens) * 7, batch, width, kv_heads, group, head_dim, max_len,
                                        lens, dtype, True, num_padding=2 if width > 2 else 0)
    blocks = default_block_sizes(batch, width, group, kv_heads, head_dim, max_len,
                                 jnp.dtype(dtype).itemsize, limits=limits)
    out = tree_attention_pallas(q, k, v, lens_, visible, interpret=True, **dataclasses.asdict(blocks))
    ref = tree_attention_reference(q, k, v, lens_, visible)
    assert out.shape == q.shape
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("limits", [H200, A6000], ids=["h200", "a6000"])
def test_head_dim_256_tiles_fit_shared_memory_and_registers(limits):
    """At head_dim 256 every default tile fits the GPU's shared memory with at least one stage, and
    the float32 accumulator stays at most 64 registers a thread (block_q x 256 over the warps)."""
    for width in (1, 16, 17, 64, 65, 257, 513):
        for group, kv_heads in ((6, 4), (2, 2), (8, 1)):
            for max_len in (1000, 4096 + width, 32768 + width):
                for itemsize in (2, 4):
                    bs = default_block_sizes(1, width, group, kv_heads, 256, max_len, itemsize, limits=limits)
                    for size in (bs.block_q, bs.block_k):
                        assert size >= 16 and size & (size - 1) == 0, bs
                    smem = (bs.num_stages * 2 * bs.block_k + bs.block_q) * 256 * itemsize
                    assert smem <= limits.smem_budget and bs.num_stages >= 1, (width, group, max_len, bs)
                    assert bs.num_warps <= 8 and bs.block_q * 256 // (32 * bs.num_warps) <= 64, bs
    # The head_dim-128 tiles tuned on the H200 are untouched by the register rule.
    assert default_block_sizes(1, 64, 4, 8, 128, 4160, limits=H200).block_q == 128
    assert default_block_sizes(1, 64, 4, 8, 128, 4160, limits=H200).num_warps == 8


@pytest.mark.parametrize("width,limits", [(1, H200), (17, H200), (65, H200), (257, H200),
                                          (17, A6000), (257, A6000)])
def test_head_dim_256_lowers_for_cuda(width, limits):
    """The 27B shape's attention (24 / 4 heads of 256, bf16, ctx 4K) lowers to Triton for cuda with
    the H200's and the A6000's default tiles."""
    import dataclasses

    q = jax.ShapeDtypeStruct((1, width, 24, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096 + 512, 4, 256), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, width, width), jnp.bool_)]
    blocks = default_block_sizes(1, width, 6, 4, 256, 4096 + 512, 2, limits=limits)
    fn = functools.partial(tree_attention_pallas, **dataclasses.asdict(blocks))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_head_dim_256_dispatches_to_triton_on_hopper(monkeypatch):
    """"pallas" on sm_90 takes the Triton kernel at head_dim 256 (the Hopper kernel's registers and
    shared memory do not hold its tiles), at a width where head_dim 128 takes the Hopper kernel."""
    import importlib

    from pallas_kernels.tree_attention import hopper_takes

    hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")
    monkeypatch.setattr(hopper, "available", lambda: True)
    assert hopper_takes(65, 32, 8, 128, 4608, jnp.bfloat16)
    assert not hopper_takes(65, 24, 4, 256, 4608, jnp.bfloat16)
    args = [jax.ShapeDtypeStruct((1, 65, 24, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1, 4608, 4, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 4608, 4, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1, 65, 65), jnp.bool_)]
    text = jax.jit(functools.partial(tree_attention, impl="pallas")).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text
