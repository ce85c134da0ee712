"""How a decoder computes, apart from what it computes.

`speculative.SpecSettings` holds the decoding semantics (method, block size, budget, sampling,
stop rules): change one and the tokens may change. `Impl` holds the implementation choices that
are left once every kernel runs where it applies: the attention's implementation and how often
the generation's loop reads `done` back. Greedy tokens are the same for every `Impl` (up to the
float rounding of the kernels against XLA). Everything else that used to be a setting (the
commit's K/V compaction kernel, the residual and qkv epilogue kernels, the tree's top-k kernel)
is chosen by the code where it applies: on a GPU, without a mesh, for shapes it takes.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.tree_attention import IMPLS as ATTENTION_IMPLS
from pallas_kernels.tree_attention import resolve_impl


@dataclasses.dataclass(frozen=True)
class Impl:
    """Implementation choices of a decoder; hashable, so a static argument of the jitted loops.

    attention: the target's attention (`pallas_kernels.tree_attention.tree_attention`'s impl):
      "auto" (by backend: "pallas" on a GPU where a kernel takes the head size, "reference"
      elsewhere), "pallas" (on sm_90 the Hopper kernel where it applies, else the Triton one),
      "triton" (the Triton kernel alone: what GPUs other than Hopper run, e.g. Ampere),
      "reference" (jnp), "interpret" (the Triton kernel interpreted, for CPU tests). With
      "reference" or "interpret" the round's other Pallas kernels (K/V compaction, the drafter's
      context epilogue) stay in XLA too (`round_kernels`).
    rounds_per_check: rounds the generation runs between two reads of `done` (which the host
      must wait for). Rounds after every sequence is done change nothing but cost their time;
      between checks the host issues rounds ahead of the GPU.
    """

    attention: str = "auto"
    rounds_per_check: int = 1

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"Impl.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if isinstance(self.rounds_per_check, bool) or not isinstance(self.rounds_per_check, int) \
                or self.rounds_per_check < 1:
            raise ValueError(f"Impl.rounds_per_check must be an int >= 1, got {self.rounds_per_check!r}")

    def resolved(self, backend: str | None = None) -> Impl:
        """This Impl with "auto" replaced by what it means on `backend` (default
        `jax.default_backend()`): "pallas" on a GPU, "reference" elsewhere. (On a GPU, "auto"
        still falls back to the reference for a head size no kernel takes; "pallas" refuses it.)"""
        return dataclasses.replace(self, attention=resolve_impl(self.attention, backend))

    @property
    def round_kernels(self) -> bool:
        """Whether the round's Pallas kernels besides the attention may run where they apply:
        not when the attention itself runs in jnp ("reference") or interpreted ("interpret"),
        which keep the whole round in XLA (a check of the model without kernels)."""
        return self.attention not in ("reference", "interpret")
