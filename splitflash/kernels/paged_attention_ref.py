"""Plain-torch paged verify/decode attention: the oracle for the Triton kernel and the CPU
serving path.

Per request: gather its pages with index_select, one matmul for scores over all keys, an
ancestor mask applied to the LAST q_len keys only (the drafted block), one softmax, one
matmul with V. The prefix is never masked, so nothing of size [q_len, kv_len] but the scores
themselves is materialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_Q_LEN = 64  # anc_bits is int64: one bit per block node


@dataclass
class RopeWrite:
    """What attention needs to apply RoPE itself and write the block's K/V (same contract
    as rope_kv_write's arguments); q passed to attention is then the unrotated q."""

    k: torch.Tensor  # [N, H_KV, D] unrotated, any row / head strides, unit last stride
    v: torch.Tensor  # [N, H_KV, D]
    cos: torch.Tensor  # [N, 1, D] or [N, D]
    sin: torch.Tensor  # [N, 1, D] or [N, D]
    slots: torch.Tensor  # [N] flat slots (page * S + offset) of the rows' K/V


def check_paged_inputs(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_q: torch.Tensor,
    anc_bits: torch.Tensor,
) -> int:
    """Shape/dtype checks (no device sync). Returns the GQA group size G = H // H_KV."""
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got shape {tuple(q.shape)}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [P, S, H_KV, D], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    n_rows, n_heads, head_dim = q.shape
    n_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"head dim mismatch: q has {head_dim}, pages have {k_pages.shape[3]}")
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"H={n_heads} is not a multiple of H_KV={n_kv_heads}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_pages.dtype}, v {v_pages.dtype}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [B, max_pages], got {tuple(page_table.shape)}")
    n_req = page_table.shape[0]
    if kv_lens.shape != (n_req,) or cu_q.shape != (n_req + 1,):
        raise ValueError(
            f"with B={n_req}: kv_lens must be [B] and cu_q [B+1], got "
            f"{tuple(kv_lens.shape)} and {tuple(cu_q.shape)}"
        )
    if anc_bits.shape != (n_rows,) or anc_bits.dtype != torch.int64:
        raise ValueError(
            f"anc_bits must be int64 [N={n_rows}], got {anc_bits.dtype} {tuple(anc_bits.shape)}"
        )
    for name, t in (("page_table", page_table), ("kv_lens", kv_lens), ("cu_q", cu_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return n_heads // n_kv_heads


def block_visibility(anc_rows: torch.Tensor, q_len: int) -> torch.Tensor:
    """anc_rows [q_len] int64 -> [q_len, q_len] bool, [i, j] = block node j visible to i."""
    shifts = torch.arange(q_len, device=anc_rows.device, dtype=torch.int64)
    return ((anc_rows[:, None] >> shifts[None, :]) & 1).bool()


def paged_attention_ref(
    q: torch.Tensor,  # [N, H, D]
    k_pages: torch.Tensor,  # [P, S, H_KV, D]
    v_pages: torch.Tensor,  # [P, S, H_KV, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32, including the block
    cu_q: torch.Tensor,  # [B+1] int32
    anc_bits: torch.Tensor,  # [N] int64
    scale: float,
) -> torch.Tensor:  # [N, H, D], q.dtype
    group = check_paged_inputs(q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits)
    _, n_heads, head_dim = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    # Matmuls run in the input dtype (what a low-precision torch path does); softmax in at
    # least fp32 so the reference is not worse than the kernel's fp32 accumulation.
    soft_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    # One host transfer for the small index tensors instead of a sync per request.
    cu = cu_q.tolist()
    lens = kv_lens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_q must run from 0 to N={q.shape[0]}, got {cu[0]}..{cu[-1]}")
    for b, kv_len in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"request {b}: q_len {q_len} outside 1..{MAX_Q_LEN}")
        if kv_len < q_len:
            raise ValueError(f"request {b}: kv_len {kv_len} < q_len {q_len}")
        n_pages = -(-kv_len // page_size)
        if n_pages > page_table.shape[1]:
            raise ValueError(
                f"request {b}: kv_len {kv_len} needs {n_pages} pages, "
                f"page_table has {page_table.shape[1]}"
            )
        pages = page_table[b, :n_pages].to(torch.long)
        # [n_pages, S, H_KV, D] -> [H_KV, L, D]
        k = k_pages.index_select(0, pages).flatten(0, 1)[:kv_len].transpose(0, 1)
        v = v_pages.index_select(0, pages).flatten(0, 1)[:kv_len].transpose(0, 1)
        # [q_len, H, D] -> [H_KV, G * q_len, D]; head h = kv_head * G + g
        qb = q[q0:q1].reshape(q_len, n_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qb = qb.reshape(n_kv_heads, group * q_len, head_dim)
        scores = torch.matmul(qb, k.transpose(1, 2)).to(soft_dtype) * scale  # [H_KV, G*q, L]
        scores = scores.view(n_kv_heads, group, q_len, kv_len)
        visible = block_visibility(anc_bits[q0:q1], q_len)  # [q_len, q_len]
        scores[..., kv_len - q_len :].masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(n_kv_heads, group * q_len, -1)
        ob = torch.matmul(probs, v)  # [H_KV, G * q_len, D]
        ob = ob.view(n_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q0:q1] = ob.reshape(q_len, n_heads, head_dim)
    return out
