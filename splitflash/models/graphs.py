"""CUDA graphs of the target's verify/decode forward at captured batch sizes.

A verify step of a small model is hundreds of tiny kernels: launched one by one from Python
the step costs more in launches than in the bytes it reads. A captured graph replays them all
in one launch. Shapes are frozen at capture, so a step is padded to a graph's shape:

- key = (padded batch B_pad, block length Q, KV bucket, feature layers). Every request of
  the step must have the same block length Q (the steady state: B-1 drafts each, or 1 token
  each when the drafter is down); mixed lengths run eagerly.
- B real requests fill the first B rows; the B_pad - B padding requests are Q-token dummies
  whose K/V go to the cache's scratch pages (never handed out) and whose outputs are dropped.
- The KV bucket (next power of two of the longest KV) fixes the page-table width and the
  attention kernel's split plan; a longer context moves to the next bucket and a new graph.

Graphs are captured lazily on first use of a key (after an eager warm-up that compiles and
autotunes every kernel outside the capture) and kept in an LRU of `max_graphs`; all share one
memory pool. With capture=False (CPU, tests) the same padded static step runs eagerly:
everything but the capture, so the padding is testable anywhere. Outputs are copied out of
the static buffers before returning, so a later replay never overwrites what a caller holds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from splitflash.kernels.tuning import kv_bucket
from splitflash.models.attention import MAX_TREE_Q, AttentionMeta, causal_bits
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import ForwardBatch, ForwardOutput, TargetModel

log = logging.getLogger("splitflash.graphs")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False, run the static step eagerly
    batch: ForwardBatch  # static inputs: [N_pad] token_ids / positions / slots, meta tensors
    out: ForwardOutput  # static outputs: logits [N_pad, V], hidden [N_pad, F] or None


class VerifyGraphs:
    """Replays TargetModel.forward from CUDA graphs for uniform blocks (see module doc)."""

    def __init__(
        self,
        model: TargetModel,
        cache: PagedKVCache,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        max_graphs: int = 48,
        capture: bool = True,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        pad_pages = cache.pages_for(MAX_TREE_Q)
        if len(cache.scratch_page_ids) < pad_pages:
            raise ValueError(
                f"CUDA graphs need {pad_pages} scratch pages in the KV cache for padding rows, "
                f"the cache has {len(cache.scratch_page_ids)} (PagedKVCache(scratch_pages=...))"
            )
        self.model, self.cache = model, cache
        self.device = model.embed_tokens.weight.device
        # A padding request, built once: positions 0..63 [64], their slots [64] on the scratch
        # pages, and the page-table row of those pages [pad_pages] int32.
        pages = torch.tensor(cache.scratch_page_ids[:pad_pages], device=self.device)
        self._pad_positions = torch.arange(MAX_TREE_Q, device=self.device)
        self._pad_slots = (
            pages[self._pad_positions // cache.page_size] * cache.page_size
            + self._pad_positions % cache.page_size
        )
        self._pad_pages = pages.to(torch.int32)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.captures = 0
        self.failed = False  # a capture raised once: eager from then on (logged)

    def key_for(self, q_lens: list[int], kv_lens: list[int]) -> tuple[int, int, int] | None:
        """(B_pad, Q, KV bucket) of a step, or None when it must run eagerly."""
        q = q_lens[0]
        if any(n != q for n in q_lens) or not 1 <= q <= MAX_TREE_Q:
            return None
        b_pad = next((b for b in self.batch_sizes if b >= len(q_lens)), None)
        if b_pad is None:
            return None
        return b_pad, q, kv_bucket(max(kv_lens))

    @torch.inference_mode()
    def run(
        self, batch: ForwardBatch, hidden_layer_ids: tuple[int, ...] = ()
    ) -> ForwardOutput | None:
        """The forward of `batch` from a graph, or None if no graph fits it (run eagerly)."""
        meta = batch.meta
        shape = None if self.failed else self.key_for(meta.q_lens, meta.kv_lens_list)
        if shape is None:
            return None
        key = (*shape, tuple(hidden_layer_ids))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, batch)
            except Exception:  # a step must never fail because a graph could not be made
                log.exception("CUDA graph capture failed: verify steps run eagerly from now on")
                self.failed = True
                return None
        else:
            self._graphs.move_to_end(key)
            self._load(entry.batch, batch, shape)
        if entry.graph is None:
            entry.out = self.model(entry.batch, self.cache, None, key[3])
        else:
            entry.graph.replay()
        self.replays += 1
        n = len(batch.token_ids)
        hidden = None if entry.out.hidden is None else entry.out.hidden[:n].clone()
        return ForwardOutput(logits=entry.out.logits[:n].clone(), hidden=hidden)

    # --- static buffers --------------------------------------------------------------
    def _static_batch(self, key: tuple[int, int, int]) -> ForwardBatch:
        b_pad, q, bucket = key
        dev, n_pad = self.device, b_pad * q
        width = self.cache.pages_for(bucket)
        meta = AttentionMeta(
            cu_q=torch.arange(0, n_pad + 1, q, dtype=torch.int32, device=dev),  # [B_pad+1]
            kv_lens=torch.full((b_pad,), q, dtype=torch.int32, device=dev),  # [B_pad]
            page_table=torch.zeros((b_pad, width), dtype=torch.int32, device=dev),
            anc_bits=causal_bits([q] * b_pad, dev),  # [N_pad] chains, fixed for the graph
            q_lens=[q] * b_pad,
            kv_lens_list=[bucket] * b_pad,
            kv_bound=bucket,
        )
        return ForwardBatch(
            token_ids=torch.zeros(n_pad, dtype=torch.long, device=dev),
            positions=torch.zeros(n_pad, dtype=torch.long, device=dev),
            slots=torch.zeros(n_pad, dtype=torch.long, device=dev),
            meta=meta,
        )

    def _load(self, static: ForwardBatch, batch: ForwardBatch, key: tuple[int, int, int]):
        """Copy a step into the static buffers; padding rows point at the scratch pages."""
        b_pad, q, _ = key
        b, n = len(batch.meta.q_lens), len(batch.token_ids)
        sm, m = static.meta, batch.meta
        static.token_ids[:n].copy_(batch.token_ids)
        static.positions[:n].copy_(batch.positions)
        static.slots[:n].copy_(batch.slots)
        sm.kv_lens[:b].copy_(m.kv_lens)
        sm.page_table[:b].zero_()
        sm.page_table[:b, : m.page_table.shape[1]].copy_(m.page_table)
        if b < b_pad:  # dummies: Q tokens at positions 0..Q-1 on the scratch pages
            static.token_ids[n:].zero_()
            static.positions[n:].copy_(self._pad_positions[:q].repeat(b_pad - b))
            static.slots[n:].copy_(self._pad_slots[:q].repeat(b_pad - b))
            sm.kv_lens[b:].fill_(q)
            sm.page_table[b:, : len(self._pad_pages)].copy_(self._pad_pages)

    def _capture(self, key: tuple, batch: ForwardBatch) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        shape, layer_ids = key[:3], key[3]
        static = self._static_batch(shape)
        self._load(static, batch, shape)
        if not self.capture:
            self.captures += 1
            entry = self._graphs[key] = _Captured(None, static, ForwardOutput(None, None))
            return entry
        # Warm-up outside the capture: Triton compiles and autotunes here, on a side stream
        # as graph capture requires. It writes the same K/V the replay will (idempotent).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(static, self.cache, None, layer_ids)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(static, self.cache, None, layer_ids)
        entry = _Captured(graph, static, out)
        self._graphs[key] = entry
        self.captures += 1
        log.info("captured verify graph B_pad=%d Q=%d kv_bucket=%d (%d held)", *shape,
                 len(self._graphs))  # fmt: skip
        return entry
