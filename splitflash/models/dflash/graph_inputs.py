"""The host side of a graphed draft step (graphs.py): what a step writes and reads, planned
on the host and packed into one int32 buffer so that loading it is one copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from splitflash.models.dflash.pool import DraftKVPool


@dataclass
class StepInputs:
    """One graphed step on the host: the block and the context rows written before it."""

    anchors: list[int]  # [N] the blocks' first tokens (the rest are MASK)
    anchor_pos: list[int]  # [N] their positions (block token i sits at anchor_pos + i)
    t: int  # block length T
    slots: list[int]  # [N]
    n_ctx: list[int]  # [N] context held once the rows are written
    app_pos: np.ndarray  # [N_pad * R] int64, padding rows at position 0
    app_dest: np.ndarray  # [L, N_pad * R] int64, padding rows on scratch slot 0
    app_rows: torch.Tensor | None  # [sum n_i] int64: static rows of the features (None: none)
    app_feats: torch.Tensor | None  # [sum n_i, K*D] the rows' features, request by request


def words(n_pad: int, t: int, rows: int, n_layers: int) -> tuple[int, int]:
    """(int64 words, int32 words) of a step's packed inputs."""
    return 2 * n_pad * t + (1 + n_layers) * n_pad * rows, 2 * n_pad


def pack(step: StepInputs, n_pad: int, rows: int, mask_id: int, pin: bool) -> torch.Tensor:
    """A step's inputs in one host int32 buffer, so loading it is one (asynchronous, when
    pinned) copy instead of several pageable ones and padding fills (the verify step's
    version: models/step_inputs.py). Layout in int32 words, the int64 parts first:
        ids [N_pad, T] | pos [N_pad, T] | app_pos [N_pad*R] | app_dest [L, N_pad*R] (i64)
        slots [N_pad] | n_ctx [N_pad] (i32)
    Rows past the N real ones are padding: [MASK x T] at positions 0..T-1, scratch slot 0,
    no context."""
    n, t = len(step.anchors), step.t
    n_layers = step.app_dest.shape[0]
    n64, n32 = words(n_pad, t, rows, n_layers)
    buf = torch.empty(2 * n64 + n32, dtype=torch.int32, pin_memory=pin)
    w32 = buf.numpy()
    i64 = w32[: 2 * n64].view(np.int64)
    blocks = i64[: 2 * n_pad * t].reshape(2, n_pad, t)
    # [anchor, MASK x (T-1)] at anchor_pos + [0, T): DFlashDrafter.block_inputs, in numpy
    # rather than as small torch tensors (bench.draft_host, bench/RESULTS.md session 29).
    blocks[0] = mask_id
    blocks[0, :n, 0] = step.anchors
    blocks[1] = np.arange(t)
    blocks[1, :n] += np.asarray(step.anchor_pos, dtype=np.int64)[:, None]
    i64[2 * n_pad * t :] = np.concatenate([step.app_pos[None], step.app_dest]).ravel()
    small = w32[2 * n64 :].reshape(2, n_pad)
    small[0, :n], small[1, :n] = step.slots, step.n_ctx
    small[:, n:] = 0
    return buf


def views(buf: torch.Tensor, n_pad: int, t: int, rows: int, n_layers: int):
    """(ids, pos, app_pos, app_dest, slots, n_ctx) as views of a buffer laid out by pack."""
    n64, _ = words(n_pad, t, rows, n_layers)
    i64 = buf[: 2 * n64].view(torch.int64)
    ids, pos = i64[: 2 * n_pad * t].view(2, n_pad, t)
    app = i64[2 * n_pad * t :].view(1 + n_layers, n_pad * rows)
    slots, n_ctx = buf[2 * n64 :].view(2, n_pad)
    return ids, pos, app[0], app[1:], slots, n_ctx


@lru_cache(maxsize=64)
def _layer_rows(caps: tuple[int, ...], windows: tuple[int | None, ...], n: int):
    """Per layer [L, 1, 1] int64: rows per slot and the ring a position wraps in (the slot's
    rows on a full layer: its positions stay below them); [L, n] scratch rows: row i of every
    layer on slot 0 (distinct where the slot has enough), what unused append rows write to;
    the most rows one write may take (the smallest sliding ring: more would collide) and the
    end no write may pass (the smallest full layer). Read-only: callers copy what they change."""
    caps_a = np.asarray(caps, dtype=np.int64)[:, None, None]
    ring = np.asarray([c if w is None else w for c, w in zip(caps, windows, strict=True)],
                      dtype=np.int64)[:, None, None]  # fmt: skip
    scratch = np.arange(n, dtype=np.int64)[None] % caps_a[:, 0]
    for a in (caps_a, ring, scratch):
        a.flags.writeable = False
    most = min((w for w in windows if w is not None), default=2**62)
    end = min((c for c, w in zip(caps, windows, strict=True) if w is None), default=2**62)
    return caps_a, ring, scratch, most, end


def append_rows(
    pool: DraftKVPool, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int],
    n_pad: int, rows: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
    """(app_pos [N_pad * R], app_dest [L, N_pad * R], feat_rows [sum counts]) int64 for
    request i writing counts[i] context rows from position starts[i] into pool slot
    slots[i]; R = rows per request, feat_rows = the static rows (i * R + r) the requests'
    features fill, in request order. dest = slot * cap_l + (pos % W on a sliding layer, pos
    on a full one), as LayerKV writes them. Unused rows write to scratch slot 0 (never
    read: padding attends to an empty context). None when a write would not be the eager
    one: more than R rows, a sliding layer given more rows than its ring (they would
    collide), or a full layer's rows past the pool's capacity (the eager write moves that
    layer out of the pool). Vectorised over requests: at batch 32, a loop over requests and
    layers was most of a draft call's host work (bench.draft_host)."""
    caps = tuple(k.shape[1] for k in pool.k)
    caps_a, ring, scratch, most, end = _layer_rows(caps, tuple(pool.windows), n_pad * rows)
    ends = (s + n for s, n in zip(starts, counts, strict=True) if n)
    if max(counts) > min(rows, most) or max(ends, default=0) > end:
        return None
    n = len(slots)
    r = np.arange(rows, dtype=np.int64)
    used = r < np.asarray(counts, dtype=np.int64)[:, None]  # [N, R]
    pos = np.asarray(starts, dtype=np.int64)[:, None] + r  # [N, R]
    app_pos = np.zeros(n_pad * rows, dtype=np.int64)
    app_pos[: n * rows] = (pos * used).ravel()
    app_dest = scratch.copy()  # [L, N_pad * R]
    dest = np.asarray(slots, dtype=np.int64)[None, :, None] * caps_a + pos % ring  # [L, N, R]
    np.copyto(app_dest[:, : n * rows].reshape(len(caps), n, rows), dest, where=used)
    return app_pos, app_dest, np.flatnonzero(used)
