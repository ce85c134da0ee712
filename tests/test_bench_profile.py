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


def test_launch_cost_chains_compute_what_they_chain():
    """The launch-cost bench's programs: the chain and the while loop apply the step as many
    times as they say (on CPU only the XLA kind runs; its measurement reports every field)."""
    from dflash_jax.bench import launch_cost
    step, x = launch_cost.step_and_input("xla")
    want = x
    for _ in range(6):
        want = jnp.tanh(want) * 0.5 + 0.25
    assert jnp.allclose(launch_cost.chain(step, 6)(x), want)
    assert jnp.allclose(launch_cost.looped(step, 3)(x, jnp.int32(2)), want)
    behind, a, _ = launch_cost.behind_lead(step, 6, size=128)
    assert jnp.allclose(behind(x, a), want)
    row = launch_cost.measure("xla", 6, 2, lead_size=128)
    assert row["chain"] == 6 and row["wall_us"] > 0 and row["loop_wall_us"] > 0 and row["kernels_seen"] >= 1
    assert row["lead_ms"] > 0 and row["issue_behind_lead_us"] > 0


def test_host_pace_reads_slack_and_launch_costs_from_a_trace():
    """The GPU-only analysis of `bench.host_pace` on a hand-made trace: a host line with two
    launch calls, a stream line with their kernels, matched by correlation id."""
    from dflash_jax.bench.host_pace import launch_costs, slack_by_scope, split_events

    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
              {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "cuLaunchKernelEx", "ts": 0.0, "dur": 4.0,
               "args": {"correlation_id": 1}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "cuLaunchKernelEx", "ts": 10.0, "dur": 5.0,
               "args": {"correlation_id": 2}},
              {"ph": "X", "pid": 2, "tid": 7, "name": "nvjet_sm90_tst", "ts": 100.0, "dur": 20.0,
               "args": {"correlation_id": 1, "hlo_op": "gemm"}},
              {"ph": "X", "pid": 2, "tid": 7, "name": "loop_add_fusion", "ts": 123.0, "dur": 2.0,
               "args": {"correlation_id": 2, "hlo_op": "add"}}]
    gpu, host, _ = split_events(events)
    assert [e["name"] for e in gpu] == ["nvjet_sm90_tst", "loop_add_fusion"] and len(host) == 2
    names = {"gemm": "jit(r)/verify/dot_general", "add": "jit(r)/draft/add"}
    slack = slack_by_scope(gpu, host, names, calls=1)
    assert slack["matched_kernels"] == 2
    assert slack["by_scope"]["verify"]["median_slack_us"] == 96.0  # 100 - (0 + 4)
    assert slack["by_scope"]["draft"]["median_slack_us"] == 108.0  # 123 - (10 + 5)
    assert slack["by_scope"]["draft"]["idle_ms_per_call"] == 0.003  # 123 - 120
    costs = launch_costs(gpu, host, calls=1)["by_kind"]
    assert costs["cublas"]["median_api_us"] == 4.0 and costs["cublas"]["median_pre_us"] is None
    assert costs["xla fusion"]["median_pre_us"] == 6.0  # 10 - (0 + 4)
    assert costs["xla fusion"]["ms_per_call"] == 0.011  # (6 + 5) us


def test_int8_products_quantize_within_half_a_step():
    from dflash_jax.bench.int8_products import quantize
    w = jax.random.normal(jax.random.key(1), (64, 3, 5), jnp.float32)
    w = w.at[:, 0, 0].set(0.0)  # an all-zero column keeps scale 1 and values 0
    values, scale = quantize(w, contracted=1)
    assert values.dtype == jnp.int8 and scale.shape == (3, 5)
    assert int(jnp.max(jnp.abs(values.astype(jnp.int32)))) == 127
    err = jnp.abs(values.astype(jnp.float32) * scale - w)
    assert bool(jnp.all(err <= scale / 2 + 1e-6))
    assert float(scale[0, 0]) == 1.0 and not bool(jnp.any(values[:, 0, 0]))
    # Two contracted axes (the o product's [heads, head_dim, embed]): one scale per output column.
    _, scale2 = quantize(w, contracted=2)
    assert scale2.shape == (5,)


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


