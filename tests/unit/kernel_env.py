"""Where the kernel tests run, shared by every kernel test module: in the Triton interpreter
(TRITON_INTERPRET=1, as `make test` sets it; fp32/fp16 only, its bf16 is broken) or compiled
on a CUDA GPU (bf16 too, `make test-gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not (INTERPRET or CUDA),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by `make test`)",
)
needs_gpu = pytest.mark.skipif(
    not CUDA or INTERPRET,
    reason="bf16 kernel tests need a CUDA GPU and TRITON_INTERPRET unset (bf16 is broken there)",
)
DEVICE = "cpu" if INTERPRET or not CUDA else "cuda"
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
