"""Pick the Triton kernel or the torch reference for each attention call.

Triton runs when the tensors live on CUDA, or when SPLITFLASH_FORCE_TRITON=1 (interpreter
tests on CPU, with TRITON_INTERPRET=1). Everything else (CPU serving) takes the reference.
The choice is logged once per (kernel, backend) so a silently wrong path shows in the logs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import cache

import torch

from splitflash.kernels.draft_attention_ref import draft_attention_ref
from splitflash.kernels.paged_attention_ref import paged_attention_ref

logger = logging.getLogger("splitflash.kernels")


@cache
def _announce(kernel: str, backend: str, reason: str) -> None:
    # cache makes this log once per distinct choice without a mutable module global.
    logger.info("%s: using %s (%s)", kernel, backend, reason)


def use_triton(t: torch.Tensor) -> tuple[bool, str]:
    """(use the Triton kernel?, why) for tensors on t's device."""
    if os.environ.get("SPLITFLASH_FORCE_TRITON", "0") == "1":
        return True, "SPLITFLASH_FORCE_TRITON=1"
    if t.is_cuda:
        return True, f"tensors on {t.device}"
    return False, f"tensors on {t.device}"


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k_pages: torch.Tensor,  # [P, S, H_KV, D]
    v_pages: torch.Tensor,  # [P, S, H_KV, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32
    cu_q: torch.Tensor,  # [B+1] int32
    anc_bits: torch.Tensor,  # [N] int64
    scale: float,
    *,
    invariant: bool = False,  # batch-invariant kernel (paged_attention_invariant.py)
    rope=None,  # paged_attention_ref.RopeWrite: q unrotated, the block's K/V not yet written
    **triton_kwargs,  # max_kv_len, max_q_len, num_splits: ignored by the reference
) -> torch.Tensor:  # [N, H, D]
    triton_ok, reason = use_triton(q)
    # SPLITFLASH_ROPE_IN_ATTENTION=0: the separate RoPE + K/V-write launch, to measure or
    # rule the fold out.
    fold = os.environ.get("SPLITFLASH_ROPE_IN_ATTENTION", "1") != "0"
    if rope is not None and triton_ok and not invariant and fold:
        from splitflash.kernels.paged_attention import paged_attention_triton

        _announce("paged_attention", "triton with RoPE + K/V write", reason)
        return paged_attention_triton(
            q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, scale, rope=rope,
            **triton_kwargs,
        )  # fmt: skip
    if rope is not None:  # the two-pass way: its own RoPE + K/V-write launch first
        from splitflash.kernels.fused_dispatch import rope_kv_write  # (it imports this module)

        q = rope_kv_write(q, rope.k, rope.v, rope.cos, rope.sin, k_pages, v_pages, rope.slots)
    if triton_ok and invariant:
        from splitflash.kernels.paged_attention_invariant import paged_attention_invariant

        _announce("paged_attention", "triton batch-invariant", reason)
        return paged_attention_invariant(
            q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, scale,
            max_kv_len=triton_kwargs.get("max_kv_len"), max_q_len=triton_kwargs.get("max_q_len"),
        )  # fmt: skip
    if triton_ok:
        from splitflash.kernels.paged_attention import paged_attention_triton

        _announce("paged_attention", "triton", reason)
        return paged_attention_triton(
            q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, scale, **triton_kwargs
        )
    _announce("paged_attention", "torch reference", reason)
    return paged_attention_ref(q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, scale)


def draft_attention(
    q: torch.Tensor,  # [R, B_blk, H, D]
    blk_k: torch.Tensor,  # [R, B_blk, H_KV, D]
    blk_v: torch.Tensor,  # [R, B_blk, H_KV, D]
    ctx_k: torch.Tensor,  # [C, W_cap, H_KV, D]
    ctx_v: torch.Tensor,  # [C, W_cap, H_KV, D]
    n_ctx: torch.Tensor | Sequence[int],  # [R]
    window: int | None,
    scale: float,
    *,
    causal: bool = False,
    cache_slots: torch.Tensor | Sequence[int] | None = None,  # [R]
    **triton_kwargs,  # max_ctx_len, num_splits, keys_read: ignored by the reference
) -> torch.Tensor:  # [R, B_blk, H, D]
    triton_ok, reason = use_triton(q)
    if triton_ok:
        from splitflash.kernels.draft_attention import draft_attention_triton

        _announce("draft_attention", "triton", reason)
        return draft_attention_triton(
            q, blk_k, blk_v, ctx_k, ctx_v, n_ctx, window, scale,
            causal=causal, cache_slots=cache_slots, **triton_kwargs,
        )  # fmt: skip
    _announce("draft_attention", "torch reference", reason)
    return draft_attention_ref(
        q, blk_k, blk_v, ctx_k, ctx_v, n_ctx, window, scale, causal=causal, cache_slots=cache_slots
    )
