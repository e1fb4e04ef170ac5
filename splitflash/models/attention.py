"""Attention over the paged KV cache, behind one backend interface.

Every forward is a batch of requests, each with q_len new tokens whose K/V were just written
at the end of its sequence. The prefix is always visible in full; only the new block is
masked (causal, or by an ancestor bitmask for token trees). No dense mask over the prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from splitflash.kernels.fused_dispatch import rope_kv_write
from splitflash.kernels.paged_attention_ref import RopeWrite
from splitflash.models.chunk_attention import chunk_attention

log = logging.getLogger("splitflash.attention")

MAX_TREE_Q = 64  # ancestor bitmasks are int64 rows


@dataclass
class AttentionMeta:
    """Batch layout for one forward (B requests, N new tokens in all)."""

    cu_q: torch.Tensor  # [B+1] int32 prefix sums of q_len
    kv_lens: torch.Tensor  # [B] int32 keys per request, new block included
    page_table: torch.Tensor  # [B, max_pages] int32
    anc_bits: torch.Tensor | None  # [N] int64 (tree/chain, q_len <= 64) or None = causal
    q_lens: list[int]
    kv_lens_list: list[int]
    # Upper bound of kv_lens the kernel plans its KV splits for; None = max(kv_lens_list).
    # Host ints, so the kernel never syncs to read kv_lens. A CUDA graph sets its bucket
    # here: the split plan is frozen at capture and must cover every length replayed.
    kv_bound: int | None = None


@lru_cache(maxsize=256)
def _chain_bits(q_lens: tuple[int, ...]) -> np.ndarray:
    i = np.concatenate([np.arange(q, dtype=np.int64) for q in q_lens])
    bits = np.where(i < 63, (np.int64(1) << np.minimum(i + 1, 63)) - 1, -1)
    bits.flags.writeable = False  # shared by every caller of the cache
    return bits


def chain_bits(q_lens: list[int]) -> np.ndarray:
    """Ancestor bits of chains, node i sees nodes 0..i: [N] int64 on the host (read-only,
    cached: a server's steps repeat a few shapes). Node 62's 2**63 - 1 comes out of int64
    wrap-around ((-2**63) - 1); node 63 sees all 64 bits (-1)."""
    return _chain_bits(tuple(q_lens))


def causal_bits(q_lens: list[int], device=None) -> torch.Tensor:
    """chain_bits as a tensor: [N] int64."""
    return torch.tensor(chain_bits(q_lens), dtype=torch.int64, device=device)


def _gather(pages: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """pages [P, S, H_KV, D] -> the first n tokens of one request: [n, H_KV, D]."""
    size = pages.shape[1]
    used = table_row[: -(-n // size)].long()
    return pages.index_select(0, used).reshape(-1, *pages.shape[2:])[:n]


def causal_attention_torch(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMeta, scale
) -> torch.Tensor:
    """Causal attention for long blocks (prefill). q [N, H, D] -> [N, H, D].

    A block longer than 64 only comes from prefill: the whole prompt (no prefix: the causal
    mask is implicit) or one chunk of it after the chunks before (prompt_run.py): then query
    i sits at position kv_len - q_len + i, a bottom-right aligned causal mask
    (models/chunk_attention.py says how it is computed).
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_pages.shape[2]
    # 4-D [1, H, T, D]: torch's fused SDPA kernels (flash, memory-efficient) take 4-D inputs
    # only; given 3-D it falls back to the math kernel, which materialises the [T, T] score
    # matrix per head (measured on the H200: a 32k prompt took 5.4 s, a 185k one asked for
    # 127.5 GiB and ran out of memory).
    for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens_list, strict=True)):
        lo = int(meta.cu_q[b])
        qb = q[lo : lo + q_len].transpose(0, 1)[None]  # [1, H, T, D]
        k = _gather(k_pages, meta.page_table[b], kv_len).transpose(0, 1)  # [H_KV, L, D]
        v = _gather(v_pages, meta.page_table[b], kv_len).transpose(0, 1)
        k = k.repeat_interleave(group, 0).to(q.dtype)[None]  # [1, H, L, D]
        v = v.repeat_interleave(group, 0).to(q.dtype)[None]
        o = chunk_attention(qb, k, v, scale)  # square: the whole prompt, plain causal
        out[lo : lo + q_len] = o[0].transpose(0, 1)
    return out


class PagedAttention:
    """The attention backend: Triton kernels on CUDA, the torch references on CPU."""

    def __init__(self, device: torch.device, batch_invariant: bool = False) -> None:
        from splitflash.kernels.dispatch import paged_attention

        self._block_attention = paged_attention
        # Each row's result independent of its launch (q_len, batch): see TargetModel.
        self.batch_invariant = batch_invariant
        self.name = "triton" if device.type == "cuda" else "torch-reference"
        if batch_invariant and device.type == "cuda":
            self.name += " (batch-invariant)"
        log.info("attention backend: %s (device %s)", self.name, device)

    def __call__(
        self, q, k_pages, v_pages, meta: AttentionMeta, scale: float, rope: RopeWrite | None = None
    ) -> torch.Tensor:
        """rope: q is unrotated and the block's K/V not yet in the pages; RoPE and the write
        happen here (inside the attention kernel on the Triton fast path)."""
        if meta.anc_bits is None and max(meta.q_lens) > MAX_TREE_Q:
            if rope is not None:
                q = rope_kv_write(q, rope.k, rope.v, rope.cos, rope.sin, k_pages, v_pages,
                                  rope.slots)  # fmt: skip
            return causal_attention_torch(q, k_pages, v_pages, meta, scale)
        bits = meta.anc_bits if meta.anc_bits is not None else causal_bits(meta.q_lens, q.device)
        kv_bound = meta.kv_bound if meta.kv_bound is not None else max(meta.kv_lens_list)
        return self._block_attention(
            q, k_pages, v_pages, meta.page_table, meta.kv_lens, meta.cu_q, bits, scale,
            max_kv_len=kv_bound, max_q_len=max(meta.q_lens), invariant=self.batch_invariant,
            rope=rope,
        )  # fmt: skip
