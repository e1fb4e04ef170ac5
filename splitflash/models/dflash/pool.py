"""A fixed pool of draft context K/V: the layout that lets a draft step run as one batch.

Unpooled, every request's `LayerKV` is its own tensor, so a draft step calls attention once
per request per layer and its buffers move whenever they grow: nothing a CUDA graph could
replay. A pool holds, per draft layer, one tensor `[slots + 1, cap, H_KV, hd]` (cap = W for a
sliding layer, `context` rows for a full layer): each request owns one slot, its `LayerKV`s
are views of that slot's rows (same ring/slot rules as unpooled), and one kernel call per
layer covers every request through `cache_slots`. Slot 0 is scratch: CUDA-graph padding rows
attend there with an empty context.

A request that finds the pool full gets unpooled state; one whose context outgrows a full
layer's `cap` rows moves that layer to its own buffer. Both keep working, eagerly and per
request; only pooled states are batched and graphed.
"""

from __future__ import annotations

import torch

from splitflash.kernels.draft_attention_ref import context_reads
from splitflash.models.dflash.cache import DFlashState


class DraftKVPool:
    def __init__(self, drafter, slots: int, context: int) -> None:
        """slots: requests held at once; context: rows per slot of a full layer (the longest
        context a pooled request keeps batched)."""
        if slots < 1 or context < 1:
            raise ValueError(f"a draft pool needs slots >= 1 and context >= 1, got {slots}, "
                             f"{context}")  # fmt: skip
        cfg, w = drafter.config, drafter.fc.weight
        self.drafter = drafter
        self.context = context
        self.windows = [p.window for p in drafter.policy]  # None = full layer
        shapes = [(slots + 1, context if win is None else win, cfg.num_key_value_heads,
                   cfg.head_dim) for win in self.windows]  # fmt: skip
        # [slots + 1, cap_l, H_KV, hd] per layer; slot 0 is the padding rows' scratch
        self.k = [torch.zeros(s, dtype=w.dtype, device=w.device) for s in shapes]
        self.v = [torch.zeros(s, dtype=w.dtype, device=w.device) for s in shapes]
        self._free = list(range(slots, 0, -1))  # popped from the end: low slots first
        self.slots = slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def new_state(self) -> DFlashState:
        """A drafter state whose rows live in a free slot (unpooled when none is free)."""
        state = self.drafter.new_state()
        if self._free:
            slot = self._free.pop()
            for li, kv in enumerate(state.layers):
                kv.attach_pool(self.k[li][slot], self.v[li][slot], slot)
            state.pool_slot = slot
        return state

    def release(self, state: DFlashState) -> None:
        """Give the state's slot back (idempotent; unpooled states hold none)."""
        slot, state.pool_slot = state.pool_slot, None
        if slot is not None and slot not in self._free:
            self._free.append(slot)

    def slots_of(self, states) -> list[int] | None:
        """Each state's slot when all are pooled here, else None (draft them per request)."""
        slots = [s.pooled_slot() for s in states]
        return None if any(slot is None for slot in slots) else slots

    def keys_read(self, n_ctx: int) -> list[int]:
        """Context keys each layer reads for a request holding n_ctx tokens."""
        return [context_reads(n_ctx, win) for win in self.windows]
