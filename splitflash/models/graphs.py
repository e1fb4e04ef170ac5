"""CUDA graphs of the target's verify/decode forward at captured batch sizes.

A verify step of a small model is hundreds of tiny kernels: launched one by one from Python
the step costs more in launches than in the bytes it reads. A captured graph replays them all
in one launch. Shapes are frozen at capture, so a step is padded to a graph's shape:

- key = (padded batch B_pad, block length Q, KV bucket, feature layers). Every request of
  the step must have the same block length Q: TargetEngine pads the blocks of a step to
  `padded_block_len` (unjudged anchor copies), so only a block without KV room for it
  leaves a step of mixed lengths, which runs eagerly.
- B real requests fill the first B rows; the B_pad - B padding requests are Q-token dummies
  whose K/V go to the cache's scratch pages (never handed out) and whose outputs are dropped.
- The KV bucket (next power of two of the longest KV) fixes the page-table width and the
  attention kernel's split plan; a longer context moves to the next bucket and a new graph.

Graphs are captured lazily on first use of a key, after an eager warm-up that compiles every
kernel (and autotunes where no measured config exists) outside the capture; the verify
service captures batch-1 keys at start-up, and again for the feature layers a drafter asks
for, between messages (services/verify/warmup.py). They are kept in an
LRU of `max_graphs` and share one memory pool. Their outputs live outside it, one set per
padded row count (B_pad * Q) shared by every graph of that count: a graph's fp32 logits
[B_pad * Q, vocab] would otherwise stay allocated as long as it is held (100 MB at 32 x 16
rows of a 49k vocab, 260 MB for a 128k one), once per KV bucket and feature-layer set,
and only one graph replays at a time. With capture=False (CPU, tests) the same
padded static step runs eagerly: everything but the capture, so the padding is testable
anywhere. Outputs are copied out of the static buffers before returning, so a later replay
never overwrites what a caller holds.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from splitflash.kernels.tuning import kv_bucket, next_pow2
from splitflash.models.attention import MAX_TREE_Q
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.step_inputs import StepHost, buffer_words, pack, views
from splitflash.models.target import ForwardBatch, ForwardOutput, TargetModel

log = logging.getLogger("splitflash.graphs")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


class CaptureStats:
    """Captures made while serving and the seconds they took: each stalls the step that
    needed it (warm-up forwards, autotuning, capture); and graphs dropped from the LRU, each
    a capture again when its key comes back. Services export the deltas."""

    def __init__(self) -> None:
        self.captures = 0
        self.capture_seconds = 0.0
        self._popped = (0, 0.0)
        self.evictions = 0
        self._evictions_popped = 0
        self._side_stream: torch.cuda.Stream | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The one stream every capture's warm-up runs on. A new stream per capture would
        cost a cuBLAS workspace each (torch keeps one per handle and stream, 32 MiB on
        Hopper, never freed): the round robin of torch's stream pool made that up to 32
        workspaces, 1 GiB held by the graph LRU in the end."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        return self._side_stream

    def timed_capture(self, capture, *args):
        t0 = time.perf_counter()
        try:
            return capture(*args)
        finally:
            self.capture_seconds += time.perf_counter() - t0

    def pop_capture_stats(self) -> tuple[int, float]:
        """(captures, seconds) since the last call."""
        n, sec = self.captures - self._popped[0], self.capture_seconds - self._popped[1]
        self._popped = (self.captures, self.capture_seconds)
        return n, sec

    def make_room(self, held: OrderedDict, limit: int, what: str) -> None:
        """Drop the least recently used graphs of `held` until one more fits in `limit`."""
        while len(held) >= limit:
            dropped, _ = held.popitem(last=False)
            self.evictions += 1
            log.info("dropped %s graph %s: %d held (graph_max_held)", what, dropped, limit)

    def pop_evictions(self) -> int:
        """Graphs dropped since the last call."""
        n, self._evictions_popped = self.evictions - self._evictions_popped, self.evictions
        return n


def graphs_summary(graphs) -> str:
    """What a service's Hello (so the gateway's /ready) says of its step graphs: VerifyGraphs
    or DraftGraphs, or None for eager steps."""
    if graphs is None:
        return "off"
    return f"batch sizes {','.join(map(str, graphs.batch_sizes))}, {graphs.max_graphs} kept"


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False, run the static step eagerly
    buf: torch.Tensor  # the static inputs packed (models/step_inputs.py): one copy loads a step
    batch: ForwardBatch  # views of buf: [N_pad] token_ids / positions / slots, meta tensors
    out: ForwardOutput  # static outputs, shared by the graphs of N_pad rows (_shared_out):
    #                     logits [N_pad, V] fp32, hidden [N_pad, F] or None


class VerifyGraphs(CaptureStats):
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
        # A padding request, built once: the slots of positions 0..63 on the scratch pages
        # [64] int64 and the page-table row of those pages [pad_pages] int32.
        self._pad_pages = np.asarray(cache.scratch_page_ids[:pad_pages], dtype=np.int32)
        pos, size = np.arange(MAX_TREE_Q), cache.page_size
        self._pad_slots = self._pad_pages[pos // size].astype(np.int64) * size + pos % size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # The static outputs of every graph of one padded row count: logits by rows,
        # features by (rows, width). Never freed before the graphs (bounded by the counts).
        self._logits_out: dict[int, torch.Tensor] = {}  # rows -> [rows, V] fp32
        self._hidden_out: dict[tuple[int, int], torch.Tensor] = {}  # -> [rows, width]
        self.replays = 0
        super().__init__()
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

    def padded_block_len(self, q_lens: list[int]) -> int | None:
        """The block length every request of a step with these block lengths is padded to
        (TargetEngine): the next power of two of the longest, so steps of mixed lengths
        share one graph and drafters of varying lengths meet a handful of keys. None when no
        graph takes the step anyway (too many requests, a failed capture): no padding."""
        if self.failed or not q_lens or len(q_lens) > self.batch_sizes[-1]:
            return None
        q = next_pow2(max(q_lens))
        return q if q <= MAX_TREE_Q else None

    @torch.inference_mode()
    def run(self, step: StepHost, hidden_layer_ids: tuple[int, ...] = ()) -> ForwardOutput | None:
        """The forward of `step` from a graph, or None if no graph fits it (run eagerly)."""
        shape = None if self.failed else self.key_for(step.q_lens, step.kv_lens)
        if shape is None:
            return None
        key = (*shape, tuple(hidden_layer_ids))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self.timed_capture(self._capture, key, step)
            except Exception:  # a step must never fail because a graph could not be made
                log.exception("CUDA graph capture failed: verify steps run eagerly from now on")
                self.failed = True
                return None
        else:
            self._graphs.move_to_end(key)
            self._load(entry.buf, step, shape)
        if entry.graph is None:
            self.model(entry.batch, self.cache, None, key[3], entry.out)
        else:
            entry.graph.replay()
        self.replays += 1
        n = len(step.token_ids)
        hidden = None if entry.out.hidden is None else entry.out.hidden[:n].clone()
        return ForwardOutput(logits=entry.out.logits[:n].clone(), hidden=hidden)

    # --- static buffers --------------------------------------------------------------
    def _load(self, buf: torch.Tensor, step: StepHost, key: tuple[int, int, int]) -> None:
        """Copy a step into a graph's static buffer, in one copy; padding requests are
        Q-token dummies on the scratch pages (StepHost.padded)."""
        b_pad, _, bucket = key
        padded = step.padded(b_pad, self._pad_slots, self._pad_pages)
        host = pack(padded, self.cache.pages_for(bucket), pin=self.device.type == "cuda")
        buf.copy_(host, non_blocking=True)

    def _shared_out(self, rows: int, n_layers: int) -> ForwardOutput:
        """The static outputs of the graphs of `rows` padded rows (n_layers feature layers)."""
        cfg = self.model.cfg
        if rows not in self._logits_out:
            self._logits_out[rows] = torch.empty(rows, cfg.vocab_size, dtype=torch.float32,
                                                 device=self.device)  # fmt: skip
        hidden = None
        if n_layers:
            width = n_layers * cfg.hidden_size
            if (rows, width) not in self._hidden_out:
                dtype = self.model.embed_tokens.weight.dtype
                self._hidden_out[rows, width] = torch.empty(rows, width, dtype=dtype,
                                                            device=self.device)  # fmt: skip
            hidden = self._hidden_out[rows, width]
        return ForwardOutput(logits=self._logits_out[rows], hidden=hidden)

    def _capture(self, key: tuple, step: StepHost) -> _Captured:
        self.make_room(self._graphs, self.max_graphs, "verify")
        shape, layer_ids = key[:3], key[3]
        b_pad, q, bucket = shape
        width = self.cache.pages_for(bucket)
        buf = torch.zeros(buffer_words(b_pad * q, b_pad, width), dtype=torch.int32,
                          device=self.device)  # fmt: skip
        # The split plan is frozen at capture: planned for the bucket, it covers every
        # length replayed (kv_bound).
        static = views(buf, [q] * b_pad, [bucket] * b_pad, width, kv_bound=bucket)
        self._load(buf, step, shape)
        out = self._shared_out(b_pad * q, len(layer_ids))
        if not self.capture:
            self.captures += 1
            entry = self._graphs[key] = _Captured(None, buf, static, out)
            return entry
        # Warm-up outside the capture: Triton compiles and autotunes here, on a side stream
        # as graph capture requires. It writes the same K/V the replay will (idempotent).
        stream = self.side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(static, self.cache, None, layer_ids, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.model(static, self.cache, None, layer_ids, out)
        entry = _Captured(graph, buf, static, out)
        self._graphs[key] = entry
        self.captures += 1
        log.info("captured verify graph B_pad=%d Q=%d kv_bucket=%d (%d held)", *shape,
                 len(self._graphs))  # fmt: skip
        return entry
