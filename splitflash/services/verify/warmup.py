"""Start-up warm-up of the verify engine: the kernels compile before the first request does.

A process's first forward of a shape compiles its Triton kernels, and the first step of a
CUDA-graph key captures the graph. Measured on an H100 (`python -m bench.first_step`,
bench/RESULTS.md "Session 24"): a process's first verify step took 0.9-1.2 s, and 7.6-14 s
while Hopper launches still autotuned. Without a warm-up the first request pays that. Here
a throwaway request runs one step at each warm-up context and block length: the kernels
compile, and batch-1 graphs of the engine's feature layers (none before a drafter asks for
some) are captured. It runs through the engine's own step path, on pages the cache hands
out and takes back. Captures made here are logged, not counted: the metrics count captures
made while serving.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from splitflash.models.chunk_attention import aligned_chunk_starts, prebuild
from splitflash.models.step_inputs import upload
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.sampling import Sampling

log = logging.getLogger(__name__)

# Below one KV split, across a few and at the most a batch-1 launch plans (tuning.py: 128
# keys a split, up to ~2 programs per SM, 88 splits for the default model on 132 SMs): the
# kernels specialise on a single split, and the split combine on the split count's power of
# two. Without the third, the first step past ~11k keys compiled the combine: 263 ms on the
# H200 (bench/RESULTS.md "Session 24"). Block lengths: decode, a short block and a full
# DFlash block (16). Triton specialises integer arguments on == 1 and divisibility by 16, so
# any length in 2..15 compiles the short-block kernels; 8 is one a graphed step has (blocks
# are padded to a power of two: VerifyGraphs.padded_block_len), so its graph is used too.
WARM_CONTEXTS = (300, 3000, 20000)
WARM_Q_LENS = (1, 8, 16)
# The prefill path: a throwaway prompt of one whole chunk and PREFILL_TAIL tokens more runs
# the whole-prompt attention, a chunk's attention after cached keys and the long-block
# kernels once, so they compile and initialise (FlashAttention, cuDNN) before the first
# prompt. Then the cuDNN graphs of the shapes every long prompt in chunks meets are built
# (chunk_attention.prebuild), for PREBUILD_MAX_S at most. An H100 without this: the first
# call of cuDNN in a process ~1.3 s, each new shape 44-60 ms (bench/RESULTS.md "Session 36").
PREFILL_TAIL = 300
PREBUILD_MAX_S = 30.0


def warm_up(
    engine: TargetEngine,
    contexts: tuple[int, ...] = WARM_CONTEXTS,
    q_lens: tuple[int, ...] = WARM_Q_LENS,
    prefill: bool = True,
) -> float:
    """Run one step per (context, q_len) on a throwaway request, then (prefill) the prefill
    warm-up; returns the seconds taken. Contexts the engine or its KV pool cannot hold are
    left out. The engine's requests and KV pool are as they were afterwards."""
    t0 = time.perf_counter()
    shapes = [(c, q) for c in contexts for q in q_lens if c + q <= _room(engine)]
    _run_shapes(engine, shapes, t0)
    if engine.graphs is not None:
        n, seconds = engine.graphs.pop_capture_stats()
        log.info("warm-up captured %d verify graphs in %.1f s", n, seconds)
    if prefill:
        try:
            warm_prefill(engine)
        except Exception:  # e.g. out of memory beside a large KV pool: serve without it
            log.exception("prefill warm-up failed; the first prompts pay its costs instead")
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0


class IdleWarmUp:
    """The warm-up again for feature layers a drafter asked for after start-up, one shape
    per call, called by the server only while no message waits. The start-up warm-up
    captured graphs without feature layers; a DFlash drafter's layers are part of every
    graph key, so without this each of its first steps at a new key captured one (about
    50 ms on the H200, bench/RESULTS.md "Session 24"), inside a client's request. Run in one
    go inside the Hello, the same ~0.5 s would have delayed the gateway's handshake; a shape
    at a time, a message that arrives meanwhile waits for one step at most. Requests may be
    open: the throwaway request takes pages only where the pool has them free."""

    def __init__(
        self,
        engine: TargetEngine,
        contexts: tuple[int, ...] = WARM_CONTEXTS,
        q_lens: tuple[int, ...] = WARM_Q_LENS,
    ) -> None:
        self.engine = engine
        self.layers = engine.feature_layer_ids  # what the graphs are captured for
        self.pending = [(c, q) for c in contexts for q in q_lens]
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return not self.pending

    def run_one(self) -> None:
        """The next shape that fits the pool now (shapes that do not are dropped); the
        captures it makes are logged, not counted as serving."""
        if self.engine.feature_layer_ids != self.layers:  # switched again: these are stale
            self.pending.clear()
        while self.pending:
            ctx, q = self.pending.pop(0)
            if ctx + q <= _room(self.engine):
                t0 = time.perf_counter()
                _run_shapes(self.engine, [(ctx, q)], t0)
                self.seconds += time.perf_counter() - t0
                break
        if self.engine.graphs is not None:
            self.engine.graphs.pop_capture_stats()
        if self.done:
            log.info("verify warm-up for feature layers %s done (%.1f s)", list(self.layers),
                     self.seconds)  # fmt: skip


