"""Pallas (Triton backend) kernels, each with its pure-JAX reference beside it."""

from pallas_kernels.tree_attention import (
    H200,
    BlockSizes,
    GpuLimits,
    default_block_sizes,
    gpu_limits,
    key_visibility,
    resolve_impl,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

__all__ = [
    "H200",
    "BlockSizes",
    "GpuLimits",
    "default_block_sizes",
    "gpu_limits",
    "key_visibility",
    "resolve_impl",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
]
