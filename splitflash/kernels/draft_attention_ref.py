"""Plain-torch drafter block attention: the oracle for the Triton kernel and the CPU path.

Batched layout (R requests, all drafting blocks of the same size B_blk):
    q            [R, B_blk, H, D]      queries of each drafted block
    blk_k, blk_v [R, B_blk, H_KV, D]   the block's own keys/values
    ctx_k, ctx_v [C, W_cap, H_KV, D]   one ring buffer per cache slot c: context entry at
                                       absolute position p lives at [c, p % W_cap]
    n_ctx        [R] int               context entries ever written for request r
    window       W or None             sliding layer of window W; None: full layer
    causal       bool                  causal inside the block (else non-causal)
    cache_slots  [R] int or None       ring-buffer slot of request r (None: slot r)
    out          [R, B_blk, H, D]
Semantics: exactly `splitflash.models.dflash.cache.block_attention` (the function the
drafter was trained with). Block query i sits at position s = n_ctx + i, block key j at
n_ctx + j, context key at p < n_ctx. A key at position p is visible to the query at s iff
s - p < W (sliding), p <= s (causal), and for a non-causal sliding layer also p - s < W.
So the anchor (i = 0) sees the W - 1 newest context entries and later queries fewer: a
sliding layer reads only positions n_ctx - (W - 1) .. n_ctx - 1, min(n_ctx, W - 1) entries
whatever the context length. The ring must hold them: W_cap >= min(n_ctx, W - 1) (full
layer: W_cap >= n_ctx); W_cap < W is fine before the ring first wraps (the drafter's cache
grows its ring up to W), W_cap > W too (slot = p % W_cap either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class KeysReadCounter:
    """Test hook: context keys gathered per request, appended by each call."""

    per_request: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.per_request)


def as_int_list(values: torch.Tensor | Sequence[int], name: str, length: int) -> list[int]:
    out = values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]
    if len(out) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(out)}")
    return out


def check_draft_inputs(
    q: torch.Tensor,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    window: int | None,
) -> int:
    """Shape/dtype checks (no device sync). Returns the GQA group size G = H // H_KV."""
    if q.dim() != 4:
        raise ValueError(f"q must be [R, B_blk, H, D], got {tuple(q.shape)}")
    n_req, blk, n_heads, head_dim = q.shape
    if blk_k.shape != blk_v.shape or blk_k.dim() != 4 or blk_k.shape[:2] != (n_req, blk):
        raise ValueError(
            f"blk_k/blk_v must be [R={n_req}, B_blk={blk}, H_KV, D], got "
            f"{tuple(blk_k.shape)} and {tuple(blk_v.shape)}"
        )
    if ctx_k.shape != ctx_v.shape or ctx_k.dim() != 4:
        raise ValueError(
            f"ctx_k/ctx_v must be [C, W_cap, H_KV, D], got {tuple(ctx_k.shape)} and "
            f"{tuple(ctx_v.shape)}"
        )
    n_kv_heads = blk_k.shape[2]
    if ctx_k.shape[2:] != (n_kv_heads, head_dim) or blk_k.shape[3] != head_dim:
        raise ValueError("H_KV / D differ between q, block keys and context keys")
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"H={n_heads} is not a multiple of H_KV={n_kv_heads}")
    if any(t.dtype != q.dtype for t in (blk_k, blk_v, ctx_k, ctx_v)):
        raise ValueError("q, block and context tensors must share one dtype")
    if window is not None and window < 1:
        raise ValueError(f"window {window} must be >= 1")
    return n_heads // n_kv_heads


def context_reads(n: int, window: int | None) -> int:
    """Context entries a drafting call reads: min(n, W - 1) for a sliding layer, n if full."""
    return n if window is None else min(n, window - 1)


def context_span(n: int, window: int | None, w_cap: int, request: int) -> tuple[int, int]:
    """(first absolute context position read, number read) for one request."""
    if n < 0:
        raise ValueError(f"request {request}: n_ctx {n} < 0")
    n_read = context_reads(n, window)
    if n_read > w_cap:
        if window is None:
            raise ValueError(f"request {request}: full layer needs W_cap >= n_ctx ({w_cap} < {n})")
        raise ValueError(
            f"request {request}: sliding layer of window {window} reads the last {n_read} "
            f"context entries but the ring holds W_cap={w_cap}"
        )
    return n - n_read, n_read


def draft_visibility(
    n: int, n_read: int, blk: int, window: int | None, causal: bool, device=None
) -> torch.Tensor:
    """Bool [B_blk, n_read + B_blk]: may block query i see key j of [context read | block]."""
    qpos = torch.arange(n, n + blk, device=device)
    kpos = torch.cat([torch.arange(n - n_read, n, device=device), qpos])
    rel = qpos[:, None] - kpos[None, :]  # query position - key position
    visible = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        visible &= rel >= 0
    if window is not None:
        visible &= rel < window
        if not causal:
            visible &= -rel < window
    return visible


def draft_attention_ref(
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
    counter: KeysReadCounter | None = None,
) -> torch.Tensor:  # [R, B_blk, H, D]
    group = check_draft_inputs(q, blk_k, blk_v, ctx_k, ctx_v, window)
    n_req, blk, n_heads, head_dim = q.shape
    w_cap, n_kv_heads = ctx_k.shape[1], ctx_k.shape[2]
    lens = as_int_list(n_ctx, "n_ctx", n_req)
    slots = (
        list(range(n_req))
        if cache_slots is None
        else as_int_list(cache_slots, "cache_slots", n_req)
    )
    soft_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for r in range(n_req):
        if not 0 <= slots[r] < ctx_k.shape[0]:
            raise ValueError(f"request {r}: cache slot {slots[r]} outside 0..{ctx_k.shape[0] - 1}")
        first, n_read = context_span(lens[r], window, w_cap, r)
        ring = (torch.arange(n_read, device=q.device) + first) % max(w_cap, 1)  # [n_read]
        # [n_read + B_blk, H_KV, D] -> [H_KV, L, D]
        k = torch.cat([ctx_k[slots[r]].index_select(0, ring), blk_k[r]]).transpose(0, 1)
        v = torch.cat([ctx_v[slots[r]].index_select(0, ring), blk_v[r]]).transpose(0, 1)
        if counter is not None:
            counter.per_request.append(n_read)
        visible = draft_visibility(lens[r], n_read, blk, window, causal, q.device)
        # [B_blk, H, D] -> [H_KV, G * B_blk, D]; head h = kv_head * G + g, row g * B_blk + i
        qr = q[r].reshape(blk, n_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qr = qr.reshape(n_kv_heads, group * blk, head_dim)
        scores = torch.matmul(qr, k.transpose(1, 2)).to(soft_dtype) * scale
        # Every query sees at least its own block key, so no row is fully masked.
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v).view(n_kv_heads, group, blk, head_dim).permute(2, 0, 1, 3)
        out[r] = o.reshape(blk, n_heads, head_dim)
    return out
