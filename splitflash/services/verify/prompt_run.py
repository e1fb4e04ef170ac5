"""One prompt's prefill, run a chunk at a time (TargetEngine.start_prefill).

Each `advance()` runs ONE forward over <= prefill_chunk prompt tokens (fewer if asked:
chunk_sizer.py), attending to the chunks already cached, and returns the StepReport after
the last one. The verify server serves other messages between chunks (other requests'
verify steps, heartbeats, a Release of this very request), so a 185k-token prompt delays
them by one chunk's forward instead of its whole prefill, as vLLM's chunked prefill does.
`advance_together()` runs the next chunk of several prompts in one forward (the verify
server packs short prompts that wait at once). The engine's own `prefill()` runs every
chunk in one call (the one-process CLI, tests, benchmarks).

Whatever way a run ends early (a forward that raises, `abort()`), it leaves no pages behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
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
        _check_vocabulary(prompt, engine.model.cfg.vocab_size)
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
    def tokens_left(self) -> int:  # prompt tokens not yet in the cache
        return len(self.prompt) - self.cached

    @property
    def chunks_left(self) -> int:  # at prefill_chunk tokens each
        return -(-self.tokens_left // self.engine.prefill_chunk)

    def advance(self, max_tokens: int | None = None) -> StepReport | None:
        """One chunk of at most max_tokens (default and cap: prefill_chunk) into the KV
        cache; after the last one, commit the first token."""
        return advance_together([(self, max_tokens)])[0]

    def _chunk_ran(self, lo: int, n: int, hidden, logits) -> StepReport | None:
        """This run's n tokens from position lo are in the cache; hidden [n, F] or None,
        logits [V] of its last token."""
        self.cached = lo + n
        self.engine.cache.seq(self.request_id).length = self.cached
        self.chunk_start, self.chunk_rows = lo, hidden
        if hidden is not None and not self.stream_features:
            self._hidden.append(hidden)
        return None if self.cached < len(self.prompt) else self._commit_first(logits)

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


def _check_vocabulary(prompt: list[int], vocab_size: int) -> None:
    """A token id outside the embedding table would fail the forward (on CUDA a device-side
    assert, which ends every request of the process); refused here, naming the token."""
    ids = np.asarray(prompt, dtype=np.int64)  # [n]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        at = int(bad[0])
        raise ValueError(f"prompt token {at} is id {int(ids[at])}, outside the target's "
                         f"vocabulary of {vocab_size} ids ({bad.size} outside in all)")  # fmt: skip


@torch.inference_mode()
def advance_together(
    parts: list[tuple[PromptRun, int | None]], abort_on_error: bool = True
) -> list[StepReport | None]:
    """The next chunk of each (run, max_tokens) in ONE forward, prompts packed as a verify
    step packs requests, so short prompts admitted together cost one forward instead of one
    each (vLLM packs prompts the same way). A chunk takes at most max_tokens (default and
    cap: prefill_chunk) of its prompt. Returns each run's StepReport after its last chunk,
    else None. If the forward fails it raises, every run aborted (its pages freed) or, with
    abort_on_error False, left as it was, to be run again: a run's cached count moves only
    after its forward, and a rerun writes the same KV slots."""
    runs = [run for run, _ in parts]
    e = runs[0].engine
    if len({run.request_id for run in runs}) < len(runs):
        raise ValueError("one prompt twice in a packed prefill forward")
    spans = []  # (request_id, tokens, first position)
    for run, max_tokens in parts:
        if run.ended:
            raise RuntimeError(f"prefill of {run.request_id!r} already ended")
        cap = e.prefill_chunk if max_tokens is None else max(1, min(max_tokens, e.prefill_chunk))
        spans.append((run.request_id, run.prompt[run.cached : run.cached + cap], run.cached))
    ends = np.cumsum([len(toks) for _, toks, _ in spans])  # [R] row after each run's chunk
    try:
        rows = torch.tensor(ends - 1, device=e.device)  # each chunk's last token
        out = e.model(e._batch(spans), e.cache, rows, e.feature_layer_ids)
    except Exception:  # out of memory, a lost TP rank: these requests leave nothing
        if abort_on_error:
            for run in runs:
                run.abort()
        raise
    reports = []
    for i, (run, (_, toks, lo)) in enumerate(zip(runs, spans, strict=True)):
        hidden = None if out.hidden is None else out.hidden[ends[i] - len(toks) : ends[i]]
        reports.append(run._chunk_ran(lo, len(toks), hidden, out.logits[i]))
    if e.device.type == "cuda" and any(r is None for r in reports):
        # One chunk in flight at most: the loop serves the next message once this chunk
        # has run, so a step waits behind one chunk, not behind every chunk the host could
        # queue meanwhile (the launches are asynchronous).
        torch.cuda.current_stream(e.device).synchronize()
    return reports
