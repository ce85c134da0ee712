"""Shared test setup: CPU only, float32 matmuls at full precision, tiny HF reference models."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# 4 fake CPU devices for the tensor/data-parallel tests (tests/test_sharding.py); the other
# tests run on device 0 as before.
jax.config.update("jax_num_cpu_devices", 4)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's compiled programs after each test module. Modules rarely share a program, and
    a whole suite's worth of them (the hybrid models' scans among them) outgrows a small CI
    machine's memory, where XLA then dies in the next compile instead of failing cleanly."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="package")
def smollm2_hf():
    """transformers' own load of the packaged SmolLM2 GGUF (float32): the PyTorch reference.

    Loaded once for the suite: several test files compare against it and loading takes ~20 s on 2 cores.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from convert.gguf_file import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()
