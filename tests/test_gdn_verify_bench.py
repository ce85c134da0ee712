"""The tree-GDN verify benchmark on the tiny hybrid shape (CPU, kernel interpreted): it runs, its
JSON has the fields BENCHMARKS.md reads, and the kernel's results match XLA's."""
import json

import pytest

from dflash_jax.bench import gdn_verify_bench


def test_tiny_run_writes_every_field(tmp_path, capsys):
    out = tmp_path / "gdn_verify.json"
    gdn_verify_bench.main(["--model", "tiny-hybrid", "--widths", "5", "--interpret", "--warmup", "1",
                           "--iters", "1", "--tilings", "16,16,4", "16,16,4,1,ieee,share", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["gdn"] == {"key_heads": 2, "value_heads": 4, "dk": 16, "dv": 16}
    (row,) = record["rows"]
    assert row["width"] == 5 and row["layers"] == 6 and row["tiling"] == "16,16,4,2,tf32x3"
    # A tiling without stages and precision takes the default's.
    assert set(row["tilings_chunk_us"]) == {"16,16,4,2,tf32x3", "16,16,4,1,ieee,share"}
    for name, us in row["tilings_chunk_us"].items():
        assert us > 0 and row["tilings_max_diff"][name] < 1e-5
    for part in ("verify", "chunk"):
        for impl in ("xla", "kernel"):
            assert row[f"{part}_{impl}_us"] > 0
        assert row[f"{part}_speedup"] == pytest.approx(row[f"{part}_xla_us"] / row[f"{part}_kernel_us"])
    # Six chained layers of verify + commit through the kernel end where XLA's do.
    assert row["max_abs_diff_out"] < 1e-5 and row["max_abs_diff_state"] < 1e-5
    assert "| 5 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--model", "qwen3-8b"], ["--tilings", "32,64"], ["--tilings", "a,b,c"],
                                  ["--tilings", "16,16,4,1,fp16"], ["--tilings", "16,16,4,1,ieee,shared"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        gdn_verify_bench.main(argv)
    assert argv[0] in capsys.readouterr().err


def test_a_failing_tiling_is_reported_not_fatal(tmp_path):
    """block_v 32 exceeds the tiny shape's dv of 16: the tiling's entry holds the error."""
    out = tmp_path / "gdn_verify.json"
    gdn_verify_bench.main(["--model", "tiny-hybrid", "--widths", "3", "--interpret", "--warmup", "1",
                           "--iters", "1", "--tilings", "16,32,4", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert "block_v=32 exceeds dv=16" in row["tilings_chunk_us"]["16,32,4,2,tf32x3"]


def test_profile_names_each_chunks_kernels(tmp_path):
    """--profile: per W, each chunk's costliest kernels (name, us and launches per layer, jax op)
    from a trace. The kernel's chunk lists the block kernel's program (op scope tree_gdn_blocks);
    XLA's chunk has no such op."""
    out = tmp_path / "gdn_verify.json"
    gdn_verify_bench.main(["--model", "tiny-hybrid", "--widths", "5", "--interpret", "--warmup", "1",
                           "--iters", "1", "--profile", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    tables = {impl: row[f"chunk_{impl}_kernels"] for impl in ("xla", "kernel")}
    for table in tables.values():
        assert isinstance(table, list) and table, table
        assert all(len(entry) == 4 and entry[1] >= 0 and entry[2] > 0 for entry in table)
    assert any("tree_gdn_blocks" in op for _, _, _, op in tables["kernel"]), tables["kernel"]
    assert not any("tree_gdn" in op for _, _, _, op in tables["xla"]), tables["xla"]


def test_no_kernel_times_xla_alone(tmp_path):
    """--no-kernel: XLA's verify and chunk, profiled, and no kernel fields."""
    out = tmp_path / "gdn_xla.json"
    gdn_verify_bench.main(["--model", "tiny-hybrid", "--widths", "5", "--no-kernel", "--warmup", "1", "--iters", "1",
                           "--profile", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["verify_xla_us"] > 0 and row["chunk_xla_us"] > 0
    assert not any(key.startswith(("chunk_kernel", "verify_kernel", "kernel_error")) for key in row), row
    assert isinstance(row["chunk_xla_kernels"], list) and row["chunk_xla_kernels"]


def test_no_kernel_refuses_tilings(capsys):
    with pytest.raises(SystemExit):
        gdn_verify_bench.main(["--no-kernel", "--tilings", "16,16,4"])
    assert "--no-kernel" in capsys.readouterr().err
