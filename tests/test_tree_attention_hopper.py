"""The Hopper (Mosaic GPU) tree-attention kernel.

On CPU: its mask (the bias of the aligned key blocks) against `key_visibility`, its split-K
merge against the reference, its schedule, and its lowering for cuda. On an H100/H200: the
kernel itself against the jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.bench.tree_attention_bench import random_tree_visibility
from pallas_kernels import key_visibility, tree_attention, tree_attention_reference

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")
dispatch = importlib.import_module("pallas_kernels.tree_attention")

ON_HOPPER = hopper.available()


def make_case(seed: int, batch: int, width: int, kv_heads: int, group: int, head_dim: int,
              max_len: int, lens: list[int], dtype, tree: bool):
    """Random q/k/v, lens and visibility (None: causal). Slots past L+W hold large finite
    values: the kernel reads the rest of its last key block unmasked (its documented
    contract), and the bias must hide them."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, width, kv_heads * group, head_dim))
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    for b, length in enumerate(lens):
        k[b, length + width:] *= 50.0
        v[b, length + width:] *= 50.0
    visible = jnp.asarray(random_tree_visibility(rng, batch, width)) if tree else None
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens, jnp.int32),
            visible)


def rel_err(out, ref) -> float:
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out64)), "non-finite output"
    return float(np.max(np.abs(out64 - ref64)) / np.max(np.abs(ref64)))


