"""CUDA graphs of the DFlash draft step at captured batch sizes.

A draft step of a small drafter is a few dozen tiny kernels: launched from Python it costs
several milliseconds of launches for microseconds of work. With every request's context in
a `DraftKVPool` (fixed addresses, one attention call per layer), the whole step
(`DFlashDrafter.forward_block`) is captured once per shape and replayed in one launch:

- key = (padded batch N_pad, block length T, context bucket). N real requests fill the first
  rows; padding rows draft a block of MASK tokens at position 0 against the pool's scratch
  slot 0 with an empty context, and their logits are dropped.
- The context bucket (next power of two of the longest context, capped at the pool's rows)
  fixes the attention kernel's split plan; a longer context moves to the next bucket.
- Requests not all in the pool, more requests than the largest graph, or a custom attention
  backend: the step runs eagerly (`draft_batch`). So does every step after a failed capture
  (logged; counted by the caller through `failed`).

As in `splitflash.models.graphs` (the verify step's graphs), a capture follows two eager
warm-ups on a side stream (Triton compiles and autotunes there), graphs share one memory
pool and live in an LRU, capture=False runs the same padded static step eagerly (CPU tests),
and outputs are copied out of the static buffers before they are returned.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitflash.kernels.tuning import kv_bucket
from splitflash.models.dflash.cache import DFlashState
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.models.graphs import DEFAULT_BATCH_SIZES

log = logging.getLogger("splitflash.graphs")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False, run the static step eagerly
    buf: torch.Tensor  # int32 words, the four inputs below packed (_pack): one copy per step
    ids: torch.Tensor  # [N_pad, T] long: anchor + MASK tokens (a view of buf)
    pos: torch.Tensor  # [N_pad, T] long: absolute positions (a view of buf)
    slots: torch.Tensor  # [N_pad] int32: pool slot per row (0 = scratch for padding)
    n_ctx: torch.Tensor  # [N_pad] int32: context tokens per row
    out: torch.Tensor | None  # [N_pad, T-1, V] logits of the last replay


def _pack(ids, pos, slots, n_ctx, n_pad: int, mask_id: int, pin: bool) -> torch.Tensor:
    """A step's inputs in one host int32 buffer, so loading it is one (asynchronous, when
    pinned) copy instead of four pageable ones and four padding fills (the verify step's
    version: models/step_inputs.py). Layout in int32 words, the int64 parts first:
        ids [N_pad, T] i64 | pos [N_pad, T] i64 | slots [N_pad] | n_ctx [N_pad]
    Rows past the N real ones are padding: [MASK x T] at positions 0..T-1, scratch slot 0,
    no context."""
    n, t = ids.shape
    buf = torch.empty(4 * n_pad * t + 2 * n_pad, dtype=torch.int32, pin_memory=pin)
    words = buf.numpy()
    i64 = words[: 4 * n_pad * t].view(np.int64).reshape(2, n_pad, t)
    i64[0, :n], i64[1, :n] = ids.numpy(), pos.numpy()
    i64[0, n:], i64[1, n:] = mask_id, np.arange(t)
    small = words[4 * n_pad * t :].reshape(2, n_pad)
    small[0, :n], small[1, :n] = slots, n_ctx
    small[:, n:] = 0
    return buf


def _views(buf: torch.Tensor, n_pad: int, t: int) -> tuple[torch.Tensor, ...]:
    """(ids, pos, slots, n_ctx) as views of a buffer laid out by _pack (on any device)."""
    ids, pos = buf[: 4 * n_pad * t].view(torch.int64).view(2, n_pad, t)
    slots, n_ctx = buf[4 * n_pad * t :].view(2, n_pad)
    return ids, pos, slots, n_ctx


class DraftGraphs:
    """Replays DFlashDrafter.forward_block from CUDA graphs for pooled requests."""

    def __init__(
        self,
        drafter,
        pool: DraftKVPool,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_graphs: int = 24,
        capture: bool = True,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        self.drafter, self.pool = drafter, pool
        self.device = drafter.fc.weight.device
        if any(d != self.device for d in drafter.shared_devices):
            # A cross-device hop inside the step is a host sync, which a capture cannot hold.
            raise ValueError(
                f"draft graphs need the target's embedding and LM head on the drafter's device "
                f"{self.device}, got {[str(d) for d in drafter.shared_devices]}"
            )
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_graphs = max_graphs
        self.capture = capture
        self._graphs: OrderedDict[tuple[int, int, int], _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.captures = 0
        self.failed = False  # a capture raised once: eager from then on (logged)

    def key_for(self, n: int, t: int, n_ctx: Sequence[int]) -> tuple[int, int, int] | None:
        """(N_pad, T, context bucket) of a step, or None when it must run eagerly."""
        n_pad = next((b for b in self.batch_sizes if b >= n), None)
        if n_pad is None:
            return None
        return n_pad, t, min(kv_bucket(max(n_ctx)), self.pool.context)

    @torch.no_grad()
    def run(
        self,
        states: Sequence[DFlashState],
        anchor_token_ids: Sequence[int],
        anchor_positions: Sequence[int],
        block_size: int | None = None,
    ) -> torch.Tensor | None:
        """Logits [N, T-1, V] of one draft step from a graph (draft_batch's contract), or None
        when no graph fits it: the caller then runs draft_batch eagerly."""
        drafter = self.drafter
        t = drafter.check_batch(states, anchor_token_ids, anchor_positions, block_size)
        slots = self.pool.slots_of(states)
        if self.failed or slots is None or not drafter.poolable:
            return None
        n_ctx = [s.n_ctx for s in states]
        key = self.key_for(len(states), t, n_ctx)
        if key is None:
            return None
        ids, pos = drafter.block_inputs(anchor_token_ids, anchor_positions, t)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, ids, pos, slots, n_ctx)
            except Exception:  # a draft must never fail because a graph could not be made
                log.exception("draft CUDA graph capture failed: drafting runs eagerly from now on")
                self.failed = True
                return None
        else:
            self._graphs.move_to_end(key)
            self._load(entry, ids, pos, slots, n_ctx)
        if entry.graph is None:
            entry.out = self._forward(entry, key[2])
        else:
            entry.graph.replay()
        self.replays += 1
        for state, n in zip(states, n_ctx, strict=True):
            state.keys_read_last = self.pool.keys_read(n)
        return entry.out[: len(states)].clone()

    def _forward(self, entry: _Captured, bucket: int) -> torch.Tensor:
        attend = self.drafter.pooled_attention(self.pool, entry.slots, entry.n_ctx, bucket)
        if attend is None:
            raise ValueError("draft graphs need the torch or Triton attention backend")
        return self.drafter.forward_block(entry.ids, entry.pos, attend)

    def _load(self, entry: _Captured, ids, pos, slots, n_ctx) -> None:
        """Copy a step into the static buffers in one copy; padding rows on the scratch slot.
        From pinned memory the copy is asynchronous; the caching host allocator keeps the
        pinned block from reuse until it has run."""
        cuda = self.device.type == "cuda"
        mask_id = self.drafter.config.mask_token_id
        host = _pack(ids, pos, slots, n_ctx, entry.ids.shape[0], mask_id, pin=cuda)
        entry.buf.copy_(host, non_blocking=cuda)

    def _capture(self, key, ids, pos, slots, n_ctx) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        n_pad, t, bucket = key
        dev = self.device
        buf = torch.empty(4 * n_pad * t + 2 * n_pad, dtype=torch.int32, device=dev)
        entry = _Captured(None, buf, *_views(buf, n_pad, t), out=None)
        self._load(entry, ids, pos, slots, n_ctx)
        if self.capture:
            # Warm-up outside the capture (compiles, autotunes), on a side stream as capture
            # requires. Drafting only reads the pool: replaying it twice changes nothing.
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(entry, bucket)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.out = self._forward(entry, bucket)
            entry.graph = graph
            log.info("captured draft graph N_pad=%d T=%d ctx_bucket=%d (%d held)", *key,
                     len(self._graphs) + 1)  # fmt: skip
        self._graphs[key] = entry
        self.captures += 1
        return entry
