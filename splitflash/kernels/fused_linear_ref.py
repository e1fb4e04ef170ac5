"""The contract of the fused small-M linears (kernels/fused_linear.py) in torch: input
checks, which products the kernels take (`fits`), the references (the model's own op
sequence) and the RMSNorm weight folded into the linear weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitflash.kernels.fused_norm import rms_norm_ref
from splitflash.kernels.silu_mul import silu_mul_ref

MAX_M = 256  # rows the fast path gives these kernels (bench.linear_sweep --compare); above, cuBLAS
# K of the models measured (hidden / MLP width <= 2048): a program (or a split of the K axis)
# walks its K in one loop, so much wider layers would be better served by cuBLAS.
MAX_K = 2048


def check_linear(x: torch.Tensor, weight: torch.Tensor, out_cols: int | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if out_cols is not None and weight.shape[0] != 2 * out_cols:
        raise ValueError(f"SwiGLU weight must be [2 * {out_cols}, K], got {tuple(weight.shape)}")


def fits(x: torch.Tensor, weight: torch.Tensor, any_rows: bool = False) -> bool:
    """Do these kernels take this product (M <= MAX_M, K <= MAX_K, unit stride along K)?
    any_rows: any M >= 1 (they are correct for any; MAX_M is where cuBLAS gets faster)."""
    return (
        x.dim() == 2 and x.shape[0] >= 1 and (any_rows or x.shape[0] <= MAX_M)
        and x.shape[1] <= MAX_K and x.stride(1) == 1 and weight.stride(1) == 1
    )  # fmt: skip


def norm_linear_ref(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]; SwiGLU: [2I, K] (gate rows, then up rows)
    swiglu_hidden: int | None = None,  # I: return silu(gate) * up [M, I]
) -> torch.Tensor:  # [M, N] or [M, I]
    check_linear(x, weight, swiglu_hidden)
    y = F.linear(rms_norm_ref(x, norm_weight, eps), weight)
    return y if swiglu_hidden is None else silu_mul_ref(y, swiglu_hidden)


def linear_residual_ref(
    a: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N]
) -> torch.Tensor:  # residual + a @ weight.T, [M, N]
    check_linear(a, weight)
    return residual + F.linear(a, weight)


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] with its columns scaled by the RMSNorm weight [K], rounded once to
    weight's dtype: rmsnorm(x) * nw @ W.T = (x @ (W * nw).T) * rsqrt(mean(x^2) + eps). Cached
    on `weight` itself (it lives and dies with the parameter; a CUDA graph captured after the
    first call reuses the same tensor) until either tensor is modified or replaced. The cost
    is a second copy of those weights on the device (qkv and gate_up: 140 MB of the default
    model's 270 MB in bf16)."""
    try:
        # data_ptr: `model.to(...)` swaps a parameter's data under the same Python object.
        key = (weight.data_ptr(), norm_weight.data_ptr(), weight._version, norm_weight._version)
    except RuntimeError:  # inference tensors keep no version counter: fold every call
        return (weight.float() * norm_weight.float()).to(weight.dtype)
    hit = getattr(weight, "_splitflash_folded", None)
    if hit is not None and hit[0] == key:
        return hit[1]
    folded = (weight.float() * norm_weight.float()).to(weight.dtype).contiguous()
    weight._splitflash_folded = (key, folded)
    return folded
