"""CUDA graphs of the DFlash draft step at captured batch sizes.

A draft step of a small drafter is a few dozen tiny kernels: launched from Python it costs
several milliseconds of launches for microseconds of work. With every request's context in
a `DraftKVPool` (fixed addresses, one attention call per layer), the whole step
(`DFlashDrafter.forward_block`) is captured once per shape and replayed in one launch:

- key = (padded batch N_pad, block length T, context bucket). N real requests fill the first
  rows; padding rows draft a block of MASK tokens at position 0 against the pool's scratch
  slot 0 with an empty context, and their logits are dropped.
- The step first writes the context rows the last verify step committed (at most R = the
  drafter's block size per request): `DFlashDrafter.context_kv` over N_pad x R static rows,
  then one index_copy per layer into the pool. Eager, those ~75 small ops cost ~1.2 ms per
  step on the H200 (bench/RESULTS.md, context_append), several times the graph's replay.
  Rows a request did not commit, and padding requests' rows, go to scratch slot 0.
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

import torch

from splitflash.kernels.tuning import kv_bucket
from splitflash.models.dflash.cache import DFlashState
from splitflash.models.dflash.checks import check_appends, check_batch
from splitflash.models.dflash.graph_inputs import StepInputs, append_rows, pack, views, words
from splitflash.models.dflash.model import joined_rows
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.models.graphs import DEFAULT_BATCH_SIZES, CaptureStats

DEFAULT_MAX_GRAPHS = 24  # DraftSettings.graph_max_held's default, for callers without one

log = logging.getLogger("splitflash.graphs")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False, run the static step eagerly
    buf: torch.Tensor  # int32 words, the inputs below packed (graph_inputs.pack): one copy
    ids: torch.Tensor  # [N_pad, T] long: anchor + MASK tokens (a view of buf)
    pos: torch.Tensor  # [N_pad, T] long: absolute positions (a view of buf)
    app_pos: torch.Tensor  # [N_pad * R] long: positions of the context rows to write
    app_dest: torch.Tensor  # [L, N_pad * R] long: their flat pool row per layer
    slots: torch.Tensor  # [N_pad] int32: pool slot per row (0 = scratch for padding)
    n_ctx: torch.Tensor  # [N_pad] int32: context tokens per row, the new rows included
    app_feats: torch.Tensor  # [N_pad * R, K*D] the context rows' target features
    out: torch.Tensor  # [N_pad, T-1, V] logits of the last replay, shared by the graphs of
    #                    one (N_pad, T) (_shared_out)


class DraftGraphs(CaptureStats):
    """Replays DFlashDrafter.forward_block from CUDA graphs for pooled requests."""

    def __init__(
        self,
        drafter,
        pool: DraftKVPool,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
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
        # The logits of every graph of one (N_pad, T), outside the pool: one replays at a time
        # and its logits are copied out, so the context buckets need no copy each.
        self._logits_out: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0
        super().__init__()
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
        appends: Sequence[tuple[torch.Tensor, int] | None] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | None:
        """Logits [N, T-1, V] of one draft step from a graph (draft_batch's contract), or None
        when no graph fits it: the caller then writes the appends and runs draft_batch
        eagerly (nothing was written). appends[i] = (features [n_i, K*D], start_pos) of
        state i's context rows not yet in its cache (n_i <= the block size), or None; the
        graph writes them before drafting, and the anchors follow them. greedy: the logits'
        argmax [N, T-1] instead, read from the static logits (no copy of them is made)."""
        drafter = self.drafter
        appends = list(appends) if appends is not None else [None] * len(states)
        if len(appends) != len(states):
            raise ValueError("draft graphs: one append (or None) per state")
        counts = [0 if a is None else int(a[0].shape[0]) for a in appends]
        starts = [s.n_ctx if a is None else int(a[1]) for s, a in zip(states, appends, strict=True)]
        items = [(s, a[0], a[1]) for s, a in zip(states, appends, strict=True) if a is not None]
        check_appends(drafter, items)
        n_ctx = [s.n_ctx + n for s, n in zip(states, counts, strict=True)]
        t = check_batch(drafter, states, anchor_token_ids, anchor_positions, block_size, n_ctx)
        slots = self.pool.slots_of(states)
        if self.failed or slots is None or not drafter.poolable:
            return None
        key = self.key_for(len(states), t, n_ctx)
        if key is None:
            return None
        rows = drafter.config.block_size
        planned = append_rows(self.pool, slots, starts, counts, key[0], rows)
        if planned is None:
            return None
        app_pos, app_dest, feat_rows = planned
        feats = [a[0] for a in appends if a is not None]
        step = StepInputs(
            [int(a) for a in anchor_token_ids], [int(p) for p in anchor_positions], t,
            slots, n_ctx, app_pos, app_dest,
            app_rows=torch.from_numpy(feat_rows) if feats else None,
            app_feats=joined_rows(feats, self.device) if feats else None,
        )  # fmt: skip
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self.timed_capture(self._capture, key, step)
            except Exception:  # a draft must never fail because a graph could not be made
                log.exception("draft CUDA graph capture failed: drafting runs eagerly from now on")
                self.failed = True
                return None
        else:
            self._graphs.move_to_end(key)
            self._load(entry, step)
        if entry.graph is None:
            self._forward(entry, key[2])
        else:
            entry.graph.replay()
        self.replays += 1
        for state, n in zip(states, n_ctx, strict=True):
            state.n_ctx = n  # the rows are in the pool now
            state.keys_read_last = self.pool.keys_read(n)
        logits = entry.out[: len(states)]  # the next replay overwrites these: copy or reduce
        return logits.argmax(-1) if greedy else logits.clone()

    def _forward(self, entry: _Captured, bucket: int) -> torch.Tensor:
        """The captured step: the context rows into the pool, then the block."""
        drafter, pool = self.drafter, self.pool
        kv = drafter.context_kv(entry.app_feats, entry.app_pos)
        for li, (k, v) in enumerate(kv):  # k, v [N_pad * R, H_KV, hd]
            pool.k[li].view(-1, *k.shape[1:]).index_copy_(0, entry.app_dest[li], k)
            pool.v[li].view(-1, *v.shape[1:]).index_copy_(0, entry.app_dest[li], v)
        attend = drafter.pooled_attention(pool, entry.slots, entry.n_ctx, bucket)
        if attend is None:
            raise ValueError("draft graphs need the torch or Triton attention backend")
        return drafter.forward_block(entry.ids, entry.pos, attend, entry.out)

    def _shared_out(self, n_pad: int, t: int) -> torch.Tensor:
        """The logits [n_pad, t - 1, V] every graph of (n_pad, t) writes."""
        if (n_pad, t) not in self._logits_out:
            head = self.drafter.lm_head_weight  # [V, D]
            shape = (n_pad, t - 1, head.shape[0])
            self._logits_out[n_pad, t] = head.new_empty(shape)
        return self._logits_out[n_pad, t]

    def _load(self, entry: _Captured, step: StepInputs) -> None:
        """Copy a step into the static buffers: the ints in one copy (asynchronous from
        pinned memory; the caching host allocator keeps the block from reuse until it has
        run), the context rows' features into their static rows."""
        cuda = self.device.type == "cuda"
        n_pad, rows = entry.ids.shape[0], self.drafter.config.block_size
        host = pack(step, n_pad, rows, self.drafter.config.mask_token_id, pin=cuda)
        entry.buf.copy_(host, non_blocking=cuda)
        if step.app_feats is not None:
            rows_host = step.app_rows.pin_memory() if cuda else step.app_rows  # async copy
            dest = rows_host.to(self.device, non_blocking=cuda)
            entry.app_feats.index_copy_(0, dest, step.app_feats.to(entry.app_feats.dtype))

    def _capture(self, key, step: StepInputs) -> _Captured:
        self.make_room(self._graphs, self.max_graphs, "draft")
        n_pad, t, bucket = key
        dev, cfg = self.device, self.drafter.config
        rows, n_layers = cfg.block_size, len(self.pool.k)
        n64, n32 = words(n_pad, t, rows, n_layers)
        buf = torch.zeros(2 * n64 + n32, dtype=torch.int32, device=dev)
        feats = torch.zeros(n_pad * rows, cfg.feature_dim, dtype=self.drafter.fc.weight.dtype,
                            device=dev)  # fmt: skip
        entry = _Captured(None, buf, *views(buf, n_pad, t, rows, n_layers), feats,
                          out=self._shared_out(n_pad, t))  # fmt: skip
        self._load(entry, step)
        if self.capture:
            # Warm-up outside the capture (compiles, autotunes), on a side stream as capture
            # requires. Besides reading the pool, a step writes the same context rows each
            # time: replaying it twice changes nothing.
            stream = self.side_stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(entry, bucket)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(entry, bucket)
            entry.graph = graph
            log.info("captured draft graph N_pad=%d T=%d ctx_bucket=%d (%d held)", *key,
                     len(self._graphs) + 1)  # fmt: skip
        self._graphs[key] = entry
        self.captures += 1
        return entry
