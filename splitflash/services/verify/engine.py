"""The target engine: the target model, its paged KV cache and per-request decoding state.

No sockets here: the verify server and the one-process CLI both drive this. Invariant kept
for every request: the KV cache holds every committed token but the last one, which is the
anchor of the next step (so kv_len == committed_len - 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import KVPoolFullError, PagedKVCache
from splitflash.models.step_inputs import StepHost, upload
from splitflash.models.target import ForwardBatch, TargetModel
from splitflash.services.verify.acceptance import (
    accept_chain_sampled,
    accept_greedy_ids,
    check_invariants,
    truncate_outcome,
)
from splitflash.services.verify.prompt_run import PromptRun
from splitflash.services.verify.requests import Sequence, StepReport
from splitflash.services.verify.sampling import Sampling, target_probs

log = logging.getLogger(__name__)

# Prompt tokens per prefill forward (VerifySettings.prefill_chunk): a forward's activations
# grow with its tokens (the MLP's [T, 2 * intermediate] in bf16: 1.1 GB at 185k tokens for
# the 135M default, 10.6 GB for an 8B's 14336), and a chunk's attention reads the cached
# chunks before it, so peak memory stays that of a chunk whatever the prompt's length.
PREFILL_CHUNK = 8192
VOCAB_LOG_EVERY_S = 60.0  # drafts outside the vocabulary: at most one warning a minute


class DesyncError(RuntimeError):
    """The caller's committed length disagrees with the target's KV: never guessed around."""


@dataclass(frozen=True)
class VerifyInput:
    request_id: str
    base_len: int  # committed length the caller believes
    draft_ids: list[int]
    max_commit: int  # tokens the request may still produce


class TargetEngine:
    def __init__(
        self,
        model: TargetModel,
        cache: PagedKVCache,
        feature_layer_ids: tuple[int, ...] = (),
        max_context: int | None = None,
        graphs: VerifyGraphs | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.model = model
        self.graphs = graphs  # CUDA graphs for uniform verify steps; None = always eager
        self.last_forward_mode: str | None = None  # "graph" | "eager" of the last verify
        self.cache = cache
        self.feature_layer_ids = feature_layer_ids
        self.max_context = max_context or model.cfg.max_position_embeddings
        self.seqs: dict[str, Sequence] = {}
        self.device = model.embed_tokens.weight.device
        self._vocab_cuts = 0  # verify steps whose drafts held an id outside the vocabulary
        self._vocab_cuts_popped = 0  # of them, those pop_vocab_cuts() returned
        self._vocab_logged_at = -float("inf")  # time.monotonic() of the last such warning

    # --- lifecycle -------------------------------------------------------------------
    def release(self, request_id: str) -> bool:
        self.cache.free(request_id)
        return self.seqs.pop(request_id, None) is not None

    def _step_host(self, spans: list[tuple[str, list[int], int]]) -> StepHost:
        """spans: (request_id, new tokens, first position); KV already reserved. numpy over
        the whole batch: this runs every step, and per-request array ops cost microseconds
        each (bench/host_step --batches)."""
        size = self.cache.page_size
        page_rows, tails, firsts, starts, q_lens, kv_lens = [], [], [], [], [], []
        for seq_id, toks, start in spans:
            end = start + len(toks)
            kv = self.cache.seq(seq_id)
            if len(kv.pages) * size < end:  # the mirror past len(pages) is uninitialised
                raise ValueError(f"request {seq_id!r}: KV for {end} tokens is not reserved "
                                 f"({len(kv.pages)} pages of {size})")  # fmt: skip
            # The pages holding the kv_len keys: the same row whatever spare pages it has.
            row = kv.page_ids[: self.cache.pages_for(end)]
            page_rows.append(row)
            tails.append(row[start // size :])  # from the block's first page
            firsts.append(start // size)
            starts.append(start)
            q_lens.append(len(toks))
            kv_lens.append(end)
        # Each token's slot: its page, looked up in the concatenated tails of the page rows,
        # times the page size, plus its offset in the page.
        tail_at = np.cumsum([0] + [len(t) for t in tails])  # [B+1]
        lens = np.array(q_lens)
        first_token = np.cumsum(lens) - lens  # [B] row of each request's first new token
        positions = np.arange(sum(q_lens), dtype=np.int64) + np.repeat(starts - first_token, lens)
        page_idx = positions // size + np.repeat(tail_at[:-1] - np.array(firsts), lens)
        slots = np.concatenate(tails)[page_idx].astype(np.int64) * size + positions % size
        token_ids = np.fromiter((t for _, toks, _ in spans for t in toks), np.int64)
        return StepHost(token_ids, positions, slots, q_lens, kv_lens, page_rows)

    def _batch(self, spans: list[tuple[str, list[int], int]]) -> ForwardBatch:
        """The spans' forward inputs on the device, in one host->device copy."""
        return upload(self._step_host(spans), self.device)

    def _next_token(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.sampling.greedy:
            return int(logits.argmax())
        probs = target_probs(logits[None], seq.sampling)[0]
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    # --- prefill ---------------------------------------------------------------------
    def start_prefill(
        self,
        request_id: str,
        prompt: list[int],
        sampling: Sampling,
        stop_ids,
        max_commit: int,
        stream_features: bool = False,
    ) -> PromptRun:
        """The prompt's KV reserved, its forwards left to PromptRun.advance() (prompt_run.py):
        one chunk of <= prefill_chunk tokens each. The prompt must fit the context."""
        return PromptRun(self, request_id, prompt, sampling, stop_ids, max_commit,
                         stream_features)  # fmt: skip

    def prefill(
        self, request_id: str, prompt: list[int], sampling: Sampling, stop_ids, max_commit: int
    ) -> StepReport:
        """Run the prompt, every chunk, and commit the first token."""
        run = self.start_prefill(request_id, prompt, sampling, stop_ids, max_commit)
        while (report := run.advance()) is None:
            pass
        return report

    # --- verify ----------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, items: list[VerifyInput]) -> list[StepReport]:
        """One batched forward over [anchor + drafts] of every request, then acceptance."""
        reports: dict[str, StepReport] = {}
        self.last_forward_mode = None
        spans = []
        for item in items:
            seq = self.seqs.get(item.request_id)
            if seq is None:
                reports[item.request_id] = StepReport(
                    item.request_id, None, 0, error=f"unknown request {item.request_id!r}"
                )
                continue
            kv_len = self.cache.seq(item.request_id).length
            if item.base_len != len(seq.tokens) or kv_len != len(seq.tokens) - 1:
                raise DesyncError(
                    f"request {item.request_id!r}: caller says {item.base_len} committed, "
                    f"target has {len(seq.tokens)} committed and KV length {kv_len}"
                )
            # Drafts past the context cannot be written; those past the budget are not
            # judged, but stay in the block where there is room (_fit_blocks).
            drafts = self._in_vocabulary(
                item.request_id, item.draft_ids[: max(0, self.max_context - len(seq.tokens))]
            )
            judged = min(len(drafts), max(0, item.max_commit - 1))  # drafts the budget allows
            try:
                self.cache.reserve(item.request_id, kv_len + 1 + judged)
            except Exception as exc:  # pool full: this request fails, the batch goes on
                reports[item.request_id] = StepReport(item.request_id, None, 0, error=str(exc))
                continue
            block = [seq.tokens[-1]] + drafts
            spans.append((item.request_id, block, kv_len, item.max_commit, judged))
        if spans:
            self._fit_blocks(spans)
            self._verify_spans(spans, reports)
        return [reports[i.request_id] for i in items]

    def _in_vocabulary(self, request_id: str, drafts: list[int]) -> list[int]:
        """The drafts before the first id outside the target's vocabulary. The target gives
        such a token probability 0, so it is never accepted: judging the drafts before it
        commits what judging all of them would, without the out-of-range embedding lookup
        that would fail the step (on CUDA a device-side assert, the end of the process). A
        drafter that proposes such ids has another vocabulary than the target: logged."""
        vocab = self.model.cfg.vocab_size
        if not drafts or (min(drafts) >= 0 and max(drafts) < vocab):
            return drafts
        cut = next(j for j, t in enumerate(drafts) if not 0 <= t < vocab)
        self._vocab_cuts += 1
        now = time.monotonic()
        if now - self._vocab_logged_at >= VOCAB_LOG_EVERY_S:  # a broken drafter: every step
            log.warning("request %s: draft token %d is id %d, outside the target's vocabulary "
                        "of %d ids; the drafts from it on are dropped (%d steps cut so far; "
                        "is the drafter built for this target's tokenizer?)", request_id, cut,
                        drafts[cut], vocab, self._vocab_cuts)  # fmt: skip
            self._vocab_logged_at = now
        return drafts[:cut]

    def pop_vocab_cuts(self) -> int:
        """Steps cut by _in_vocabulary since the last call (the server's counter)."""
        n, self._vocab_cuts_popped = self._vocab_cuts - self._vocab_cuts_popped, self._vocab_cuts
        return n

    def _fit_blocks(self, spans) -> None:
        """Give blocks one length where it costs nothing but KV room, taken only once every
        judged block has its own (no request fails for it). A block cut to its budget, or a
        drafter proposing fewer tokens than a block (n-gram, a draft cut at the context
        end), would be a new block length: a CUDA graph captured in a live step (~50 ms),
        and a step of mixed lengths runs eagerly (bench/RESULTS.md "Session 24"). So:
        - drafts past the budget stay in the block, unjudged (_verify_spans);
        - with graphs, every block is padded to the step's graph block length
          (VerifyGraphs.padded_block_len) with copies of its anchor, unjudged too.
        A block without room (context end, KV pool full) stays short: the step then runs
        eagerly, as it did before."""
        for rid, block, kv_len, _, judged in spans:
            if not self._room(rid, kv_len + len(block)):
                del block[1 + judged :]
        if self.graphs is None:
            return
        q_pad = self.graphs.padded_block_len([len(span[1]) for span in spans])
        if q_pad is None:
            return
        for rid, block, kv_len, *_ in spans:
            fits = len(block) < q_pad and kv_len + q_pad <= self.max_context
            if fits and self._room(rid, kv_len + q_pad):
                block.extend([block[0]] * (q_pad - len(block)))

    def _room(self, request_id: str, length: int) -> bool:
        """Reserve KV for `length` tokens if the pool has the pages; False if not."""
        try:
            self.cache.reserve(request_id, length)
        except KVPoolFullError:
            return False
        return True

    def _verify_spans(self, spans, reports: dict[str, StepReport]) -> None:
        step = self._step_host([(rid, block, start) for rid, block, start, *_ in spans])
        out = None if self.graphs is None else self.graphs.run(step, self.feature_layer_ids)
        self.last_forward_mode = "eager" if out is None else "graph"
        if out is None:  # no graph fits this step (or none wanted): eager
            out = self.model(upload(step, self.device), self.cache, None, self.feature_layer_ids)
        # Every greedy row's argmax in one device->host copy, not one sync per request.
        greedy = any(self.seqs[s[0]].sampling.greedy for s in spans)
        argmax = out.logits.argmax(dim=-1).tolist() if greedy else None  # [N] ids
        lo = 0
        for rid, block, kv_len, max_commit, n_judged in spans:
            seq = self.seqs[rid]
            drafts = block[1 : 1 + n_judged]  # past them: over budget, or padding
            judged = n_judged + 1  # rows of the anchor and those drafts
            if seq.sampling.greedy:
                outcome = accept_greedy_ids(drafts, argmax[lo : lo + judged])
            else:
                probs = target_probs(out.logits[lo : lo + judged], seq.sampling)  # [K+1, V]
                outcome = accept_chain_sampled(drafts, probs, seq.generator)
            outcome = truncate_outcome(outcome, max_commit, seq.stop_ids)
            finished = outcome.commit_len < outcome.accepted_drafts + 1 or (
                outcome.committed[-1] in seq.stop_ids or outcome.commit_len >= max_commit
            )
            kept = outcome.accepted_drafts + 1  # anchor + accepted drafts stay in the KV
            self.cache.seq(rid).length = kv_len + kept
            self.cache.truncate(rid, kv_len + kept)
            seq.tokens.extend(outcome.committed)
            feats = None if out.hidden is None else out.hidden[lo : lo + kept]
            reports[rid] = StepReport(
                rid,
                outcome,
                len(seq.tokens),
                check_invariants(outcome, len(drafts), finished),
                feats,
                kv_len,
                finished,
            )
            lo += len(block)
