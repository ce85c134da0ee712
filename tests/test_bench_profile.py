"""The profile splitter behind the GPU breakdowns: attribution by named scope and by kind of work.

On CPU the trace's per-instruction events stand in for GPU kernels, so the same code path
(trace -> HLO instruction -> op_name metadata -> scope) is exercised.
"""
import time

import jax
import jax.numpy as jnp

from dflash_jax.bench.profile import classify, hlo_op_names, profile_program, scope_of


def test_hlo_op_names_reads_metadata_and_kernel_spelling():
    text = ('  %gemm_fusion.dot-3 = f32[2]{0} fusion(%p), kind=kCustom, '
            'metadata={op_name="jit(f)/verify/dot_general" stack_frame_id=1}\n'
            '  ROOT %add.7 = f32[2]{0} add(%a, %b)\n')
    names = hlo_op_names(text)
    assert names["gemm_fusion.dot-3"] == "jit(f)/verify/dot_general"
    assert names["gemm_fusion_dot_3"] == "jit(f)/verify/dot_general"  # how GPU kernels are named
    assert "add.7" not in names  # no metadata, nothing to attribute


def test_scope_and_kind_rules():
    assert scope_of("jit(r)/draft/tree/jit(_b)/top_k", ("draft", "tree")) == "tree"  # innermost
    assert scope_of("jit(r)/verify/dot_general", ("draft", "tree")) == "other"
    assert classify("gemm_fusion_dot_12", "") == "matmul"
    assert classify("tree_attention", "") == "attention kernel"
    assert classify("loop_add_fusion", "jit(f)/add") == "elementwise / other"


def test_profile_splits_time_by_named_scope():
    def f(x, small):
        with jax.named_scope("heavy"):
            for _ in range(4):
                x = jnp.tanh(x @ x)
        with jax.named_scope("light"):
            small = small + 1.0
        return x, small

    jitted = jax.jit(f)
    x, small = jnp.ones((384, 384)) / 384, jnp.ones((8,))
    compiled = jitted.lower(x, small).compile()
    out = profile_program(lambda: compiled(x, small), compiled.as_text(), calls=3, scopes=("heavy", "light"))
    assert "error" not in out, out
    split = out["by_scope"]
    assert split.get("heavy", 0.0) > 0.0
    # Four 384^3 matmuls against one 8-element add: the split must rank them by a wide margin.
    assert split["heavy"] > 10 * split.get("light", 0.0), split
    assert out["by_kind"].get("matmul", 0.0) > 0.0
    assert out["device_ms"] >= split["heavy"]


def test_idle_gaps_by_the_scope_that_waited():
    from dflash_jax.bench.profile import idle_gaps
    # Two calls of three kernels (ts, dur in us): 5 us idle before "b" and 10 us before "c" in
    # each call; the 1000 us between the calls is the host's turn and is left out; overlap
    # (the second call's "c" starts inside "b") is no gap.
    spans = [(1060, 30, "c"), (0, 10, "a"), (15, 10, "b"), (35, 5, "c"),  # in any order
             (1040, 10, "a"), (1055, 10, "b")]
    gaps = idle_gaps(spans, calls=2)
    assert gaps == {"b": 5 / 1e3, "c": 10 / 1e3 / 2}


def test_gap_sizes_bucket_the_gaps_and_name_the_longest():
    from dflash_jax.bench.profile import gap_sizes, scale_profile
    # One call's kernels: gaps of 0.5, 3 and 30 us before b, c and d.
    spans = [(0, 10, "s", "a"), (10.5, 10, "s", "b"), (23.5, 1, "t", "c"), (54.5, 5, "t", "d")]
    sizes = gap_sizes(spans, calls=1, largest=2)
    assert sizes["buckets"]["<= 1 us"] == [1, 0.0005]
    assert sizes["buckets"]["<= 5 us"] == [1, 0.003]
    assert sizes["buckets"]["> 20 us"] == [1, 0.03]
    assert sizes["buckets"]["<= 2 us"] == [0, 0.0]
    assert sizes["largest"] == [[30.0, "t", "d", "c"], [3.0, "t", "c", "b"]]
    # A call of 2 rounds: per round, half of each bucket.
    scaled = scale_profile({"top_kernels": [], "gap_sizes": sizes}, 2)
    assert scaled["gap_sizes"]["buckets"]["> 20 us"] == [0.5, 0.015]