def warm_prefill(engine: TargetEngine) -> int:
    """A throwaway prompt through the prefill path, then cuDNN's chunk shapes up to what
    the pool holds (see PREFILL_TAIL); returns the shapes built. Requests as before."""
    t0 = time.perf_counter()
    room = _room(engine)
    if room < 2:
        return 0
    rid = f"warmup-{uuid.uuid4().hex}"
    try:
        run = engine.start_prefill(rid, [0] * min(room - 1, engine.prefill_chunk + PREFILL_TAIL),
                                   Sampling(), frozenset(), 1)  # fmt: skip
        while run.advance() is None:
            pass
    finally:
        engine.release(rid)
    built = _prebuild_shapes(engine, aligned_chunk_starts(engine.prefill_chunk, room), t0)
    if engine.device.type == "cuda":  # the cached blocks of a long chunk's K/V, to the
        torch.cuda.empty_cache()  # driver: a drafter on this GPU may be starting beside it
    log.info("prefill warm-up done in %.1f s (%d chunk shapes built for cuDNN)",
             time.perf_counter() - t0, built)  # fmt: skip
    return built


@torch.inference_mode()
def _prebuild_shapes(engine: TargetEngine, starts: list[int], t0: float) -> int:
    """chunk_attention.prebuild at each start until PREBUILD_MAX_S after t0 or an error."""
    cfg, dtype = engine.model.cfg, engine.model.embed_tokens.weight.dtype
    built = 0
    for cached in starts:
        if time.perf_counter() - t0 > PREBUILD_MAX_S:
            log.warning("prefill warm-up: %d of %d chunk shapes built in %.0f s; the first "
                        "prompts past %d tokens build the rest", built, len(starts),
                        PREBUILD_MAX_S, cached)  # fmt: skip
            break
        try:
            built += prebuild(engine.device, dtype, cfg.num_heads, cfg.head_dim,
                              engine.prefill_chunk, [cached], cfg.head_dim**-0.5)  # fmt: skip
        except RuntimeError as err:  # e.g. out of memory beside the KV pool
            log.warning("prefill warm-up: the chunk shape after %d keys failed (%s); prompts "
                        "that long build theirs when they come", cached, err)  # fmt: skip
            break
    return built


def _room(engine: TargetEngine) -> int:
    """Tokens one more request can hold now."""
    return min(engine.max_context, engine.cache.free_pages * engine.cache.page_size)


def _run_shapes(engine: TargetEngine, shapes: list[tuple[int, int]], t0: float) -> None:
    """One step per (context, q_len) of a throwaway request, through the engine's own step
    path (graph or eager) with its feature layers; the request is freed afterwards."""
    rid = f"warmup-{uuid.uuid4().hex}"  # never a client's id: the gateway names requests
    engine.cache.add(rid)
    try:
        engine.cache.reserve(rid, max(c + q for c, q in shapes) if shapes else 0)
        with torch.inference_mode():
            for i, (ctx, q) in enumerate(shapes, 1):
                engine.cache.seq(rid).length = ctx  # the keys read are whatever the pages hold
                step = engine._step_host([(rid, [0] * q, ctx)])
                layers = engine.feature_layer_ids
                out = engine.graphs.run(step, layers) if engine.graphs is not None else None
                if out is None:  # eager, as TargetEngine.verify runs a step no graph fits
                    engine.model(upload(step, engine.device), engine.cache, None, layers)
                log.info("warm-up %d/%d: context %d, block %d (%.1f s)", i, len(shapes), ctx, q,
                         time.perf_counter() - t0)  # fmt: skip
    finally:
        engine.cache.free(rid)
