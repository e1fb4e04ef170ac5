"""DFlash behind the draft service's drafter interface (see registry.py).

Per request the drafter holds the committed tokens and a `DFlashState` whose context K/V
hold the target features of every committed token but the last, which is the next block's
anchor. Invariant checked on every proposal: context length == committed length - 1 (the
target's KV length); a mismatch raises `DFlashDesyncError`, never a silent bad draft.
Order per step: extend(committed ids) and add_features(rows of the kept positions) in either
order, then propose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitflash.models.dflash import DFlashDesyncError, DFlashDrafter, DFlashState
from splitflash.models.dflash.checks import check_features
from splitflash.models.dflash.config import SLIDING
from splitflash.models.dflash.graphs import DraftGraphs
from splitflash.models.dflash.model import joined_rows
from splitflash.models.dflash.pool import DraftKVPool

# Feature rows projected per batched pass of DFlashProposer._flush: a step's rows (B x 16) go
# in one pass, a long prompt's in passes of this many (bounded transient memory).
FLUSH_ROWS = 8192
# Feature messages of at most this many rows (a verify step's kept rows; a block is <= 64) are
# staged onto the drafter's GPU on arrival.
STAGE_ROWS = 64


def _merged(pending: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """One request's pending (start_pos, rows [n, K*D]) joined into runs of <= FLUSH_ROWS
    rows. add_features keeps them contiguous, so the cache writes (a few kernels per item and
    layer) run once per run, not once per step: each step the speculation gate pauses leaves
    a row, and a proposal after a long pause would otherwise write hundreds of items."""
    runs: list[list] = []  # [start_pos, [rows], n rows]
    for start, f in pending:
        if runs and runs[-1][2] + f.shape[0] <= FLUSH_ROWS:
            runs[-1][1].append(f)
            runs[-1][2] += f.shape[0]
        else:
            runs.append([start, [f], f.shape[0]])
    # a run of one item (the usual step between proposals) is passed on as it is: no copy
    return [(start, fs[0] if len(fs) == 1 else joined_rows(fs, fs[0].device))
            for start, fs, _ in runs]  # fmt: skip


@dataclass
class DFlashDraftState:
    tokens: list[int]  # committed tokens: prompt + generated
    cache: DFlashState
    # Features acked but not yet in the cache: (start_pos, rows [n, K*D]), in position order.
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def held(self) -> int:
        """Context tokens held: in the cache, then pending."""
        return self.cache.n_ctx + sum(f.shape[0] for _, f in self.pending)


class DFlashProposer:
    name = "dflash"

    def __init__(
        self,
        drafter: DFlashDrafter,
        pool: DraftKVPool | None = None,
        graphs: DraftGraphs | None = None,
    ) -> None:
        """pool: requests' context K/V in one fixed pool (batched attention, graphable);
        graphs: CUDA graphs of the draft step over that pool (eager fallback)."""
        if graphs is not None and graphs.pool is not pool:
            raise ValueError("draft graphs must run over the proposer's own pool")
        self.drafter = drafter
        self.pool = pool
        self.graphs = graphs
        self.requests: dict[str, DFlashDraftState] = {}
        self._keys_read: dict[str, int] = {}
        self.forwards = {"graph": 0, "eager": 0}  # draft forwards by how they ran (metrics)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.config.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.drafter.config.block_size - 1

    # ---- lifecycle -----------------------------------------------------------------------
    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        if request_id in self.requests:
            raise ValueError(f"DFlash drafter: request {request_id!r} is already open")
        state = self.drafter.new_state() if self.pool is None else self.pool.new_state()
        self.requests[request_id] = DFlashDraftState(list(prompt_ids), state)

    def _get(self, request_id: str) -> DFlashDraftState:
        try:
            return self.requests[request_id]
        except KeyError:
            raise DFlashDesyncError(f"DFlash drafter: unknown request {request_id!r}") from None

    def extend(self, request_id: str, new_ids: list[int], base_len: int) -> None:
        """Add tokens committed since the last call; base_len is the new committed length."""
        st = self._get(request_id)
        if len(st.tokens) + len(new_ids) != base_len:
            raise DFlashDesyncError(
                f"DFlash drafter out of step for {request_id!r}: holds {len(st.tokens)} "
                f"tokens + {len(new_ids)} new != committed length {base_len}"
            )
        st.tokens.extend(int(t) for t in new_ids)

    def add_features(self, request_id: str, start_pos: int, features: torch.Tensor) -> None:
        """Target features [n, K*D] of the committed positions start_pos .. start_pos + n - 1
        (the verify step's kept rows); start_pos must equal the context held.

        Checked now, written at the next proposal: a verify step's Features arrive one
        message per request, and all requests' rows then go into the cache in one batched
        pass (DFlashDrafter.append_contexts) instead of one ~40-kernel pass each."""
        st = self._get(request_id)
        if start_pos != st.held:
            raise DFlashDesyncError(
                f"features of {request_id!r} start at position {start_pos} but the drafter "
                f"holds {st.held} context tokens (expected start_pos == {st.held})"
            )
        check_features(self.drafter, features)
        device = self.drafter.fc.weight.device
        if device.type == "cuda" and features.device != device and features.shape[0] <= STAGE_ROWS:
            # A step's rows go to the GPU now, asynchronously from pinned memory (the caching
            # host allocator holds the block until the copy ran): the copy overlaps the other
            # requests' messages instead of blocking the next draft call. A prompt's rows stay
            # on the host and move in FLUSH_ROWS passes (bounded device memory).
            features = features.pin_memory().to(device, non_blocking=True)
        st.pending.append((start_pos, features))

    def _flush(self, keep: frozenset[str] = frozenset()) -> None:
        """Write every pending feature row into the caches, except those of the requests in
        `keep` (a draft graph writes them), in passes of <= FLUSH_ROWS rows (a long prompt's
        features are not all projected at once). On failure the failed pass's requests lose
        their pending rows: their next features are then refused as a gap (start_pos past
        the context held), so they stop drafting, visibly."""
        part: list[tuple[DFlashState, torch.Tensor, int]] = []
        rows = 0
        for rid, st in self.requests.items():
            if rid in keep:
                continue
            pending, st.pending = st.pending, []
            for start, f in _merged(pending):
                if part and rows + f.shape[0] > FLUSH_ROWS:
                    self.drafter.append_contexts(part)
                    part, rows = [], 0
                part.append((st.cache, f, start))
                rows += f.shape[0]
        if part:
            self.drafter.append_contexts(part)

    def _graph_appends(self, request_ids: Sequence[str]) -> frozenset[str]:
        """The requests whose pending rows the draft graph can write itself: pooled, at most
        a block of rows (a verify step's commit; a prompt's rows go the eager way)."""
        if self.graphs is None or self.graphs.failed:
            return frozenset()
        limit = self.drafter.config.block_size
        states = {r: self._get(r) for r in request_ids}
        return frozenset(
            r for r, st in states.items()
            if st.cache.pooled_slot() is not None
            and 0 < st.held - st.cache.n_ctx <= limit  # the pending rows
        )  # fmt: skip

    def release(self, request_id: str) -> None:
        st = self.requests.pop(request_id, None)  # idempotent
        if st is not None and self.pool is not None:
            self.pool.release(st.cache)

    def context_len(self, request_id: str) -> int:
        return self._get(request_id).held

    # ---- drafting ------------------------------------------------------------------------
    def _anchor(self, request_id: str) -> tuple[DFlashDraftState, int, int]:
        st = self._get(request_id)
        if not st.tokens:
            raise ValueError(f"DFlash drafter: request {request_id!r} has no tokens")
        anchor_pos = len(st.tokens) - 1
        if st.held != anchor_pos:
            raise DFlashDesyncError(
                f"DFlash drafter out of step for {request_id!r}: holds features of "
                f"{st.held} tokens but {len(st.tokens)} are committed (expected "
                f"{anchor_pos}: every committed token but the anchor)"
            )
        return st, st.tokens[-1], anchor_pos

    def propose(self, request_id: str, k: int) -> list[int]:
        """Greedy block draft: at most k (and at most block_size - 1) tokens."""
        return self.propose_batch([request_id], k)[0]

    def propose_batch(self, request_ids: Sequence[str], k: int) -> list[list[int]]:
        """One drafter forward for many requests (each gets min(k, B-1) tokens)."""
        k = min(int(k), self.max_drafts)
        if k <= 0 or not request_ids:
            return [[] for _ in request_ids]
        deferred = self._graph_appends(request_ids)
        self._flush(keep=deferred)
        picked = [self._anchor(r) for r in request_ids]
        args = ([p[0].cache for p in picked], [p[1] for p in picked], [p[2] for p in picked])
        drafted = None  # [N, k] token ids
        if self.graphs is not None:
            appends = [_joined(self.requests[r].pending) if r in deferred else None
                       for r in request_ids]  # fmt: skip
            drafted = self.graphs.run(*args, block_size=k + 1, appends=appends, greedy=True)
        self.forwards["eager" if drafted is None else "graph"] += 1
        if drafted is None:
            self._flush()  # the graph wrote nothing: the rows go in eagerly
            logits = self.drafter.draft_batch(*args, block_size=k + 1, pool=self.pool)
            drafted = logits.argmax(-1)
        else:
            for r in deferred:
                self.requests[r].pending = []  # the graph wrote them
        for p in picked:
            for kind, layer_reads in zip(
                p[0].cache.layer_kinds, p[0].cache.keys_read_last, strict=True
            ):
                self._keys_read[kind] = self._keys_read.get(kind, 0) + layer_reads
        return drafted.tolist()

    # ---- facts for logs and metrics ------------------------------------------------------
    def policy_string(self) -> str:
        return self.drafter.policy_string()

    def attention_policy(self):
        """(in force, as the checkpoint declares, source): per layer (kind, window)."""
        cfg = self.drafter.config
        in_force = [
            ("sliding" if p.kind == "sliding" else "full", p.window) for p in self.drafter.policy
        ]
        declared = [
            ("sliding", cfg.sliding_window) if t == SLIDING else ("full", None)
            for t in cfg.layer_types
        ]
        return in_force, declared, self.drafter.window_override

    def pop_forwards(self) -> dict[str, int]:
        """Draft forwards by mode ("graph" | "eager") since the last call."""
        out, self.forwards = self.forwards, {"graph": 0, "eager": 0}
        return out

    def pop_capture_stats(self) -> tuple[int, float]:
        """(draft graphs captured, seconds it took) since the last call."""
        return (0, 0.0) if self.graphs is None else self.graphs.pop_capture_stats()

    def pop_graph_evictions(self) -> int:
        """Draft graphs dropped from the LRU since the last call."""
        return 0 if self.graphs is None else self.graphs.pop_evictions()

    @property
    def graph_capture_failed(self) -> bool:
        return self.graphs is not None and self.graphs.failed

    def pop_keys_read(self) -> dict[str, int]:
        out, self._keys_read = self._keys_read, {}
        return out


def _joined(pending: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    """A request's pending feature chunks (contiguous, checked on arrival) as one
    (features [n, K*D], start_pos)."""
    if len(pending) == 1:
        return pending[0][1], pending[0][0]
    return torch.cat([f.to(pending[0][1].device) for _, f in pending]), pending[0][0]
