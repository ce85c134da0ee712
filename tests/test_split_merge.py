"""The split-K merge kernel (`pallas_kernels/split_merge.py`) and its wiring into the Hopper path.

On CPU: the kernel in interpret mode against its jnp reference (the Hopper module's unrolled
merge and move to tokens), its input checks, its lowering for cuda, and `attend_rows` taking it
where it applies (the jnp merge elsewhere). On a GPU: the compiled
kernel against the reference; on an H100/H200, tree attention through it against the jnp merge.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.split_merge import applies, split_merge, tokens_per_program
from pallas_kernels.tree_attention_hopper import split_merge_reference

hopper = importlib.import_module("pallas_kernels.tree_attention_hopper")
merge_module = importlib.import_module("pallas_kernels.split_merge")

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = hopper.available()


def real_schedule(batch: int, width: int, group: int, kv_heads: int = 8, max_len: int = 5120,
                  num_sms: int = 132) -> hopper.Schedule:
    """The schedule the model gets on an H200 (8 kv heads unless said). The partials may have
    fewer kv heads, which the merge does not mind; fewer SMs give fewer splits. Both keep
    interpret mode fast (its compile time grows with the splits)."""
    return hopper.schedule(batch, kv_heads, width * group, max_len, num_sms)


def make_partials(seed: int, batch: int, kv_heads: int, head_dim: int, sched: hopper.Schedule, width: int,
                  group: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Random partials as `hopper_partials` leaves them: lse in log2 units spread over +-8 with a
    quarter of (row, split) pairs -inf (a split that saw no key), row 5 of each block -inf in
    every split (a row that saw nothing; in every full block, or the tail where there are none),
    and padding rows NaN (an idle warpgroup writes none)."""
    rng = np.random.default_rng(seed)
    shape = (batch, kv_heads, sched.programs, hopper.ROWS_PER_BLOCK)
    out = rng.standard_normal((*shape, head_dim)).astype(np.float32)
    lse = (4 * rng.standard_normal(shape)).astype(np.float32)
    lse[rng.random(shape) < 0.25] = -np.inf
    lse[:, :, :sched.main_programs if sched.full_blocks else sched.programs, 5] = -np.inf
    padded = np.zeros((sched.padded_rows,), bool)
    padded[width * group:] = True
    for p in range(sched.programs):  # the rows of each program's block that are padding
        block = p // sched.main_split if p < sched.main_programs else sched.full_blocks
        rows = padded[block * hopper.ROWS_PER_BLOCK:(block + 1) * hopper.ROWS_PER_BLOCK]
        out[:, :, p, rows] = np.nan
        lse[:, :, p, rows] = np.nan
    return jnp.asarray(out, dtype), jnp.asarray(lse)


@functools.partial(jax.jit, static_argnames=("sched", "width", "group"))
def reference(out: jax.Array, lse: jax.Array, sched: hopper.Schedule, width: int, group: int) -> jax.Array:
    """`split_merge_reference`, jitted: one compile instead of one per op (seconds on CPU)."""
    return split_merge_reference(out, lse, sched, width=width, group=group)


