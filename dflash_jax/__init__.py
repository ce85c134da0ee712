"""dflash-jax: DFlash and DDTree speculative decoding as jit-compiled JAX functions."""

__version__ = "0.1.0"
