"""A forward's int inputs, built on the host and sent to the device in ONE copy.

A verify step reads seven small int tensors: token ids, positions, KV slots, ancestor bits,
cu_q, KV lengths and the page table. Created one by one on the device they cost seven
synchronous host->device copies: 0.19 ms of host time per step on the H200 (bench/
verify_step, `_batch`), and a graphed step then spent another ~0.15 ms copying them into
the graph's static buffers with a dozen small kernels: 0.34 ms next to a 0.79 ms replay at
512 tokens. Here they are written with numpy into one pinned int32 buffer and copied once;
the tensors the forward reads are views of the device buffer. A CUDA graph's static inputs
are views of its own buffer, so loading a step is one copy too (measured: `verify()` 0.3 ms
faster per step at 185k and at 512, bench/RESULTS.md).

Buffer layout in int32 words (N new tokens, B requests, W page-table width), the int64
parts first so each starts 8-byte aligned:
    token_ids [N] i64 | positions [N] i64 | slots [N] i64 | anc_bits [N] i64 |
    cu_q [B+1] | kv_lens [B] | page_table [B, W]
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from splitflash.models.attention import MAX_TREE_Q, AttentionMeta, chain_bits
from splitflash.models.target import ForwardBatch

_I64_PARTS = 4  # token_ids, positions, slots, anc_bits


@dataclass
class StepHost:
    """One forward's inputs on the host: N new tokens of B requests."""

    token_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slots: np.ndarray  # [N] int64 flat KV slot (page * S + offset) of each new token
    q_lens: list[int]  # [B]
    kv_lens: list[int]  # [B] keys per request, the new block included
    page_rows: list[np.ndarray]  # B int32 rows: the pages holding each request's kv_len keys

    def padded(self, b_pad: int, pad_slots: np.ndarray, pad_pages: np.ndarray) -> StepHost:
        """This step with b_pad - B dummy requests appended, each a block as long as the
        first request's: token 0 at positions 0..q-1, K/V written to pad_slots (scratch
        pages never handed out), its page-table row pad_pages. A graph's padding rows."""
        extra = b_pad - len(self.q_lens)
        if extra <= 0:
            return self
        q = self.q_lens[0]
        pos = np.tile(np.arange(q, dtype=np.int64), extra)
        return StepHost(
            token_ids=np.concatenate([self.token_ids, np.zeros(q * extra, np.int64)]),
            positions=np.concatenate([self.positions, pos]),
            slots=np.concatenate([self.slots, np.tile(pad_slots[:q], extra)]),
            q_lens=self.q_lens + [q] * extra,
            kv_lens=self.kv_lens + [q] * extra,
            page_rows=self.page_rows + [pad_pages] * extra,
        )


def buffer_words(n: int, b: int, width: int) -> int:
    return 2 * _I64_PARTS * n + 2 * b + 1 + b * width


def pack(step: StepHost, width: int, pin: bool) -> torch.Tensor:
    """The step in one host int32 buffer (layout in the module docstring), page rows zero
    padded to `width`; pinned (pin) so the copy to the GPU is one asynchronous DMA. Chains
    (every q_len <= MAX_TREE_Q) get their ancestor bits, longer blocks zeros (causal)."""
    n, b = len(step.token_ids), len(step.q_lens)
    buf = torch.empty(buffer_words(n, b, width), dtype=torch.int32, pin_memory=pin)
    words = buf.numpy()
    i64 = words[: 2 * _I64_PARTS * n].view(np.int64).reshape(_I64_PARTS, n)
    i64[0], i64[1], i64[2] = step.token_ids, step.positions, step.slots
    i64[3] = chain_bits(step.q_lens) if max(step.q_lens) <= MAX_TREE_Q else 0
    at = 2 * _I64_PARTS * n
    words[at : at + b + 1] = [0, *accumulate(step.q_lens)]  # cu_q
    words[at + b + 1 : at + 2 * b + 1] = step.kv_lens
    table = words[at + 2 * b + 1 :].reshape(b, width)
    for r, row in enumerate(step.page_rows):
        if len(row) > width:
            raise ValueError(f"page-table row {r} has {len(row)} pages, the width is {width}")
        table[r, : len(row)] = row
        table[r, len(row) :] = 0  # never read: kv_lens bound every read
    return buf


def views(
    buf: torch.Tensor, q_lens: list[int], kv_lens: list[int], width: int,
    kv_bound: int | None = None,
) -> ForwardBatch:  # fmt: skip
    """The ForwardBatch whose tensors are views of a buffer (on any device) packed for a
    step of these block and KV lengths. kv_bound: see AttentionMeta."""
    n, b = sum(q_lens), len(q_lens)
    i64 = buf[: 2 * _I64_PARTS * n].view(torch.int64).view(_I64_PARTS, n)
    token_ids, positions, slots, anc_bits = i64  # each [N]
    cu_q, kv_lens_t, table = buf[2 * _I64_PARTS * n :].split([b + 1, b, b * width])
    meta = AttentionMeta(
        cu_q=cu_q,  # [B+1]
        kv_lens=kv_lens_t,  # [B]
        page_table=table.view(b, width),
        anc_bits=anc_bits if max(q_lens) <= MAX_TREE_Q else None,
        q_lens=list(q_lens),
        kv_lens_list=list(kv_lens),
        kv_bound=kv_bound,
    )
    return ForwardBatch(token_ids=token_ids, positions=positions, slots=slots, meta=meta)


def upload(step: StepHost, device: torch.device) -> ForwardBatch:
    """The step on `device` in one copy (none on CPU), page table as wide as its widest row."""
    width = max([len(row) for row in step.page_rows] + [1])
    cuda = device.type == "cuda"
    buf = pack(step, width, pin=cuda)
    # From pinned memory the copy is asynchronous; the caching host allocator keeps the
    # pinned block from reuse until the copy has run.
    dev_buf = buf.to(device, non_blocking=True) if cuda else buf
    return views(dev_buf, step.q_lens, step.kv_lens, width)