def assert_matches(got: jax.Array, want: jax.Array, dtype) -> None:
    """Equal to float32 rounding before the cast: bf16 to one rounding step."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got64)), "non-finite output"
    scale = np.abs(want64).max()
    if dtype == jnp.float32:
        np.testing.assert_allclose(got64, want64, rtol=0, atol=1e-6 * scale)
    else:
        np.testing.assert_allclose(got64, want64, rtol=2 ** -7, atol=2 ** -9 * scale)


# (batch, width, kv_heads, group, head_dim, dtype, num_sms, tokens overrides)
CASES = [
    pytest.param(1, 272, 2, 4, 128, jnp.bfloat16, 132, {}, id="real"),       # 8 full blocks x 2 splits + a tail x 16
    pytest.param(1, 256, 1, 4, 128, jnp.float32, 132, {}, id="no_tail"),     # the full blocks alone
    pytest.param(1, 16, 1, 4, 128, jnp.bfloat16, 132, {}, id="tail_only"),   # a DFlash chain: 16 splits
    pytest.param(2, 38, 1, 4, 128, jnp.float32, 32, dict(main_tokens=8, tail_tokens=4),
                 id="batch2_partial_program"),                              # 2 splits; 6 tail tokens, programs of 4
    pytest.param(1, 24, 2, 8, 64, jnp.float32, 32, {}, id="group8_hd64"),    # a full block x 4 + a tail x 4
]


@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,dtype,num_sms,tokens", CASES)
def test_merge_kernel_matches_the_jnp_merge(batch, width, kv_heads, group, head_dim, dtype, num_sms, tokens):
    sched = real_schedule(batch, width, group, num_sms=num_sms)
    out, lse = make_partials(width + group, batch, kv_heads, head_dim, sched, width, group, dtype)
    got = split_merge(out, lse, sched, width=width, group=group, interpret=True, **tokens)
    want = reference(out, lse, sched, width, group)
    assert_matches(got, want, dtype)
    # Row 5 (token 5 // group, head 5 % group of each kv head) saw no key in any split: 0, not NaN.
    heads = np.arange(kv_heads) * group + 5 % group
    assert np.all(np.asarray(got[:, 5 // group, heads], np.float32) == 0)


def test_real_schedule_balances_its_programs():
    """At W 272 x group 4: 8 tokens x 2 splits per main program, 1 token x 16 per tail program."""
    sched = real_schedule(1, 272, 4)
    assert (sched.full_blocks, sched.main_split, sched.tail, sched.tail_split) == (8, 2, True, 16)
    main, tail = tokens_per_program(sched, 4)
    assert (main, tail) == (8, 1)
    assert main * 4 * sched.main_split == tail * 4 * sched.tail_split
    # Group 8 with 16 splits: the tail's one token is 128 partial rows, and the main ones match.
    sched = real_schedule(1, 40, 8)
    main, tail = tokens_per_program(sched, 8)
    assert main * 8 * sched.main_split == tail * 8 * sched.tail_split == 128


def test_merge_kernel_checks_its_inputs():
    sched = real_schedule(1, 40, 4)
    out, lse = make_partials(0, 1, 1, 64, sched, 40, 4, jnp.float32)
    call = functools.partial(split_merge, sched=sched, width=40, group=4, interpret=True)
    with pytest.raises(ValueError, match="out"):
        call(out[:, :, 1:], lse)
    with pytest.raises(ValueError, match="lse"):
        call(out, lse[..., :64])
    with pytest.raises(ValueError, match="lse"):
        call(out, lse.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="width=80"):
        split_merge(out, lse, sched, width=80, group=4, interpret=True)
    with pytest.raises(ValueError, match="group=3"):
        split_merge(out, lse, sched, width=40, group=3, interpret=True)
    with pytest.raises(ValueError, match="head_dim=48"):
        call(out[..., :48], lse)
    with pytest.raises(ValueError, match="main_tokens=3"):
        call(out, lse, main_tokens=3)
    with pytest.raises(ValueError, match="tail_tokens=64"):
        call(out, lse, tail_tokens=64)
    assert applies(4, 128) and applies(8, 64) and applies(128, 64)
    assert not applies(3, 128) and not applies(4, 96) and not applies(256, 128)


def test_merge_kernel_lowers_for_cuda():
    """The real shape traces and lowers for cuda without a GPU: one Triton launch."""
    sched = real_schedule(1, 272, 4)
    args = (jax.ShapeDtypeStruct((1, 8, sched.programs, 128, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 8, sched.programs, 128), jnp.float32))
    fn = functools.partial(split_merge, sched=sched, width=272, group=4)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "tensor<1x272x32x128xbf16>" in text


@pytest.mark.parametrize("kernel_applies", [True, False])
def test_attend_rows_merges_with_the_kernel_where_it_applies(kernel_applies, monkeypatch):
    """`attend_rows` with the Mosaic kernel (and its bias) replaced by fixed partials: the merge
    kernel runs (in interpret mode here) where `split_merge.applies`, the jnp merge otherwise;
    the same result. The shapes of the case "group8_hd64", whose kernel compile is made already;
    the jnp merge jitted (op by op it compiles for seconds)."""
    batch, width, kv_heads, group, head_dim, max_len = 1, 24, 2, 8, 64, 5120
    sched = real_schedule(batch, width, group, num_sms=32)
    out, lse = make_partials(1, batch, kv_heads, head_dim, sched, width, group, jnp.float32)
    want = reference(out, lse, sched, width, group)
    assert merge_module.applies(group, head_dim)
    ran = []
    kernel, jnp_merge = merge_module.split_merge, jax.jit(hopper.merge, static_argnames="sched")
    monkeypatch.setattr(hopper, "tree_bias", lambda *a, **kw: None)
    monkeypatch.setattr(hopper, "hopper_partials", lambda *a, **kw: (out, lse))
    monkeypatch.setattr(merge_module, "applies", lambda *a, **kw: kernel_applies)
    monkeypatch.setattr(merge_module, "split_merge",
                        lambda *a, **kw: ran.append("kernel") or kernel(*a, **kw, interpret=True))
    monkeypatch.setattr(hopper, "merge", lambda *a, **kw: ran.append("jnp") or jnp_merge(*a, **kw))
    q_rows = jnp.zeros((batch, kv_heads, sched.padded_rows, head_dim), jnp.float32)
    kv = jnp.zeros((batch, max_len, kv_heads, head_dim), jnp.float32)
    got = hopper.attend_rows(q_rows, kv, kv, jnp.zeros((batch,), jnp.int32), None, width=width, group=group,
                             scale=1.0, sched=sched)
    assert ran == ["kernel" if kernel_applies else "jnp"]
    assert_matches(got, want, jnp.float32)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("batch,width,kv_heads,group,head_dim,dtype,num_sms,tokens", CASES)
def test_gpu_merge_kernel_matches_the_jnp_merge(batch, width, kv_heads, group, head_dim, dtype, num_sms, tokens):
    sched = real_schedule(batch, width, group, num_sms=num_sms)
    out, lse = make_partials(width + group, batch, 8, head_dim, sched, width, group, dtype)
    got = split_merge(out, lse, sched, width=width, group=group, **tokens)
    want = reference(out, lse, sched, width, group)
    assert_matches(got, want, dtype)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_tree_attention_through_the_merge_kernel(monkeypatch):
    """The real shape, the Hopper kernel's own partials: "pallas" (merge kernel) against the
    same kernel's partials merged in jnp (`split_merge.applies` patched off) and the reference."""
    from dflash_jax.bench.tree_attention_bench import random_tree_visibility
    from pallas_kernels import tree_attention, tree_attention_reference

    rng = np.random.default_rng(11)
    batch, width, q_heads, kv_heads, head_dim, max_len = 1, 272, 32, 8, 128, 5120
    q = jnp.asarray(rng.standard_normal((batch, width, q_heads, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, max_len, kv_heads, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, max_len, kv_heads, head_dim)), jnp.bfloat16)
    lens = jnp.asarray([4096], jnp.int32)
    visible = jnp.asarray(random_tree_visibility(rng, batch, width))
    outs = {"pallas": jax.jit(functools.partial(tree_attention, impl="pallas"))(q, k, v, lens, visible)}
    monkeypatch.setattr(merge_module, "applies", lambda *a, **kw: False)
    outs["jnp merge"] = jax.jit(functools.partial(tree_attention, impl="pallas"))(q, k, v, lens, visible)
    assert_matches(outs["pallas"], outs["jnp merge"], jnp.bfloat16)
    ref = np.asarray(tree_attention_reference(q, k, v, lens, visible), np.float64)
    assert np.abs(np.asarray(outs["pallas"], np.float64) - ref).max() < 1.5e-2 * np.abs(ref).max()
