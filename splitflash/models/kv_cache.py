"""Paged KV cache: a pool of fixed-size pages shared by all requests, one page table each.

Pages hold S tokens of K and V for every layer. A request owns a list of page ids and a
length; appending reserves pages, rolling back drops the KV of rejected positions and returns
pages no longer needed. Freed pages go back on a stack so that a roll back restores exactly
the earlier allocator state (the next append gets the same pages again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class KVPoolFullError(RuntimeError):
    """The pool has fewer free pages than an append needs."""


class UnknownSequenceError(KeyError):
    pass


@dataclass
class SequenceKV:
    pages: list[int] = field(default_factory=list)  # change only through the cache's methods
    length: int = 0  # tokens whose K/V are stored
    # int32 copy of `pages` (the first len(pages) entries are valid), grown by doubling, so a
    # step's page table is a memcpy: converting the whole list every step cost ~1 ms of host
    # time per 185k-token request (O(context) work in an O(block) step). numpy, not torch:
    # a scalar write is 0.1 us instead of 4, and every step writes one or two.
    page_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))

    def append_pages(self, new: list[int]) -> None:
        n = len(self.pages)
        if n + len(new) > len(self.page_ids):
            grown = np.empty(max(2 * len(self.page_ids), n + len(new), 16), dtype=np.int32)
            grown[:n] = self.page_ids[:n]
            self.page_ids = grown
        self.page_ids[n : n + len(new)] = new
        self.pages.extend(new)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        scratch_pages: int = 0,
    ) -> None:
        if num_pages < 1 or page_size < 1 or scratch_pages < 0:
            raise ValueError(
                f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1, "
                f"scratch_pages ({scratch_pages}) >= 0"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        # Scratch pages sit past the pool and are never handed out: CUDA-graph padding rows
        # write their K/V there, so padding never costs a request a page or shows as used.
        self.scratch_page_ids = list(range(num_pages, num_pages + scratch_pages))
        # Stored head-major inside a page ([L, P, H_KV, S, D]): one KV head's keys of a page
        # are one contiguous run of S*D elements, so attention (one program per KV head)
        # streams 2 KiB runs instead of D-element rows strided by H_KV*D. Measured on the
        # H200 at SmolLM2's 3 KV heads of 64: 128-byte rows reached 0.69 of copy bandwidth
        # (bench/RESULTS.md). k / v are [L, P, S, H_KV, D] views: kernels take strides.
        shape = (num_layers, num_pages + scratch_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
        self.v = torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
        # Stack of free pages, popped from the end: low ids first for a fresh pool.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.seqs: dict[str, SequenceKV] = {}

    # --- allocator -------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def add(self, seq_id: str) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has KV")
        self.seqs[seq_id] = SequenceKV()

    def seq(self, seq_id: str) -> SequenceKV:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"no KV for request {seq_id!r}") from None

    def can_reserve(self, needs: dict[str, int]) -> bool:
        """Whether every sequence in `needs` can grow to its new length at once."""
        extra = sum(max(0, self.pages_for(n) - len(self.seq(s).pages)) for s, n in needs.items())
        return extra <= len(self._free)

    def reserve(self, seq_id: str, new_length: int) -> None:
        """Make room for `new_length` tokens (the caller then writes and sets the length)."""
        seq = self.seq(seq_id)
        need = self.pages_for(new_length) - len(seq.pages)
        if need > len(self._free):
            raise KVPoolFullError(
                f"KV pool full: request {seq_id!r} needs {need} more page(s) of "
                f"{self.page_size} tokens, {len(self._free)} of {self.num_pages} free "
                "(raise the page count, e.g. SPLITFLASH_VERIFY_KV_PAGES, or lower the load)"
            )
        if need > 0:
            seq.append_pages([self._free.pop() for _ in range(need)])

    def truncate(self, seq_id: str, new_length: int) -> None:
        """Roll back: forget tokens past `new_length` and return pages no longer needed."""
        seq = self.seq(seq_id)
        if not 0 <= new_length <= max(seq.length, self.page_size * len(seq.pages)):
            raise ValueError(f"cannot truncate {seq_id!r} of length {seq.length} to {new_length}")
        keep = self.pages_for(new_length)
        while len(seq.pages) > keep:
            self._free.append(seq.pages.pop())
        seq.length = min(seq.length, new_length)

    def free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            while seq.pages:
                self._free.append(seq.pages.pop())

    # --- tensors ---------------------------------------------------------------------
    def slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (page * S + offset) of positions [start, end): [end - start].
        Reads only the pages of that range: O(end - start), whatever the context."""
        first = start // self.page_size
        pages = self._page_ids(seq_id)[first : -(-end // self.page_size)].long()
        pos = torch.arange(start, end) - first * self.page_size
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def page_table(self, seq_ids: list[str], device=None) -> torch.Tensor:
        """[B, max_pages] int32, padded with 0 (never read: kv_lens bound the reads)."""
        seqs = [self.seq(s) for s in seq_ids]
        width = max([len(s.pages) for s in seqs] + [1])
        table = torch.zeros((len(seqs), width), dtype=torch.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.pages)] = torch.from_numpy(seq.page_ids[: len(seq.pages)])
        return table.to(device or self.k.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, H_KV, D] written at flat slots [N]."""
        page, slot = slots // self.page_size, slots % self.page_size
        self.k[layer][page, slot] = k.to(self.k.dtype)
        self.v[layer][page, slot] = v.to(self.v.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [N, H_KV, D] at flat slots [N] (copies)."""
        page, slot = slots // self.page_size, slots % self.page_size
        return self.k[layer][page, slot], self.v[layer][page, slot]

    def move(self, seq_id: str, src_positions: list[int], dst_start: int) -> None:
        """Copy the K/V of `src_positions` to consecutive positions from `dst_start`, every
        layer (tree verification keeps the accepted path, compacted in depth order)."""
        if not src_positions:
            return
        src = self.slots_of(seq_id, src_positions)
        dst = self.slots(seq_id, dst_start, dst_start + len(src_positions))
        src_page, src_slot = src // self.page_size, src % self.page_size
        dst_page, dst_slot = dst // self.page_size, dst % self.page_size
        for cache in (self.k, self.v):  # [L, P, S, H_KV, D]
            cache[:, dst_page, dst_slot] = cache[:, src_page, src_slot].clone()

    def slots_of(self, seq_id: str, positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long)
        pages = self._page_ids(seq_id)[pos // self.page_size].long()
        return pages * self.page_size + pos % self.page_size

    def _page_ids(self, seq_id: str) -> torch.Tensor:
        """[len(pages)] int32 view of a sequence's page ids (indexing past it raises)."""
        seq = self.seq(seq_id)
        return torch.from_numpy(seq.page_ids[: len(seq.pages)])