def test_gap_pairs_group_the_idle_time_by_kernel_kinds():
    from dflash_jax.bench.profile import gap_pairs, kernel_kind, scale_profile
    assert kernel_kind("fusion_1445") == "fusion" and kernel_kind("Memset 3") == "Memset"
    assert kernel_kind("nvjet_sm90_tst_128x136_64x6_2x1_v_bz_NNT") == "nvjet_sm90_tst_128x136_64x6_2x1_v_bz_NNT"
    # Two layers' copies: gemm -> fusion_1 (2 us) and gemm -> fusion_2 (4 us) are one pair;
    # fusion_2 -> Memset 3 (10 us) another.
    spans = [(0, 10, "v", "gemm"), (12, 3, "v", "fusion_1"), (15, 5, "v", "gemm"),
             (24, 1, "v", "fusion_2"), (35, 1, "w", "Memset 3")]
    pairs = gap_pairs(spans, calls=1)
    assert pairs == [[1, 0.01, 10.0, "fusion", "Memset", "w"], [2, 0.006, 3.0, "gemm", "fusion", "v"]]
    scaled = scale_profile({"top_kernels": [], "gap_pairs": pairs}, 2)
    assert scaled["gap_pairs"][1][:3] == [1.0, 0.003, 3.0]


def test_call_timeline_keeps_the_last_call_in_order():
    from dflash_jax.bench.profile import call_timeline
    # Two calls of three kernels, out of order; the 1000 us between them is the host's turn.
    # The last call: a at 1040, b 5 us after a ends, c overlapping b (no idle).
    spans = [(1060, 30, "v", "c", "jit(run)/while/verify/dot"), (0, 10, "d", "a", "x"),
             (15, 10, "d", "b", "x"), (35, 5, "v", "c", "x"),
             (1040, 10, "d", "a", "jit(run)/draft/add"), (1055, 10, "t", "b", "")]
    line = call_timeline(spans, calls=2)
    assert line == [[0.0, 10.0, 0.0, "d", "a", "draft/add"], [15.0, 10.0, 5.0, "t", "b", ""],
                    [20.0, 30.0, 0.0, "v", "c", "verify/dot"]]
    assert call_timeline(spans[1:4], calls=1)[0][:3] == [0.0, 10.0, 0.0]


def test_spec_round_xla_options_parse_and_refuse_bad_items():
    import argparse

    import pytest

    from dflash_jax.bench.spec_round import parse_xla_options
    assert parse_xla_options("") == {}
    assert parse_xla_options("xla_gpu_enable_pdl=false") == {"xla_gpu_enable_pdl": False}
    # A value may hold commas; the next item starts at the next KEY=.
    assert parse_xla_options("xla_gpu_enable_command_buffer=FUSION,CUBLAS,xla_gpu_graph_min_graph_size=2") == {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS", "xla_gpu_graph_min_graph_size": 2}
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        parse_xla_options("xla_gpu_enable_pdl")


def test_clock_samples_summarize_and_a_missing_smi_does_not_raise(monkeypatch):
    from dflash_jax.bench import clocks
    rows = ["1665, 698.0, 0x0000000000000004", "1755, 603.5, 0x0000000000000004",
            "1980, 150.2, 0x0000000000000000", "1605, 728.4, 0x0000000000000044", "1650, 7"]  # last: cut off
    s = clocks.summarize_samples(clocks.parse(rows))
    assert s["samples"] == 4
    assert s["sm_clock_mhz"]["median"] == (1665 + 1755) / 2 and s["sm_clock_mhz"]["p10"] == 1605
    assert s["power_capped"] == 0.75 and s["thermal"] == 0.25  # 0x40: HW thermal
    assert clocks.summarize_samples(clocks.parse(["N/A, N/A, N/A"])) == {"error": "no samples"}
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockSampler() as sampler:
        pass
    assert sampler.summary == {"error": "no nvidia-smi"}


def test_timed_calls_rest_before_each_call_or_run_back_to_back():
    """`clocks.timed_calls` makes `calls` calls after a rest each, or calls back to back for
    `seconds`, and times every call it makes."""
    from dflash_jax.bench import clocks
    made = []

    def call():
        made.append(time.perf_counter())
        return jnp.zeros(())

    times = clocks.timed_calls(call, calls=3, rest_s=0.02)
    assert len(times) == len(made) == 3 and all(t >= 0 for t in times)
    assert min(b - a for a, b in zip(made, made[1:])) >= 0.02  # each call waited its rest
    made.clear()
    times = clocks.timed_calls(call, seconds=0.05)
    assert len(times) == len(made) >= 1


def test_decode_loop_times_each_attention_variant_rested(tmp_path, monkeypatch):
    """`decode_loop` on the tiny shape: one row per `--attn-impl`, each generating the tokens of the
    first (on a CPU "auto" is the reference), with the rest it was asked for recorded."""
    import json
    import sys
    from dflash_jax.bench import decode_loop
    out = tmp_path / "loop.json"
    monkeypatch.setattr(sys, "argv", ["decode_loop", "--model", "tiny", "--budget", "4", "--ctx", "32", "--new", "4",
                                      "--rounds-per-check", "1", "--iters", "1", "--rest", "0.01",
                                      "--attn-impl", "auto", "reference", "--out", str(out)])
    decode_loop.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["attn_impl"] for r in rows] == ["auto", "reference"]
    assert all(r["tokens_as_first"] and r["rest_s"] == 0.01 and r["rounds"] >= 1 for r in rows)
