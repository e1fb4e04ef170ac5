"""How one paged-attention launch splits the KV axis (flash-decoding) and tiles its rows:
the split-count rule, the default programs per SM by tile, and `plan_launch`, which the
kernel and the benchmarks share so a timing is labelled with what ran."""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitflash.kernels.tuning import (
    INTERPRETER_CONFIG,
    WIDE_M_MIN_ROWS,
    WIDE_M_MIN_WARPS,
    WIDE_M_SETS,
    WIDE_N_MAX_HEAD_DIM,
    TileConfig,
    config_set_for,
    device_facts,
    interpreter_active,
    measured_pick,
    pick_block_m,
)

# Keys per split are a multiple of this, so every tile config divides a split evenly
# except at the very end of a request.
SPLIT_ALIGN = 128


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int  # programs along the KV axis per (request, kv head, row tile)
    split_len: int  # keys per split, a multiple of SPLIT_ALIGN


# Default `waves` (programs per SM, see plan_splits) by tile, measured on the H200
# (bench/results/kernel_sweep_h200_quick.json, G 4, D 128, bf16):
# - q 1 (16-row tiles): None = the legacy rule, 0.93-0.97 of copy bandwidth.
# - 64-row tiles (q 2..16, and q up to 64 while q * G < 128 rows): 2. The 64-row configs fit
#   2 programs per SM, so the launch is one resident wave with no tail: 0.67-0.95 of copy
#   against 0.62-0.84 at 1 and 0.55-0.94 at 4 (q 16); at q 64, 0.31 against 0.21 at 1.
# - 128-row tiles (8 warps): 1. One 256-thread program per SM: 0.30-0.31 of copy at q 64.
# Heads wider than WIDE_N_MAX_HEAD_DIM (D 128: the (64, 4, 3) picks) on Hopper take 1.5 for
# q 1, and for 64-row tiles whose splits at 2 would be short (<= WIDE_HEADS_MAX_SPLIT keys).
# Measured on an H100, side by side, L2 cold (bench/RESULTS.md "Session 33", G 4, D 128):
# q 1 at batch 1 and 8, 8k-262k keys: 0.93-0.97 of SDPA against 0.84-0.97 for the legacy
# rule (8k, batch 1: 0.57 of copy against 0.51); q 16 at batch 1, 8k / 32k: 0.46 / 0.75 of
# copy against 0.36 / 0.69 at 2. Where the splits at 2 are long (batch 8 x 128k / 262k q 16:
# 32k-key splits) 2 stays: 1.5 lost 1.7-1.9% there. Heads of <= 64 dims (the default
# model's (128, 4, 3) picks) keep the rules above: there 2 beat 1.5 at 32k q 16 (0.56
# against 0.50) and tied at 185k. Not yet swept on the H200 with L2-cold inputs.
WAVES_Q1: float | None = None
WAVES_64_ROWS = 2.0
WAVES_128_ROWS = 1.0
WAVES_WIDE_HEADS: dict[str, float] = {"hopper": 1.5}  # per config set (tuning.CONFIG_SETS)
WIDE_HEADS_MAX_SPLIT = 4096


def default_waves(
    max_q_len: int,
    block_m: int,
    head_dim: int | None = None,
    set_name: str = "generic",
    long_splits: bool = False,
) -> float | None:
    """Programs per SM for a launch of this q_len, row tile and head dim on a GPU of this
    config set (see WAVES_*). long_splits: a 64-row launch at WAVES_64_ROWS would give
    splits of more than WIDE_HEADS_MAX_SPLIT keys."""
    if block_m >= WIDE_M_MIN_ROWS:
        return WAVES_128_ROWS
    wide = head_dim is not None and head_dim > WIDE_N_MAX_HEAD_DIM
    if wide and set_name in WAVES_WIDE_HEADS and (max_q_len <= 1 or not long_splits):
        return WAVES_WIDE_HEADS[set_name]
    return WAVES_Q1 if max_q_len <= 1 else WAVES_64_ROWS


