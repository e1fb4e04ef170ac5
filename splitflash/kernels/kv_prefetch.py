"""Pull the first keys of every KV split of a layer into L2 before its attention runs.

Why: in a long-context verify step of a small model, each layer is ~6 short latency-bound
kernels (the linears, RoPE, combine) around one attention kernel that streams the layer's
whole KV (142 MB per layer for the default model at 185k keys). While the short kernels run,
HBM sits nearly idle; while attention runs, it is the bottleneck, and every launch pays a
ramp-up before its first tiles arrive. Launched on a side stream as soon as the previous
layer's attention is done, this kernel asks L2 for the first `keys` prefix keys of each split
the next attention will read (the same split plan, see kernels/tuning.py), so part of that
layer's bytes move while the short kernels run and its programs start on L2 hits.

One program per (split, request, KV head), like the attention grid without its row tiles.
It issues one `prefetch.global.L2` per 128-byte line of K and V and exits: no registers hold
the data, so it takes a few microseconds of a few SMs whatever the amount. It only reads
prefix keys (written by earlier steps), never the keys of the block this step writes, so
it can run concurrently with anything in the step.

A prefetch has no result to compare, so the kernel has a TRACE mode that writes the element
offsets it would prefetch instead; tests/unit/test_kv_prefetch.py checks them against the
tokens' offsets looked up through the page table with torch indexing (the reference).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitflash.kernels.tuning import SPLIT_ALIGN, next_pow2, plan_launch

# Keys per split to prefetch by default, and the shortest context worth it. To be chosen on the
# H200 (bench/RESULTS.md, `python -m bench.verify_step --prefetch-keys ...`).
DEFAULT_PREFETCH_KEYS = 0  # off until measured on the GPU (bench/gpu_prefetch.sh)
MIN_PREFETCH_CONTEXT = 16384


def prefetch_keys_setting() -> int:
    """SPLITFLASH_KV_PREFETCH: keys per split to prefetch (0 = off); default
    DEFAULT_PREFETCH_KEYS. Rounded up to a power of two (the kernel's tile)."""
    text = os.environ.get("SPLITFLASH_KV_PREFETCH", "").strip()
    if not text:
        return DEFAULT_PREFETCH_KEYS
    try:
        keys = int(text)
    except ValueError:
        raise ValueError(
            f"SPLITFLASH_KV_PREFETCH must be a key count (0 = off), got {text!r}"
        ) from None
    if keys < 0:
        raise ValueError(f"SPLITFLASH_KV_PREFETCH must be >= 0, got {keys}")
    return next_pow2(keys) if keys else 0


@triton.jit
def _line_offsets(pages_ptr, t, head, stride_p, stride_s, stride_h,
                  PAGE: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):  # fmt: skip
    """Element offsets [KEYS, LINES] of the 128-byte lines of tokens t [KEYS] (all < the
    request's length) of one head."""
    page = tl.load(pages_ptr + t // PAGE).to(tl.int64)
    row = page * stride_p + (t % PAGE) * stride_s + head * stride_h  # [KEYS]
    return row[:, None] + (tl.arange(0, LINES) * LINE_ELEMS)[None, :]


@triton.jit
def _prefetch(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _kv_prefetch_kernel(
    k_ptr, v_ptr,  # [P, S, H_KV, D] (strided views)
    page_table_ptr,  # [B, max_pages] int32
    kv_lens_ptr,  # [B]
    cu_q_ptr,  # [B+1]
    trace_ptr,  # TRACE: [num_splits, B, H_KV, 2, KEYS, LINES] int64, -1 = no line
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    max_pages, num_splits,
    PAGE: tl.constexpr, KEYS: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - tl.load(cu_q_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    # The attention kernel's split of THIS request (kernels/paged_attention.py): the same
    # formula, so the lines fetched are the ones its programs read first.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    start = split * split_len
    end = tl.minimum(tl.minimum(start + split_len, start + KEYS), kv_len - q_len)
    t = start + tl.arange(0, KEYS)
    t_ok = t < end
    # Lanes past `end` re-ask the last token's lines (asm takes no mask): clamp, not mask.
    t = tl.maximum(tl.minimum(t, end - 1), 0)
    pages_ptr = page_table_ptr + b * max_pages
    k_off = _line_offsets(pages_ptr, t, head, stride_kp, stride_ks, stride_kh,
                          PAGE, LINES, LINE_ELEMS)  # fmt: skip
    v_off = _line_offsets(pages_ptr, t, head, stride_vp, stride_vs, stride_vh,
                          PAGE, LINES, LINE_ELEMS)  # fmt: skip
    if TRACE:
        grid_row = (split * tl.num_programs(1) + b) * tl.num_programs(2) + head
        dst = trace_ptr + grid_row * 2 * KEYS * LINES
        cell = tl.arange(0, KEYS)[:, None] * LINES + tl.arange(0, LINES)[None, :]
        tl.store(dst + cell, tl.where(t_ok[:, None], k_off, -1))
        tl.store(dst + KEYS * LINES + cell, tl.where(t_ok[:, None], v_off, -1))
    elif start < end:
        _prefetch(k_ptr + k_off)
        _prefetch(v_ptr + v_off)


def _geometry(k_pages: torch.Tensor) -> tuple[int, int]:
    """(LINE_ELEMS, LINES): elements per 128-byte line and lines per token of one head."""
    line_elems = max(1, 128 // k_pages.element_size())
    return line_elems, next_pow2(-(-k_pages.shape[3] // line_elems))


def kv_prefetch_triton(
    k_pages: torch.Tensor,  # [P, S, H_KV, D]
    v_pages: torch.Tensor,  # [P, S, H_KV, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32
    cu_q: torch.Tensor,  # [B+1] int32
    *,
    group: int,
    max_kv_len: int,
    max_q_len: int,
    keys: int,
    trace: bool = False,
) -> torch.Tensor | None:
    """Prefetch into L2 the first `keys` prefix keys of every split the paged attention
    kernel plans for (max_kv_len, max_q_len, group = q heads per KV head). trace=True:
    nothing is prefetched; returns the element offsets it would prefetch instead,
    [splits, B, H_KV, 2 (K, V), keys, LINES] int64 (-1: none)."""
    n_req, n_kv_heads, page_size = page_table.shape[0], k_pages.shape[2], k_pages.shape[1]
    keys = next_pow2(keys)
    # The attention launch's own plan (its split count depends on its row tiles).
    lp = plan_launch(k_pages.device, max_q_len * group, max_q_len, n_req, n_kv_heads, max_kv_len)
    n_splits = lp.splits.num_splits
    line_elems, lines = _geometry(k_pages)
    trace_buf = None
    if trace:
        trace_buf = torch.full((n_splits, n_req, n_kv_heads, 2, keys, lines), -1,
                               dtype=torch.int64, device=k_pages.device)  # fmt: skip
    if n_req == 0:
        return trace_buf
    _kv_prefetch_kernel[(n_splits, n_req, n_kv_heads)](
        k_pages, v_pages, page_table, kv_lens, cu_q,
        trace_buf if trace else kv_lens,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.shape[1], n_splits,
        PAGE=page_size, KEYS=keys, LINES=lines, LINE_ELEMS=line_elems,
        SPLIT_ALIGN=SPLIT_ALIGN, TRACE=trace, num_warps=4,
    )  # fmt: skip
    return trace_buf