def test_power_cap_windows_split_early_and_late_calls_and_samples():
    from dflash_jax.bench.power_cap import PERIOD_MS, windows
    # 10 calls of 100 ms from t = 0 s: the first 0.3 s hold calls 0-2 (0 and 1 left out: warm-up).
    starts = [0.1 * i for i in range(10)]
    times = [100.0, 100.0, 90.0, 80.0, 80.0, 80.0, 80.0, 120.0, 120.0, 120.0]
    samples = [(1980.0, 400.0, 0)] * 15 + [(1665.0, 700.0, 4)] * 35  # 50 samples, 1 s at 20 ms
    w = windows(starts, times, samples, early_s=0.3, tail=3)
    assert w["early_calls"] == 1 and w["early_ms"] == 90.0
    assert w["late_calls"] == 3 and w["late_ms"] == 120.0
    assert w["early_clocks"]["samples"] == int(300 / PERIOD_MS) and w["early_clocks"]["power_capped"] == 0.0
    assert w["late_clocks"]["samples"] == 18 and w["late_clocks"]["sm_clock_mhz"]["median"] == 1665.0


def test_ncu_sass_ranks_instructions_by_stall_samples(tmp_path, capsys):
    """`ncu_sass` skips what ncu prints before the CSV header, ranks the SASS lines by their stall
    samples and names each one's main reasons, with the lines around it."""
    from dflash_jax.bench import ncu_sass
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"')
    rows = [("0x10", "HGMMA.64x128x16.F32.BF16 R24", "3", "1", "0", "3", "1"),
            ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1", "1,200", "900", "0", "1,200", "900"),
            ("0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "40", "30", "40", "0", "0"),
            ("0x40", "MUFU.EX2 R19, R19", "0", "0", "0", "0", "0")]
    path = tmp_path / "sass.csv"
    path.write_text("==PROF== a line before the table\n" + head + "\n"
                    + "\n".join(",".join(f'"{v}"' for v in r) for r in rows) + "\n")
    header, parsed = ncu_sass.read_rows(str(path))
    assert header[1] == "Source" and len(parsed) == 4
    assert ncu_sass.number(parsed[1]["Warp Stall Sampling (All Samples)"]) == 1200
    import sys
    argv, sys.argv = sys.argv, ["ncu_sass", str(path), "--top", "2", "--context", "1"]
    try:
        ncu_sass.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "4 instructions, 1243 stall samples" in out
    first, second = out.index("#1 1200 samples"), out.index("#2 40 samples")
    assert first < second
    assert "long_sb 1200" in out[first:second] and "barrier 40" in out[second:]
    assert ">>     1 SYNCS.PHASECHK" in out and "MUFU.EX2" in out[second:]  # the line after the second


def test_power_headroom_times_calls_rested_and_back_to_back():
    """`power_headroom.timed_calls` makes `calls` calls after a rest each, or calls back to back
    for `seconds`; `phase_row` reports ms per round over the calls it is given."""
    from dflash_jax.bench import power_headroom
    made = []

    def call():
        made.append(time.perf_counter())
        return jnp.zeros(())

    times = power_headroom.timed_calls(call, calls=3, rest_s=0.02)
    assert len(times) == len(made) == 3 and all(t >= 0 for t in times)
    assert min(b - a for a, b in zip(made, made[1:])) >= 0.02  # each call waited its rest
    made.clear()
    times = power_headroom.timed_calls(call, seconds=0.05)
    assert len(times) == len(made) >= 1
    row = power_headroom.phase_row("sustained", [80.0, 88.0, 96.0], 8, {"error": "no nvidia-smi"})
    assert (row["calls"], row["ms_per_round"], row["min"], row["max"]) == (3, 11.0, 10.0, 12.0)


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
