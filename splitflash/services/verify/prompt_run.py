"""One prompt's prefill, run a chunk at a time (TargetEngine.start_prefill).

Each `advance()` runs ONE forward over <= prefill_chunk prompt tokens (fewer if asked:
chunk_sizer.py), attending to the chunks already cached, and returns the StepReport after
the last one. The verify server serves other messages between chunks (other requests'
verify steps, heartbeats, a Release of this very request), so a 185k-token prompt delays
them by one chunk's forward instead of its whole prefill, as vLLM's chunked prefill does.
The engine's own `prefill()` runs every chunk in one call (the one-process CLI, tests,
benchmarks).

Whatever way a run ends early (a forward that raises, `abort()`), it leaves no pages behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitflash.services.verify.acceptance import StepOutcome
from splitflash.services.verify.requests import Sequence, StepReport
from splitflash.services.verify.sampling import Sampling, make_generator

if TYPE_CHECKING:
    from splitflash.services.verify.engine import TargetEngine


class PromptRun:
    """Validates and reserves the prompt's KV at once; forwards in `advance()`."""

    def __init__(
        self,
        engine: TargetEngine,
        request_id: str,
        prompt: list[int],
        sampling: Sampling,
        stop_ids,
        max_commit: int,
        stream_features: bool = False,
    ) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) + 1 > engine.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds context {engine.max_context}")
        if request_id in engine.seqs:
            raise ValueError(f"request {request_id!r} already exists")
        engine.cache.add(request_id)  # raises while another prefill of this id is running
        try:
            engine.cache.reserve(request_id, len(prompt))
        except Exception:  # pool full: the request leaves nothing
            engine.cache.free(request_id)
            raise
        self.engine = engine
        self.request_id = request_id
        self.prompt = list(prompt)
        self.sampling = sampling
        self.stop_ids = frozenset(stop_ids)
        self.max_commit = max_commit
        self.cached = 0  # prompt tokens in the KV cache so far
        self.ended = False  # finished, failed or aborted
        # stream_features: each chunk's feature rows are this chunk's only, to be sent on at
        # once (chunk_rows / chunk_start); the report carries the last chunk's. Else they
        # are kept and the report carries the whole prompt's (a 185k prompt of a model with
        # 7168-wide features, 5 layers of them: 13 GB held until the end).
        self.stream_features = stream_features
        self.chunk_start = 0  # position of the last chunk's first token
        self.chunk_rows: torch.Tensor | None = None  # [chunk, F] of the last chunk (streamed)
        self._hidden: list[torch.Tensor] = []  # feature rows of each chunk: [chunk, F]

    @property
    def chunks_left(self) -> int:  # at prefill_chunk tokens each
        return -(-(len(self.prompt) - self.cached) // self.engine.prefill_chunk)

    @torch.inference_mode()
    def advance(self, max_tokens: int | None = None) -> StepReport | None:
        """One chunk of at most max_tokens (default and cap: prefill_chunk) into the KV
        cache; after the last one, commit the first token."""
        if self.ended:
            raise RuntimeError(f"prefill of {self.request_id!r} already ended")
        e, lo = self.engine, self.cached
        size = e.prefill_chunk if max_tokens is None else max(1, min(max_tokens, e.prefill_chunk))
        part = self.prompt[lo : lo + size]
        try:
            rows = torch.tensor([len(part) - 1], device=e.device)
            out = e.model(e._batch([(self.request_id, part, lo)]), e.cache, rows,
                          e.feature_layer_ids)  # fmt: skip
        except Exception:  # out of memory, a lost TP rank: this request leaves nothing
            self.abort()
            raise
        self.cached = lo + len(part)
        e.cache.seq(self.request_id).length = self.cached
        self.chunk_start, self.chunk_rows = lo, out.hidden
        if out.hidden is not None and not self.stream_features:
            self._hidden.append(out.hidden)
        if self.cached < len(self.prompt):
            if e.device.type == "cuda":
                # One chunk in flight at most: the loop serves the next message once this
                # chunk has run, so a step waits behind one chunk, not behind every chunk
                # the host could queue meanwhile (the launches are asynchronous).
                torch.cuda.current_stream(e.device).synchronize()
            return None
        return self._commit_first(out.logits[0])

    def _commit_first(self, logits: torch.Tensor) -> StepReport:
        self.ended = True
        hidden, start = self._hidden, 0
        features = (hidden[0] if len(hidden) == 1 else torch.cat(hidden)) if hidden else None
        if self.stream_features:
            features, start = self.chunk_rows, self.chunk_start
        self._hidden, self.chunk_rows = [], None
        seq = Sequence(self.request_id, list(self.prompt), self.sampling,
                       make_generator(self.sampling.seed), self.stop_ids)  # fmt: skip
        self.engine.seqs[self.request_id] = seq
        token = self.engine._next_token(seq, logits)
        seq.tokens.append(token)
        finished = token in seq.stop_ids or self.max_commit <= 1
        outcome = StepOutcome([token], 0, 0, 0, [])
        return StepReport(self.request_id, outcome, len(seq.tokens), [], features, start,
                          finished)  # fmt: skip

    def abort(self) -> None:
        """Stop before the last chunk and free what was reserved (a no-op once ended)."""
        if not self.ended:
            self.ended = True
            self._hidden, self.chunk_rows = [], None
            self.engine.cache.free(self.request_id)
