"""bench/lowered.py: decoding's programs lowered for cuda on the CPU, as a GPU would take them."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lowered(*args: str) -> dict[str, tuple[str, str]]:
    """{program: (digest, kernels)} printed by the tool for the tiny shape."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "dflash_jax.bench.lowered", "--model", "tiny", "--ctx", "64",
                          "--new", "8", "--budget", "8", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {name: (digest, kernels) for name, digest, kernels in
            re.findall(r"^(\w+): sha256 (\w+), \d+ chars; (.*)$", out.stdout, re.M)}
    assert set(rows) == {"ar", "dflash", "ddtree"}, out.stdout
    return rows


def test_programs_lower_with_the_gpu_kernels_and_the_same_text_every_time():
    """Lowered as on a GPU, each program holds the Pallas kernels decoding runs there (not the
    CPU's jnp paths); the text has no source locations, so a second process gives the same digest."""
    first, second = _lowered("--gpu", "other"), _lowered("--gpu", "other")
    assert first == second
    assert "tree_attention x" in first["ar"][1]
    assert "kv_compact x1" in first["dflash"][1] and "kv_compact x1" in first["ddtree"][1]
    assert "top_k_select x1" in first["ddtree"][1] and "top_k_select" not in first["dflash"][1]
    assert all("mosaic_gpu" not in kernels for _, kernels in first.values())
