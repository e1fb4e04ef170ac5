"""Split-K for the small-M linear kernels (kernels/fused_linear.py): more programs per launch.

Why: at M = 16 a linear launch of the default model has few output tiles: 36 for o_proj
(576 columns in 16-column tiles) and 18 for down (32-column tiles), on a GPU of 132 SMs. Each
program walks all of K and streams its weight tile from HBM alone, so most SMs idle and the
launch takes ~4 us for 0.7-1.8 MB (a 185k verify step spent ~0.5 ms of its ~2.2 ms in its
120 linears, H100 CUPTI, bench/RESULTS.md). Splitting K over S programs per tile puts S times
the programs, and bytes in flight, on the same weights.

Off by default: measured on an H100 (bench/RESULTS.md, session 29), short K loops (576
inputs) lose ~1 us a launch when split, down's 1536 gain ~0.5 us; and the verify step with
only the long ones split (SPLITFLASH_LINEAR_SPLIT_K=auto) was no faster than without, in
two alternated pairs on an H100 (session 31: 185k q16 graph 2.342 / 2.241 ms off against
2.347 / 2.231 auto; 512 q16 0.721 / 0.710 against 0.744 / 0.729).

How the S partial sums meet without another launch: each program stores its fp32 partial
[BLOCK_M, BLOCK_N] to a workspace, then counts itself in on an arrival counter of its tile;
the last of the S to arrive sums the S partials in split order (the same order whichever
arrives last, so a launch's result does not depend on scheduling), runs the epilogue
(norm scale, SwiGLU, residual add) and resets the counter. The partials are tiny (16 x 32
fp32 = 2 KiB), unlike attention's split combine, which this pattern lost on (session 14).

The counters are one zeroed buffer per device that every launch leaves at zero, so launches
sharing it must run one at a time on the device: the verify step's linears do (one stream,
each launch after the previous one completed, also under PDL, where counters are touched
only after gdc_wait). It is allocated on the first launch outside a CUDA graph capture; a
capture that finds none launches without splitting (warm-ups precede every capture here).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitflash.kernels.tuning import device_facts

AUTO = 0  # a launch's split_k argument asking for the auto rule (plan_splits with cap None)
COUNTERS = 4096  # tiles (N tiles x M tiles) one launch may split; more: no split
MAX_SPLITS = 16  # bounds the workspace (and the last program's sum) of one launch
# Auto splits only launches over at least this many inputs. Measured on an H100 (session 29,
# bench.linear_sweep --splits --cold, us per link at M 16): down (K 1536, 18 tiles) 4.34 ->
# 3.86 split 6 ways; o_proj (K 576, 36 tiles) 2.36 -> 3.28-3.52 split 2-6 ways, and the
# whole verify step with every launch of < 132 tiles split was slower (bench/RESULTS.md).
# Short K loops gain less from more programs than the partials and the last program's sum cost.
AUTO_MIN_K = 1024
_counters: dict[torch.device, torch.Tensor] = {}


def split_k_cap() -> int | None:
    """SPLITFLASH_LINEAR_SPLIT_K: unset, "1" or "0": never split (the default: the auto rule
    did not speed the verify step up, bench/RESULTS.md session 31); "auto" (None):
    launches over K >= AUTO_MIN_K split to fill the SMs; N: at most N splits (sweeps)."""
    text = os.environ.get("SPLITFLASH_LINEAR_SPLIT_K", "1").strip().lower()
    if text == "auto":
        return None
    if not text:
        return 1
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(
            f"SPLITFLASH_LINEAR_SPLIT_K must be auto or a count, got {text!r}"
        ) from None


def plan_splits(k: int, block_k: int, tiles: int, device: torch.device,
                cap: int | None) -> tuple[int, int]:  # fmt: skip
    """(splits, K per split) of one launch of `tiles` output tiles over K inputs. Auto (cap
    None): for K >= AUTO_MIN_K, enough splits for one program per SM (no second wave), each
    split a whole number of BLOCK_K steps; 1 where nothing is gained, on CPU (unless a cap
    forces it) or without counters."""
    steps = -(-k // block_k)
    if cap is None:
        if k < AUTO_MIN_K:
            return 1, k
        sms = device_facts(device.index or 0)[1] if device.type == "cuda" else 1
        want = sms // max(1, tiles)
    else:
        want = cap
    want = min(want, steps, MAX_SPLITS)
    if want <= 1 or tiles > COUNTERS or arrival_counters(device) is None:
        return 1, k
    per_split = -(-steps // want) * block_k
    return -(-k // per_split), per_split  # no empty split: 9 steps over 4 -> 3 splits of 3


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed int32 arrival counters, or None during a capture that found none."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # an allocation here would belong to the graph's pool
        buf = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def workspace(planes: int, splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """fp32 [planes, splits, m, n] for the partials (planes: 2 for SwiGLU's gate and up)."""
    return torch.empty((planes, splits, m, n), dtype=torch.float32, device=device)


@triton.jit
def store_partial(ws_ptr, acc, rows, cols, mask, M, N, PLANE: tl.constexpr,
                  SPLIT_K: tl.constexpr):  # fmt: skip
    """Store this program's partial acc [BLOCK_M, BLOCK_N] at (PLANE, its split). int32
    offsets: a split launch has fewer tiles than SMs, so its workspace is small."""
    base = (PLANE * SPLIT_K + tl.program_id(2)) * M * N
    tl.store(ws_ptr + base + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def arrive(counter_ptr, SPLIT_K: tl.constexpr):
    """Count this program in on its tile's counter (after its partials are stored); True in the
    last of the tile's SPLIT_K programs, which resets the counter for the next launch.

    Ordering, the pattern of a grid-wide barrier: the barrier puts every thread's partial
    stores before the counter's update, which releases them at GPU scope (acq_rel); the
    last program's update acquires the others', and its partial loads bypass L1 (.cg)."""
    tl.debug_barrier()
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    tl.atomic_xchg(counter_ptr + tile, 0, mask=last)
    tl.debug_barrier()
    return last


@triton.jit
def sum_partials(ws_ptr, rows, cols, mask, M, N, PLANE: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The sum of the tile's SPLIT_K partials at PLANE, in split order; masked loads (the
    caller passes mask & last) so only the last program reads them."""
    offs = rows[:, None] * N + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):
        base = (PLANE * SPLIT_K + s) * M * N
        acc += tl.load(ws_ptr + base + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc
