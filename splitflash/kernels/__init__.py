"""Attention kernels (Triton) and their plain-torch references.

`paged_attention` / `draft_attention` dispatch to Triton on CUDA (or SPLITFLASH_FORCE_TRITON=1)
and to the reference otherwise. The Triton modules are imported lazily so that importing
this package on a CPU-only host never compiles or touches CUDA.
"""

from splitflash.kernels.dispatch import draft_attention, paged_attention
from splitflash.kernels.draft_attention_ref import KeysReadCounter, draft_attention_ref
from splitflash.kernels.paged_attention_ref import paged_attention_ref

__all__ = [
    "KeysReadCounter",
    "draft_attention",
    "draft_attention_ref",
    "paged_attention",
    "paged_attention_ref",
]
