"""Pick the Triton kernel or the torch reference for the fused norm, RoPE + KV-write, SwiGLU
activation and the small-M linear layers fused with them.

Same rule and logging as `splitflash.kernels.dispatch` (whose helpers are reused): Triton on
CUDA tensors or with SPLITFLASH_FORCE_TRITON=1, the reference otherwise, the choice logged
once per (kernel, backend). The kernel modules hold both implementations, so they are
imported inside the calls: importing this module never touches Triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from splitflash.kernels.dispatch import _announce, use_triton


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rmsnorm(x), or (weight * rmsnorm(x + residual), x + residual)."""
    triton_ok, reason = use_triton(x)
    if triton_ok:
        from splitflash.kernels.fused_norm import rms_norm_triton

        _announce("rms_norm", "triton", reason)
        return rms_norm_triton(x, weight, eps, residual)
    from splitflash.kernels.fused_norm import rms_norm_ref

    _announce("rms_norm", "torch reference", reason)
    return rms_norm_ref(x, weight, eps, residual)


def rope_kv_write(
    q: torch.Tensor,  # [N, H, Dh]
    k: torch.Tensor,  # [N, H_KV, Dh]
    v: torch.Tensor,  # [N, H_KV, Dh]
    cos: torch.Tensor,  # [N, 1, Dh]
    sin: torch.Tensor,  # [N, 1, Dh]
    k_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    v_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    slots: torch.Tensor,  # [N] flat slots
) -> torch.Tensor:  # rotated q [N, H, Dh]
    triton_ok, reason = use_triton(q)
    if triton_ok:
        from splitflash.kernels.rope_kv import rope_kv_write_triton

        _announce("rope_kv_write", "triton", reason)
        return rope_kv_write_triton(q, k, v, cos, sin, k_pages, v_pages, slots)
    from splitflash.kernels.rope_kv import rope_kv_write_ref

    _announce("rope_kv_write", "torch reference", reason)
    return rope_kv_write_ref(q, k, v, cos, sin, k_pages, v_pages, slots)


def head_norm_rope(
    x: torch.Tensor,  # [M, H, hd]
    weight: torch.Tensor,  # [hd]
    eps: float,
    cos: torch.Tensor,  # [M, hd]
    sin: torch.Tensor,  # [M, hd]
) -> torch.Tensor:  # [M, H, hd]: RoPE(weight * rmsnorm(x)) per head
    triton_ok, reason = use_triton(x)
    if triton_ok:
        from splitflash.kernels.head_norm_rope import head_norm_rope_triton

        _announce("head_norm_rope", "triton", reason)
        return head_norm_rope_triton(x, weight, eps, cos, sin)
    from splitflash.kernels.head_norm_rope import head_norm_rope_ref

    _announce("head_norm_rope", "torch reference", reason)
    return head_norm_rope_ref(x, weight, eps, cos, sin)


def silu_mul(gate_up: torch.Tensor, hidden: int) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> silu(gate) * up [..., I]. The kernel has no backward:
    a tensor that needs gradients (drafter training reuses the MLP) takes the reference."""
    triton_ok, reason = use_triton(gate_up)
    if triton_ok and gate_up.requires_grad:
        triton_ok, reason = False, "input needs gradients (the kernel has no backward)"
    if triton_ok:
        from splitflash.kernels.silu_mul import silu_mul_triton

        _announce("silu_mul", "triton", reason)
        return silu_mul_triton(gate_up, hidden)
    from splitflash.kernels.silu_mul import silu_mul_ref

    _announce("silu_mul", "torch reference", reason)
    return silu_mul_ref(gate_up, hidden)


def _fused_linear_ok(
    x: torch.Tensor, weight: torch.Tensor, any_rows: bool = False
) -> tuple[bool, str]:
    """(run the fused small-M linear kernel?, why): Triton's rule, few rows, no autograd.
    any_rows: however many rows (batch-invariant steps: a row's K loop and tile are then
    the same whatever M, where cuBLAS picks its kernel, split-K included, by M)."""
    from splitflash.kernels.fused_linear_ref import MAX_K, MAX_M, fits

    triton_ok, reason = use_triton(x)
    if not triton_ok:
        return False, reason
    if os.environ.get("SPLITFLASH_FUSED_LINEAR", "1") == "0":  # to measure or rule it out
        return False, "SPLITFLASH_FUSED_LINEAR=0"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False, "input needs gradients (the kernel has no backward)"
    if not fits(x, weight, any_rows):
        return False, f"not M <= {MAX_M} rows with K <= {MAX_K} (cuBLAS takes it)"
    return True, reason + (", batch-invariant" if any_rows else "")


def norm_linear(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]; SwiGLU: [2I, K] (gate rows, then up rows)
    swiglu_hidden: int | None = None,  # I: return silu(gate) * up
    any_rows: bool = False,  # the kernel for any M (see _fused_linear_ok)
) -> torch.Tensor:  # [M, N] or [M, I]
    """linear(rmsnorm(x) * norm_weight) (then SwiGLU): one kernel for few rows on CUDA,
    otherwise the norm, a cuBLAS / CPU GEMM and the activation, each dispatched itself."""
    fused, reason = _fused_linear_ok(x, weight, any_rows)
    _announce("norm_linear", "triton fused" if fused else "norm + GEMM", reason)
    if fused:
        from splitflash.kernels.fused_linear import norm_linear_triton

        return norm_linear_triton(x, norm_weight, eps, weight, swiglu_hidden, invariant=any_rows)
    y = F.linear(rms_norm(x, norm_weight, eps), weight)
    return y if swiglu_hidden is None else silu_mul(y, swiglu_hidden)


def linear_residual(
    a: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N]
    any_rows: bool = False,  # the kernel for any M (see _fused_linear_ok)
) -> torch.Tensor:  # residual + a @ weight.T
    """The projection back into the residual stream, with the add in the GEMM's epilogue for
    few rows on CUDA."""
    fused, reason = _fused_linear_ok(a, weight, any_rows)
    _announce("linear_residual", "triton fused" if fused else "GEMM + add", reason)
    if fused:
        from splitflash.kernels.fused_linear import linear_residual_triton

        return linear_residual_triton(a, weight, residual, invariant=any_rows)
    return residual + F.linear(a, weight)
