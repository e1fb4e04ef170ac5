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
def _scratch_rows(caps: tuple[int, ...], n: int) -> np.ndarray:
    """[L, n] int64: row i of every layer on scratch slot 0 (distinct rows where the slot
    has enough), what unused append rows write to. Read-only: callers copy it."""
    out = np.stack([np.arange(n, dtype=np.int64) % cap for cap in caps])
    out.flags.writeable = False
    return out


def append_rows(
    pool: DraftKVPool, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int],
    n_pad: int, rows: int,
) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
    """(app_pos [N_pad * R], app_dest [L, N_pad * R]) int64 for request i writing counts[i]
    context rows from position starts[i] into pool slot slots[i]; R = rows per request.
    dest = slot * cap_l + (pos % W on a sliding layer, pos on a full one), as LayerKV writes
    them. Unused rows write to scratch slot 0 (never read: padding attends to an empty
    context). None when a write would not be the eager one: more than R rows, a
    sliding layer given more rows than its ring (they would collide), or a full layer's
    rows past the pool's capacity (the eager write moves that layer out of the pool)."""
    caps = tuple(k.shape[1] for k in pool.k)
    app_pos = np.zeros(n_pad * rows, dtype=np.int64)
    app_dest = _scratch_rows(caps, n_pad * rows).copy()
    for i, (slot, start, n) in enumerate(zip(slots, starts, counts, strict=True)):
        if n > rows:
            return None
        if n == 0:
            continue
        pos = np.arange(start, start + n, dtype=np.int64)
        app_pos[i * rows : i * rows + n] = pos
        for li, (cap, win) in enumerate(zip(caps, pool.windows, strict=True)):
            if (win is not None and n > win) or (win is None and start + n > cap):
                return None
            row = pos % win if win is not None else pos
            app_dest[li, i * rows : i * rows + n] = slot * cap + row
    return app_pos, app_dest
