"""Tile configs of the small-M linear kernels (kernels/fused_linear.py): rows per program tile,
(BLOCK_N, BLOCK_K, warps, stages) by layer, and the split-K plan (kernels/split_k.py) of one
launch. Host-side only: what a launch's meta arguments and grid are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from splitflash.kernels.split_k import AUTO, plan_splits, split_k_cap
from splitflash.kernels.tuning import next_pow2

BLOCK_M = 16  # the smallest tl.dot tile; a 16-token block is one row tile
# Batch-invariant steps (kernels/fused_dispatch.py, any_rows) take every M through one tile
# config per layer (invariant_config), so a row's K order never depends on the batch. Rows:
# 16 up to one verify block, else 64, the Hopper warpgroup MMA's tile: a batch of 8 blocks
# (M = 128) is then two row tiles, where 16-row tiles re-read every weight tile from L2 eight
# times. Measured on the H200 (bench/RESULTS.md): the invariant batch-8 step at 32k 5.62 ->
# 4.93 ms; at batch 1, 64-row tiles would cost 0.03-0.08 ms a step. The two tile heights run
# different MMA instructions (mma.sync, wgmma) over the same K chunks, and sum the norm's
# squares over the same column chunks and layout; they gave the same bits in every probe,
# and tests/unit/test_kernels_fused_linear.py checks it on the GPU. The fast path takes the
# same 64-row tiles and configs above 32 rows (`row_tile`).
WIDE_BLOCK_M = 64
# The fast path's 16-row tiles up to this M. `bench.linear_sweep --compare` on the H200, a
# layer's four linears per launch chain (us): at M 32, 16-row 16.3 vs 64-row 17.4; at M 64,
# 23.9 vs 18.2; at M 128, 31.7 vs 18.6 (cuBLAS + the ops apart 22.3); at M 256, 54.6 vs
# 21.4 (cuBLAS 22.9).
FAST_NARROW_MAX_M = 32
# The norm's row statistics of invariant and 64-row launches in chunks of this many columns,
# at either tile height (whole rows, 64 x 1024 fp32, would not fit in registers).
INVARIANT_NORM_CHUNK = 128


def row_tile(m: int, invariant: bool) -> int:
    """Rows of one program tile for a launch of m rows: 16 up to one verify block (or two on
    the fast path), 64 above."""
    return BLOCK_M if m <= (BLOCK_M if invariant else FAST_NARROW_MAX_M) else WIDE_BLOCK_M


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of one launch.
LinearConfig = tuple[int, int, int, int]
# The tile configs of batch-invariant launches, by K (a property of the layer): never chosen
# by M or environment, since a config is part of a row's rounding. H200 sweeps
# (`bench.linear_sweep --invariant --rows 1 16 128`, bench/RESULTS.md): (32, 128, 4, 3) best
# or within 0.1 us of it for every layer at M 16 and 128; at K 1536 (down) 256-wide K steps
# take 1.1 us off its 4.5 at M 1.
INVARIANT_CONFIG: LinearConfig = (32, 128, 4, 3)
INVARIANT_CONFIG_WIDE_K: LinearConfig = (32, 256, 4, 3)  # K > 1024


def invariant_config(k: int) -> LinearConfig:
    """The tile config of a batch-invariant launch over K input features."""
    return INVARIANT_CONFIG if k <= 1024 else INVARIANT_CONFIG_WIDE_K


def launch_config(k: int, config: LinearConfig | None = None) -> LinearConfig:
    """The tile config of a launch: `config` if given, else SPLITFLASH_LINEAR_CONFIG, else the
    H200 sweep's picks (bench/linear_sweep.py, bench/RESULTS.md; time per launch inside a
    chain of dependent launches, the default model's layers at M 16):
    - K <= 1024: (16, 64, 4, 4), 2.3 us at 576 -> 576 + residual (cuBLAS + add: 4.3 us).
      The norm kernels take it too: with the norm weight folded they run the same K loop
      (the sweep ran before the fold, when their best was (32, 64, 4, 4) at 5.1-5.6 us).
    - wider K: (32, 256, 4, 3), 3.5 us at 1536 -> 576 + residual (cuBLAS + add: 5.6 us)."""
    if config is not None:
        return config
    text = os.environ.get("SPLITFLASH_LINEAR_CONFIG", "").strip()  # one config, for sweeps
    if text:
        try:
            block_n, block_k, warps, stages = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError("SPLITFLASH_LINEAR_CONFIG must be BLOCK_N,BLOCK_K,warps,stages "
                             f"(e.g. 16,128,4,3), got {text!r}") from None  # fmt: skip
        return block_n, block_k, warps, stages
    return (16, 64, 4, 4) if k <= 1024 else (32, 256, 4, 3)


@dataclass(frozen=True)
class LinearLaunch:
    """One launch of a small-M linear kernel: its grid (N tiles, M tiles, splits), the K each
    split walks, and the kernel's meta arguments."""

    grid: tuple[int, int, int]
    k_split: int  # inputs per split, a multiple of BLOCK_K (K when not split)
    meta: dict


def plan_launch(
    w: torch.Tensor,  # [N_W, K]: the weights, for their device and element size
    m: int, n: int, k: int,
    config: LinearConfig | None,  # None: invariant_config / launch_config
    invariant: bool,
    block_m: int | None,  # None: row_tile
    split_k: int | None,  # at most this many K splits, AUTO (0): the auto rule; None:
    #                       SPLITFLASH_LINEAR_SPLIT_K
) -> LinearLaunch:  # fmt: skip
    """The launch of m rows x n outputs over k inputs. Split-K (kernels/split_k.py) only on
    16-row fast-path tiles: batch-invariant launches keep one K order whatever the batch, and
    64-row launches already have programs enough."""
    block_m = block_m or row_tile(m, invariant)
    if invariant or block_m > BLOCK_M:  # 64-row tiles: invariant_config was best at M 128
        config = config or invariant_config(k)
    else:
        config = launch_config(k, config)
    block_n, block_k, warps, stages = config
    tiles = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    splits, k_split = 1, k
    if not invariant and block_m == BLOCK_M:
        cap = split_k_cap() if split_k is None else None if split_k == AUTO else split_k
        splits, k_split = plan_splits(k, block_k, tiles[0] * tiles[1], w.device, cap)
    line_elems = max(1, 128 // w.element_size())  # elements per 128-byte L2 line
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                num_stages=stages, LINE_ELEMS=line_elems, SPLIT_K=splits,
                LINES=next_pow2(-(-k_split // line_elems)))  # fmt: skip
    return LinearLaunch((*tiles, splits), k_split, meta)
