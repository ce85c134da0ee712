"""The register and spill report of the tree-GDN kernels (`dflash_jax.bench.kernel_registers`): its
parse of ptxas' report, the kernels' Triton IR lowered for cuda on the CPU, and its refusal without
Triton's compiler (CI has none; the compile and ptxas run where `pip install triton` was done)."""
import importlib.util

import pytest

from dflash_jax.bench import kernel_registers
from dflash_jax.bench.common import SHAPES
from pallas_kernels.tree_gdn import default_block_sizes

# ptxas -v's lines for one kernel, as ptxas 13 prints them for sm_90a.
SPILLING = """ptxas info    : Compiling entry function 'tree_gdn_blocks' for 'sm_90a'
ptxas info    : Function properties for tree_gdn_blocks
    15168 bytes stack frame, 64426 bytes spill stores, 101304 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 15168 bytes cumulative stack size"""
CLEAN = """ptxas info    : Function properties for tree_gdn_blocks
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 166 registers, used 1 barriers"""


def test_parse_ptxas():
    assert kernel_registers.parse_ptxas(SPILLING) == {
        "registers": 32, "stack_bytes": 15168, "spill_store_bytes": 64426, "spill_load_bytes": 101304}
    assert kernel_registers.parse_ptxas(CLEAN) == {
        "registers": 166, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    with pytest.raises(ValueError, match="no register count"):
        kernel_registers.parse_ptxas("ptxas fatal   : Unsupported .version 9.4")


@pytest.mark.parametrize("width,names", [(16, ["tree_gdn_blocks"]), (257, ["tree_gdn_blocks", "tree_gdn_substitution"])])
def test_the_kernels_lower_for_cuda_with_their_dk_loop(width, names):
    """W <= 16 is the block kernel alone. Its products over dk are loops (scf.for), which keep q_i
    and k_i out of registers: held whole, they spilled 64 KB a thread at W 257."""
    cfg = SHAPES["qwen3.6-27b"]
    tiling = default_block_sizes(1, cfg.gdn_value_heads, width, cfg.gdn_key_dim, cfg.gdn_value_dim)
    kernels = kernel_registers.tree_gdn_kernels(cfg, width, tiling)
    assert [name for name, _ in kernels] == names
    blocks_ir = kernels[0][1]
    assert "tt.dot" in blocks_ir and "scf.for" in blocks_ir


def test_without_triton_it_says_what_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(SystemExit):
        kernel_registers.main(["--widths", "16"])
    assert "pip install triton" in capsys.readouterr().err


def test_bad_flags_are_refused(capsys):
    for argv in (["--model", "qwen3-8b"], ["--widths", "0"]):
        with pytest.raises(SystemExit):
            kernel_registers.main(argv)
        assert argv[0] in capsys.readouterr().err