def plan_splits(
    max_kv_len: int,
    base_programs: int,
    sm_count: int,
    num_splits: int | None = None,
    waves: float | None = None,
) -> SplitPlan:
    """Choose how many KV splits to launch.

    Decode has few (request, head) programs and long KV: without splitting, a handful of SMs
    would stream all the KV while the rest idle. Never split below SPLIT_ALIGN keys (the
    combine pass would cost more than it saves). num_splits (if given) wins; else
    - waves None (default): the legacy rule, ~2 programs per SM rounded UP (used by the
      drafter and q_len 1, measured there);
    - waves w: at most w programs per SM (rounded DOWN, at least one split), so when w
      programs fit on an SM at once the whole launch is one wave with no tail.
    """
    max_kv_len = max(1, int(max_kv_len))
    max_splits = -(-max_kv_len // SPLIT_ALIGN)
    base_programs = max(1, int(base_programs))
    if num_splits is None:
        if waves is None:
            num_splits = -(-2 * sm_count // base_programs)
        else:
            num_splits = int(float(waves) * sm_count // base_programs)
    num_splits = max(1, min(int(num_splits), max_splits))
    split_len = -(-max_kv_len // num_splits)
    split_len = -(-split_len // SPLIT_ALIGN) * SPLIT_ALIGN
    return SplitPlan(num_splits=-(-max_kv_len // split_len), split_len=split_len)


# Pretend SM count off-GPU, so interpreter runs exercise several splits.
_INTERPRETER_SMS = 4


@dataclass(frozen=True)
class LaunchPlan:
    capability: tuple[int, int]  # (0, 0): interpreter / CPU
    config: TileConfig | None  # (BLOCK_N, warps, stages); None: autotune
    block_m: int  # query rows per program
    m_tiles: int  # row tiles per request
    splits: SplitPlan


def env_config() -> TileConfig | None:
    """SPLITFLASH_KERNEL_CONFIG=BLOCK_N,warps,stages: one tile config instead of autotuning
    (one compile per shape: for time-boxed GPU runs). Unset: autotune."""
    text = os.environ.get("SPLITFLASH_KERNEL_CONFIG", "").strip()
    if not text:
        return None
    try:
        block_n, warps, stages = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"SPLITFLASH_KERNEL_CONFIG must be BLOCK_N,warps,stages (e.g. 64,4,3), got {text!r}"
        ) from None
    return block_n, warps, stages


def plan_launch(
    device, rows: int, max_q_len: int, n_req: int, n_kv_heads: int, max_kv_len: int, *,
    config: TileConfig | None = None, num_splits: int | None = None,
    waves: float | None = None, head_dim: int | None = None, block_m: int | None = None,
) -> LaunchPlan:  # fmt: skip
    """Tile shape and split count of one paged-attention launch (device: a torch.device;
    rows = max_q_len * G). paged_attention_triton's own planning, public so benchmarks label
    what they time. waves None: default_waves. head_dim and rows pick measured configs.
    block_m (sweeps): query rows per program instead of pick_block_m's, 16 / 32 / 64, or 128
    with an 8-warp config; fewer rows than the request's re-read its K/V once per row tile."""
    interp = interpreter_active()
    if interp or device.type != "cuda":
        cap, sm_count = (0, 0), _INTERPRETER_SMS
    else:
        cap, sm_count = device_facts(device.index or 0)
    if config is None and interp:
        config = INTERPRETER_CONFIG
    if config is None:
        config = env_config()
    if config is None and not interp:
        config = measured_pick(cap, max_q_len, head_dim, rows)
    if config is not None:
        config = tuple(config)
        wide_ok = config[1] >= WIDE_M_MIN_WARPS
    else:  # autotuning: autotune_prune keeps only 8-warp configs for 128-row tiles
        wide_ok = config_set_for(cap) in WIDE_M_SETS
    if block_m is None:
        block_m = pick_block_m(rows, wide_ok)
    elif block_m not in (16, 32, 64, 128) or (block_m == 128 and not wide_ok):
        raise ValueError(f"block_m must be 16, 32 or 64 (128 with an 8-warp config), got {block_m}")
    m_tiles = -(-rows // block_m)
    base = n_req * m_tiles * n_kv_heads
    if waves is None:
        at_two = plan_splits(max_kv_len, base, sm_count, None, WAVES_64_ROWS).split_len
        waves = default_waves(max_q_len, block_m, head_dim, config_set_for(cap),
                              at_two > WIDE_HEADS_MAX_SPLIT)  # fmt: skip
    splits = plan_splits(max_kv_len, base, sm_count, num_splits, waves)
    return LaunchPlan(cap, config, block_m, m_tiles, splits)