@pytest.mark.parametrize("batch,width,group,lens,tree,block_k", [
    (2, 272, 4, [4096, 1000], True, 128),
    (1, 144, 4, [77], False, 128),
    (3, 256, 8, [0, 128, 131], True, 64),
    (1, 16, 4, [5], True, 128),
])
def test_bias_of_the_aligned_key_blocks_is_the_visibility(batch, width, group, lens, tree, block_k):
    """Blocks before floor(L / block_k) are all seen; the bias gives exactly the visibility of
    every later slot, and hides every slot past the tree."""
    rng = np.random.default_rng(width)
    visible = jnp.asarray(random_tree_visibility(rng, batch, width)) if tree else None
    prefix_lens = jnp.asarray(lens, jnp.int32)
    max_len = max(lens) + width + 3 * block_k
    sched = hopper.schedule(batch, 8, width * group, max_len, block_k=block_k)
    rows = sched.padded_rows
    bias = np.asarray(hopper.tree_bias(visible, prefix_lens, width, group, rows, block_k), np.float32)
    assert bias.shape == (batch, rows, hopper.bias_columns(width, block_k))
    assert set(np.unique(bias)) <= {0.0, -np.inf}
    want = np.asarray(key_visibility(prefix_lens, visible, width, max_len))
    for b, l in enumerate(lens):
        start = l // block_k * block_k
        end = -(-(l + width) // block_k) * block_k  # the kernel's last key block ends here
        got = np.zeros((width * group, max_len), bool)
        got[:, :start] = True
        got[:, start:end] = bias[b, :width * group, :end - start] == 0
        np.testing.assert_array_equal(got, want[b][np.arange(width * group) // group])
        assert np.all(bias[b, :, end - start:] == -np.inf)


def _split_partials(q, k, v, prefix_lens, visible, sched: hopper.Schedule):
    """What the kernel's programs write, computed with the reference: each program's share of
    the key blocks (as `_kernel` splits them), normalised, and its log2-sum-exp."""
    batch, width, q_heads, head_dim = q.shape
    max_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = head_dim ** -0.5
    seen_all = np.asarray(key_visibility(prefix_lens, visible, width, max_len))  # [b, W, S]
    rows = hopper.rows_of(q, kv_heads, sched.padded_rows).astype(jnp.float32)
    outs = np.zeros((batch, kv_heads, sched.programs, 128, head_dim), np.float32)
    lses = np.full((batch, kv_heads, sched.programs, 128), -np.inf, np.float32)
    for b in range(batch):
        total = -(-(int(prefix_lens[b]) + width) // sched.block_k)
        for p in range(sched.programs):
            if p < sched.main_programs:
                block, split, n = p // sched.main_split, p % sched.main_split, sched.main_split
            else:
                block, split, n = sched.full_blocks, p - sched.main_programs, sched.tail_split
            per = -(-total // n)
            lo, hi = min(split * per, total) * sched.block_k, min(split * per + per, total) * sched.block_k
            r = np.arange(block * 128, block * 128 + 128)
            token = np.minimum(r // group, width - 1)
            mask = np.zeros((128, max_len), bool)
            mask[:, lo:min(hi, max_len)] = seen_all[b][token][:, lo:min(hi, max_len)]
            for h in range(kv_heads):
                s = np.asarray(rows[b, h, r]) @ np.asarray(k[b, :, h], np.float32).T * scale
                s = np.where(mask, s, -np.inf)
                m = s.max(axis=1, keepdims=True)
                ok = np.isfinite(m[:, 0])
                e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
                l = e.sum(axis=1)
                o = e @ np.asarray(v[b, :, h], np.float32) / np.where(ok, l, 1)[:, None]
                outs[b, h, p] = o
                lses[b, h, p] = np.where(ok, (m[:, 0] + np.log(np.where(ok, l, 1))) / np.log(2), -np.inf)
    return jnp.asarray(outs), jnp.asarray(lses)


@pytest.mark.parametrize("batch,width,lens,tree", [
    (2, 80, [300, 40], True),   # 2 full blocks + a partial one per kv head, split both ways
    (1, 16, [200], False),      # only a partial block (a DFlash chain)
])
def test_merge_of_split_partials_is_the_reference(batch, width, lens, tree):
    """Partials split over the keys the way the kernel splits them, merged by `merge`, give the
    reference's attention (float32)."""
    kv_heads, group, head_dim, max_len = 2, 4, 64, 512
    q, k, v, prefix_lens, visible = make_case(3, batch, width, kv_heads, group, head_dim, max_len,
                                              lens, jnp.float32, tree)
    sched = hopper.schedule(batch, kv_heads, width * group, max_len, num_sms=24, block_k=64)
    assert sched.tail and (sched.main_split > 1 or not sched.full_blocks) and sched.tail_split > 1
    out, lse = _split_partials(q, k, v, prefix_lens, visible, sched)
    got = hopper.tokens_of(hopper.merge(out, lse, sched), width, group)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert rel_err(got, ref) < 1e-5


def test_schedule_fills_one_wave():
    """Budget 256 at the 8B head shape: 8 full blocks per kv head split twice (128 programs) and
    the partial block split 16 ways; W 512 needs no split; a chain is one partial block."""
    s = hopper.schedule(1, 8, 272 * 4, 5120)
    assert (s.full_blocks, s.main_split, s.tail, s.tail_split, s.padded_rows) == (8, 2, True, 16, 1152)
    s = hopper.schedule(1, 8, 512 * 4, 5120)
    assert (s.full_blocks, s.main_split, s.tail) == (16, 1, False)
    s = hopper.schedule(1, 8, 16 * 4, 5120)
    assert (s.full_blocks, s.tail, s.tail_split, s.programs) == (0, True, 16, 16)
    # Short caches: each split keeps at least 2 key blocks.
    assert hopper.schedule(1, 8, 16 * 4, 300).tail_split == 1


@pytest.mark.parametrize("rows", [257 * 4, 272 * 4, 256 * 4, 16 * 4, 1])
def test_grid_order_puts_every_full_block_program_first(rows):
    """`head_and_program` maps the flat grid one to one onto (kv head, program), every head's
    full-block programs at lower indices than any tail program, each head's programs in order."""
    kv_heads = 8
    sched = hopper.schedule(1, kv_heads, rows, 5120)
    c = jnp.arange(kv_heads * sched.programs, dtype=jnp.int32)
    head, program = (np.asarray(a) for a in hopper.head_and_program(sched, kv_heads, c))
    pairs = set(zip(head.tolist(), program.tolist()))
    assert pairs == {(h, p) for h in range(kv_heads) for p in range(sched.programs)}
    is_tail = program >= sched.main_programs
    assert not np.any(is_tail[:kv_heads * sched.main_programs]) and np.all(is_tail[kv_heads * sched.main_programs:])
    for h in range(kv_heads):
        assert np.all(np.diff(program[head == h]) > 0)
        assert np.all(np.diff(np.flatnonzero(head == h)[~is_tail[head == h]]) == 1)  # a head's full blocks together


@pytest.mark.parametrize("rows,kv_heads", [(257 * 4, 8), (513 * 4, 8), (65 * 4, 8), (129 * 8, 2), (258 * 4, 2)])
def test_folded_tail_launches_the_full_block_programs_only(rows, kv_heads):
    """`fold_tail`: the grid holds each kv head's full-block programs once (no tail programs),
    the partials keep their layout (one tail partial per full-block program), and each key
    block of a kv head goes to exactly one program for the tail's rows, one that streams it."""
    sched = hopper.schedule(1, kv_heads, rows, 5120)
    folded = hopper.fold_tail(sched)
    assert folded.fold_tail and folded.launched == sched.main_programs
    assert folded.tail_split == folded.main_programs and folded.programs == 2 * sched.main_programs
    assert folded.padded_rows == sched.padded_rows and 0 < rows - folded.full_blocks * 128 <= hopper.TAIL_COLS
    c = jnp.arange(kv_heads * folded.launched, dtype=jnp.int32)
    head, program = (np.asarray(a) for a in hopper.head_and_program(folded, kv_heads, c))
    assert sorted(zip(head.tolist(), program.tolist())) == [(h, p) for h in range(kv_heads)
                                                            for p in range(folded.main_programs)]
    for total in (1, 2, 3, 35, 36, 41, 67):  # key blocks of a kv head
        owners = {i: [] for i in range(total)}
        for p in range(folded.main_programs):
            row_block, split = divmod(p, folded.main_split)
            lo, hi = (int(x) for x in hopper.split_range(jnp.int32(split), jnp.int32(folded.main_split),
                                                         jnp.int32(total)))
            for i in range(lo, hi):
                if hopper.takes_tail_block(jnp.int32(i), jnp.int32(row_block), folded.full_blocks):
                    owners[i].append(p)
        assert all(len(ps) == 1 for ps in owners.values()), (total, owners)


def test_warpgroup_registers_fit_what_the_launch_gives():
    """setmaxnreg: the compute warpgroups can only take the registers the memory warpgroup gave
    back from the launch's 168 a thread (more deadlocks the kernel: a folded kernel at 232 / 48
    hung on the GPU); steps of 8, as the instruction needs."""
    threads = (hopper.COMPUTE_WGS + 1) * 128
    assert hopper.LAUNCH_REGISTERS == 65536 // threads // 8 * 8
    for fold, (compute, memory) in hopper.REGISTERS.items():
        assert compute % 8 == 0 and memory % 8 == 0 and 24 <= memory < hopper.LAUNCH_REGISTERS < compute <= 256
        assert hopper.COMPUTE_WGS * (compute - hopper.LAUNCH_REGISTERS) <= hopper.LAUNCH_REGISTERS - memory, fold


def test_fold_tail_leaves_other_schedules_as_they_are():
    """No fold without both kinds of block, or with a partial block over TAIL_COLS rows (W 272:
    64 rows)."""
    for rows in (256 * 4, 16 * 4, 17 * 4, 272 * 4, 264 * 4):
        sched = hopper.schedule(1, 8, rows, 5120)
        assert hopper.fold_tail(sched) == sched, rows


def _lowered_kernel(sched, width: int, monkeypatch, kv_heads: int = 8, head_dim: int = 128) -> bytes:
    """The one Mosaic kernel that `hopper_partials` lowers for cuda with `sched` (a 5120-slot cache)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    kv = jax.ShapeDtypeStruct((1, 5120, kv_heads, head_dim), jnp.bfloat16)
    monkeypatch.setattr(mgpu_core, "KNOWN_KERNELS", {})
    hopper.hopper_partials.trace(
        jax.ShapeDtypeStruct((1, kv_heads, sched.padded_rows, head_dim), jnp.bfloat16), kv, kv,
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, sched.padded_rows, hopper.bias_columns(width, 128)), jnp.bfloat16),
        width=width, scale=1.0, sched=sched).lower(lowering_platforms=("cuda",))
    [kernel] = [bytes(k) for k in mgpu_core.KNOWN_KERNELS.values()]
    return kernel


@pytest.mark.parametrize("width,group,head_dim", [(257, 4, 128), (129, 8, 64)])
def test_folded_tail_kernel_lowers_for_cuda(width, group, head_dim, monkeypatch):
    """With `fold_tail` the kernel lowers for cuda (4 or 8 tail rows), as one Mosaic kernel
    whose products include the tail's swap-AB ones: N = TAIL_COLS columns, which the kernel
    without the fold has none of."""
    kv_heads = 8 if group == 4 else 2
    kv = jax.ShapeDtypeStruct((1, 5120, kv_heads, head_dim), jnp.bfloat16)
    base = hopper.schedule(1, kv_heads, width * group, 5120)
    folded, plain = (_lowered_kernel(sched, width, monkeypatch, kv_heads, head_dim)
                     for sched in (hopper.fold_tail(base), base))
    assert b"n8k16" in folded and b"n8k16" not in plain
    q = jax.ShapeDtypeStruct((1, width, kv_heads * group, head_dim), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, width, width), jnp.bool_)]
    fn = functools.partial(hopper.tree_attention_hopper, scale=head_dim ** -0.5, sched=hopper.fold_tail(base))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1  # the split-K merge, over the folded tail's partials too


@pytest.mark.parametrize("block_k,stages", [(128, 2), (64, 4)])
def test_hopper_kernel_lowers_for_cuda(block_k, stages):
    """The Mosaic GPU kernel traces and lowers for cuda without a GPU (one custom call, and one
    Triton launch merging its partials), on 128- and 64-key blocks."""
    q = jax.ShapeDtypeStruct((1, 272, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 5120, 8, 128), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 272, 272), jnp.bool_)]
    sched = hopper.schedule(1, 8, 272 * 4, 5120)
    sched = hopper.schedule(1, 8, 272 * 4, 5120, block_k=block_k)
    sched = dataclasses.replace(sched, stages=stages)
    fn = functools.partial(hopper.tree_attention_hopper, scale=128 ** -0.5, sched=sched)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
    assert text.count("xla.gpu.triton") == 1  # the split-K merge (`split_merge.py`)


def test_hopper_partials_validate_shapes():
    sched = hopper.schedule(1, 2, 64 * 4, 512)
    q = jnp.zeros((1, 2, sched.padded_rows, 64), jnp.bfloat16)
    k = jnp.zeros((1, 510, 2, 64), jnp.bfloat16)  # max_len not a multiple of 8
    bias = jnp.zeros((1, sched.padded_rows, hopper.bias_columns(64, 128)), jnp.bfloat16)
    with pytest.raises(ValueError, match="max_len=510"):
        hopper.hopper_partials(q, k, k, jnp.zeros((1,), jnp.int32), bias, width=64, scale=1.0, sched=sched)


def test_dispatch_needs_hopper_and_an_aligned_cache(monkeypatch):
    monkeypatch.setattr(hopper, "available", lambda: True)
    q = jnp.zeros((1, 272, 32, 128), jnp.bfloat16)
    assert dispatch.hopper_applies(q, jnp.zeros((1, 5120, 8, 128), jnp.bfloat16))
    assert not dispatch.hopper_applies(q, jnp.zeros((1, 5121, 8, 128), jnp.bfloat16))
    assert not dispatch.hopper_applies(q.astype(jnp.float32), jnp.zeros((1, 5120, 8, 128), jnp.float32))
    assert not dispatch.hopper_applies(q[:, :15], jnp.zeros((1, 5120, 8, 128), jnp.bfloat16))  # 60 rows
    assert not dispatch.hopper_applies(q[:, :1], jnp.zeros((1, 5120, 8, 128), jnp.bfloat16))  # an AR step
    long = jnp.zeros((1, dispatch.HOPPER_MAX_WIDTH + 16, 32, 128), jnp.bfloat16)  # a long prefill
    assert not dispatch.hopper_applies(long, jnp.zeros((1, 5120, 8, 128), jnp.bfloat16))
    monkeypatch.setattr(hopper, "available", lambda: False)
    assert not dispatch.hopper_applies(q, jnp.zeros((1, 5120, 8, 128), jnp.bfloat16))


# (batch, width, kv_heads, group, head_dim, max_len, lens, tree)
GPU_CASES = [
    (1, 272, 8, 4, 128, 5120, [4096], True),     # budget 256: full blocks + a partial one
    (2, 272, 8, 4, 128, 4400, [1000, 3077], True),
    (1, 256, 8, 4, 128, 512, [131], True),       # whole blocks only
    (1, 512, 8, 4, 128, 4616, [4096], True),
    (1, 272, 8, 4, 128, 4376, [4096], False),    # causal
    (1, 272, 8, 4, 128, 280, [0], True),         # no prefix
    (3, 144, 8, 4, 128, 2424, [77, 500, 2000], True),
    (1, 48, 8, 4, 128, 4224, [4100], False),     # a chain of 48 (192 rows): a full block and a partial one
    (2, 64, 2, 8, 64, 704, [300, 5], True),      # head_dim 64, group 8
    (2, 257, 8, 4, 128, 4400, [4096, 1001], True),  # W = 1 + budget (row block 1): a 4-row tail
    (1, 264, 8, 4, 128, 4400, [3000], True),     # budget 256 at row block 8: a 32-row tail
    (1, 65, 8, 4, 128, 4400, [4001], True),      # budget 64 at row block 1
    (1, 513, 8, 4, 128, 4616, [4000], True),     # budget 512 at row block 1
]
# From HOPPER_MIN_ROWS (64) to 127 rows: "pallas" takes the Hopper kernel.
GPU_SMALL_CASES = [
    (1, 16, 8, 4, 128, 4224, [4100], False),     # DFlash's verify: a chain of 16 (64 rows)
    (2, 17, 8, 4, 128, 4400, [4000, 77], True),  # DDTree(16) at W 17 (68 rows)
]


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,lens,tree", GPU_CASES)
def test_gpu_hopper_kernel_matches_reference(batch, width, kv_heads, group, head_dim, max_len, lens, tree):
    q, k, v, prefix_lens, visible = make_case(7, batch, width, kv_heads, group, head_dim, max_len,
                                              lens, jnp.bfloat16, tree)
    assert dispatch.hopper_applies(q, k)
    out = jax.jit(functools.partial(tree_attention, impl="pallas"))(q, k, v, prefix_lens, visible)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1.5e-2


# Partial blocks of at most TAIL_COLS rows, which `fold_tail` folds.
GPU_FOLD_CASES = [
    (2, 257, 8, 4, 128, 4400, [4096, 1001], True),  # DDTree(256): a 4-row tail
    (1, 65, 8, 4, 128, 4400, [4001], True),         # DDTree(64)
    (1, 513, 8, 4, 128, 4616, [4000], True),        # DDTree(512): 16 row blocks, no split
    (1, 257, 8, 4, 128, 264, [0], True),            # no prefix: 3 key blocks, most programs take none
    (1, 257, 8, 4, 128, 4376, [4096], False),       # causal
    (2, 129, 2, 8, 64, 704, [300, 5], True),        # head_dim 64, group 8: an 8-row tail
]


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,lens,tree", GPU_FOLD_CASES)
def test_gpu_folded_tail_matches_reference(batch, width, kv_heads, group, head_dim, max_len, lens, tree):
    """The partial block's rows taken by the full-block programs' memory warpgroups
    (`Schedule.fold_tail`), against the reference."""
    q, k, v, prefix_lens, visible = make_case(7, batch, width, kv_heads, group, head_dim, max_len,
                                              lens, jnp.bfloat16, tree)
    sched = hopper.schedule(batch, kv_heads, width * group, max_len)
    sched = hopper.fold_tail(sched)
    assert sched.fold_tail
    out = jax.jit(functools.partial(hopper.tree_attention_hopper, scale=head_dim ** -0.5, sched=sched))(
        q, k, v, prefix_lens, visible)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert out.shape == q.shape and rel_err(out, ref) < 1.5e-2
    tail = slice(sched.full_blocks * hopper.ROWS_PER_BLOCK // group, width)  # the folded tokens alone
    assert rel_err(out[:, tail], ref[:, tail]) < 1.5e-2


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_folded_tail_gives_the_same_bits_every_run():
    """The same inputs, run after run, give the same output. With the folded tail, the compute
    warpgroups' copy of the next bias block could land before a late warp had read the current
    one: 7 different outputs in 20 runs, 0.10 off in sequence 1's main rows (H200), until
    `next_bias` waited for the whole warpgroup."""
    q, k, v, prefix_lens, visible = make_case(7, 2, 257, 8, 4, 128, 4400, [4096, 1001], jnp.bfloat16, True)
    sched = hopper.schedule(2, 8, 257 * 4, 4400)
    sched = hopper.fold_tail(sched)
    fn = jax.jit(functools.partial(hopper.tree_attention_hopper, scale=128 ** -0.5, sched=sched))
    first = np.asarray(fn(q, k, v, prefix_lens, visible))
    assert rel_err(first, tree_attention_reference(q, k, v, prefix_lens, visible)) < 1.5e-2
    for _ in range(15):
        np.testing.assert_array_equal(np.asarray(fn(q, k, v, prefix_lens, visible)), first)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,max_len,lens,tree", GPU_SMALL_CASES)
def test_gpu_hopper_kernel_from_64_rows_matches_reference(batch, width, kv_heads, group, head_dim, max_len,
                                                          lens, tree):
    q, k, v, prefix_lens, visible = make_case(7, batch, width, kv_heads, group, head_dim, max_len,
                                              lens, jnp.bfloat16, tree)
    assert dispatch.hopper_applies(q, k)
    out = jax.jit(functools.partial(tree_attention, impl="pallas"))(q, k, v, prefix_lens, visible)
    ref = tree_attention_reference(q, k, v, prefix_lens, visible)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1.5e-2


def test_hopper_kernel_from_64_rows(monkeypatch):
    """From 64 rows per kv head (DFlash's 16 tokens x group 4) "pallas" runs the Hopper kernel;
    under 64 (an AR step) the Triton one; "triton" never gets a Hopper schedule."""
    monkeypatch.setattr(hopper, "available", lambda: True)
    kv = jnp.zeros((1, 5120, 8, 128), jnp.bfloat16)
    for width, takes in ((16, True), (17, True), (15, False), (32, True), (1, False)):
        q = jnp.zeros((1, width, 32, 128), jnp.bfloat16)
        assert dispatch.hopper_applies(q, kv) == takes, width
        assert (dispatch.rows_schedule(1, width, 32, 8, 128, 5120, jnp.bfloat16, "pallas") is not None) == takes, width
        assert dispatch.rows_schedule(1, width, 32, 8, 128, 5120, jnp.bfloat16, "triton") is None, width


def test_dispatcher_and_row_path_share_the_schedule(monkeypatch):
    """"pallas" reaches the kernel with `hopper_schedule`'s schedule through the dispatcher and on
    the model's row path (`rows_schedule`) alike: W 272's 64-row partial block in tail programs,
    W 257's 4-row one folded into the full-block programs."""
    monkeypatch.setattr(hopper, "available", lambda: True)
    seen = {}
    monkeypatch.setattr(hopper, "tree_attention_hopper",
                        lambda *a, sched, **kw: seen.setdefault("sched", sched) and a[0])
    kv = jnp.zeros((1, 5120, 8, 128), jnp.bfloat16)
    for width, fold in ((272, False), (257, True)):
        seen.clear()
        q = jnp.zeros((1, width, 32, 128), jnp.bfloat16)
        tree_attention(q, kv, kv, jnp.zeros((1,), jnp.int32), None, impl="pallas")
        got = seen["sched"]
        assert got.fold_tail == fold and got.real_rows == width * 4, width
        assert got == dispatch.rows_schedule(1, width, 32, 8, 128, 5120, jnp.bfloat16, "pallas")
        assert got == dispatch.hopper_schedule(1, width * 4, 8, 5120)
        assert got == (hopper.fold_tail(hopper.schedule(1, 8, width * 4, 5120)))


def test_bench_hopper_sched_specs():
    """The kernel benchmark's --hopper-sched values: Schedule fields with int or bool values; an
    unknown field or an empty spec is refused, naming the flag."""
    from dflash_jax.bench.tree_attention_bench import parse_hopper_scheds

    assert parse_hopper_scheds(["bk64:block_k=64,stages=4", "fold:fold_tail=true"]) == {
        "bk64": {"block_k": 64, "stages": 4}, "fold": {"fold_tail": True}}
    sched = hopper.schedule(1, 8, 272 * 4, 5120)
    assert dataclasses.replace(sched, **parse_hopper_scheds(["x:stages=3"])["x"]).stages == 3
    for bad in ("x:block=64", "x:", ":stages=3", "x:pingpong=false"):
        with pytest.raises(SystemExit, match="--hopper-sched"):
            parse_hopper_scheds([bad])
