"""Launch tuning shared by the attention kernels: config sets per GPU architecture, the
split-KV heuristic and the autotune key buckets.

Config sets are keyed by compute capability. The Hopper set (sm_90) is the one to measure on
the H200 lent here. The Blackwell sets (sm_100 datacenter, sm_120 RTX PRO 6000 class) are
REASONED FROM THE HARDWARE, NOT MEASURED: no Blackwell GPU was available. Reasoning:
- sm_100 (B200): 228 KiB shared memory per SM like Hopper, 148 SMs, higher HBM bandwidth, so
  the same tile shapes with one more pipeline stage to keep more loads in flight.
- sm_120 (RTX PRO 6000 / consumer Blackwell): ~100 KiB shared memory per SM, 188 SMs
  (RTX PRO 6000), GDDR7 at ~1.8 TB/s: smaller K/V tiles and fewer stages so a program
  fits twice per SM, more splits are affordable because there are more SMs.
"""

from __future__ import annotations

import os
from functools import lru_cache

# (BLOCK_N, num_warps, num_stages): BLOCK_N = keys per inner-loop tile.
TileConfig = tuple[int, int, int]

# Hopper (sm_90, 228 KiB smem/SM, 64K registers/SM). One K+V stage is BLOCK_N * D * 4 bytes
# (32 KiB at BLOCK_N 64, D 128, bf16). Offline sm_90a compiles of the paged kernel with
# triton 3.6 (G 4, D 128, bf16; registers/thread, smem -> programs per SM):
#   64-row tiles:  (64, 4, 3) 212 regs, 112 KiB -> 2/SM;  (64, 4, 4) 144 KiB -> 1/SM
#                  (32, 4, 3) 168 regs, 64 KiB -> 3/SM;   (32, 4, 4) 80 KiB -> 2/SM
#                  (64, 8, 3) 172 regs x 256 threads -> 1/SM; (32, 8, 3) 121 regs -> 2/SM
#   128-row tiles: (64, 8, 3) 198 regs, 128 KiB; (64, 8, 4) 160 KiB; (32, 8, 3) 157 regs,
#                  80 KiB: 1/SM each. At 4 warps they spill (568 B of stack).
#   BLOCK_N 128 spills at 4 warps and needs 208-224 KiB at 8: left out.
# num_stages s keeps s - 1 K/V tiles in flight per program (s = 2: load, then wait for it).
# (64, 4, 2) stays first: draft_attention launches the first entry when it must not autotune.
HOPPER_CONFIGS: tuple[TileConfig, ...] = (
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (32, 4, 3),
    (32, 4, 4),
    (64, 8, 3),  # 8 warps: the candidates for 128-row tiles (q_len 64), see pick_block_m
    (64, 8, 4),
    (32, 8, 3),
    (128, 4, 3),  # heads of <= 64 dims only (autotune_prune): spills at D 128, see above
)
# Widest head dim that may take 128-key tiles at 4 warps. At D 64 a K+V stage is 32 KiB and
# (128, 4, 3) streamed a 185k-key launch of the default model's shape at 0.73 / 0.81 of copy
# (q_len 16 / 1) against 0.72 / 0.75 for the shipped picks (bench.attn_floor --configs,
# bench/RESULTS.md).
WIDE_N_MAX_HEAD_DIM = 64

# Reasoned from the hardware, not measured (see module docstring).
BLACKWELL_DC_CONFIGS: tuple[TileConfig, ...] = (
    (64, 4, 3),
    (128, 4, 3),
    (128, 8, 4),
    (32, 4, 4),
)

# Reasoned from the hardware, not measured (see module docstring): ~100 KiB smem per SM.
BLACKWELL_RTX_CONFIGS: tuple[TileConfig, ...] = (
    (32, 4, 2),
    (64, 4, 2),
    (64, 4, 3),
    (128, 4, 2),
)

# Anything else (Ampere, Ada, unknown): a small safe set.
GENERIC_CONFIGS: tuple[TileConfig, ...] = ((64, 4, 2), (32, 4, 2))

# The interpreter runs one program at a time in numpy: one config, no autotuning.
INTERPRETER_CONFIG: TileConfig = (32, 1, 1)


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


CONFIG_SETS: dict[str, tuple[TileConfig, ...]] = {
    "hopper": HOPPER_CONFIGS,
    "blackwell_dc": BLACKWELL_DC_CONFIGS,
    "blackwell_rtx": BLACKWELL_RTX_CONFIGS,
    "generic": GENERIC_CONFIGS,
}


def config_set_for(capability: tuple[int, int]) -> str:
    """Name of the config set (a key of CONFIG_SETS) for a compute capability."""
    return {9: "hopper", 10: "blackwell_dc", 12: "blackwell_rtx"}.get(capability[0], "generic")


def autotuned(kernel, set_name: str, key: list[str], prune=None):
    """kernel wrapped in Triton's autotuner over one architecture's config set. prune:
    optional early_config_prune(configs, named_args, **meta) -> configs."""
    import triton

    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w, s in CONFIG_SETS[set_name]
        ],
        key=key,
        prune_configs_by={"early_config_prune": prune} if prune else None,
    )(kernel)


# Tiles of 128 query rows need 8 warps: a [128, 128] fp32 accumulator is 64 registers per
# thread at 256 threads but 128 at 4 warps (spills). Set to a huge value to disable them.
WIDE_M_MIN_ROWS = 128
WIDE_M_MIN_WARPS = 8
# Config sets whose autotuning may use 128-row tiles: Hopper only, where the 8-warp configs
# were checked to fit (the Blackwell sets are unmeasured; (128, 8, 4) there would not fit).
WIDE_M_SETS = ("hopper",)


def pick_block_m(rows: int, wide_ok: bool) -> int:
    """Query rows per program tile for a request with `rows` (query, group head) rows: all
    of them up to 64; 128 for >= WIDE_M_MIN_ROWS rows when an 8-warp config runs the launch
    (wide_ok). 128-row tiles halve the K/V re-reads and per-tile overhead of q_len 64 x G 4."""
    if wide_ok and rows >= WIDE_M_MIN_ROWS:
        return 128
    return min(max(16, next_pow2(rows)), 64)


def autotune_prune(configs, named_args, **meta):
    """early_config_prune for the attention kernels: 128-row tiles only with 8-warp configs,
    128-key tiles only for heads of <= WIDE_N_MAX_HEAD_DIM dims (never prunes to nothing)."""
    kept = configs
    if meta.get("BLOCK_M", 0) >= 128:
        kept = [c for c in kept if c.num_warps >= WIDE_M_MIN_WARPS] or kept
    if meta.get("D", 0) > WIDE_N_MAX_HEAD_DIM:
        kept = [c for c in kept if c.kwargs["BLOCK_N"] < 128] or kept
    return kept


@lru_cache(maxsize=16)
def device_facts(device_index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device; cached since it never changes."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


def kv_bucket(max_kv_len: int) -> int:
    """Autotune key bucket for the KV length: next power of two, at least 256, so a
    growing context re-tunes only log2(L) times."""
    return max(256, 1 << max(0, int(max_kv_len) - 1).bit_length())


def q_bucket(max_q_len: int) -> int:
    return 1 << max(0, int(max_q_len) - 1).bit_length()


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# Measured picks that replace autotuning, per config set and q_len bucket (a q_len takes the
# smallest bucket >= it). With a pick for every bucket a serving process never autotunes:
# autotuning inside a live step stalled it for ~1.1 s (9 configs timed; the first step of a
# new KV bucket or of a block cut short by max_tokens, bench/RESULTS.md "Session 24").
# H200 sweeps (bench/RESULTS.md "Paged verify/decode attention"):
# - q 1: (64, 4, 3) with the legacy split rule was the fastest config at every point of two
#   sweeps (B 1/8, kv 8k-185k, D 64/128), while autotuning's noisy timings picked (64, 4, 4)
#   and lost 3-5% of bandwidth.
# - q 16: (64, 4, 3) at waves 2 was the fastest or within 0.01 of copy of it at all six
#   points of the quick sweep and at the default model's shape.
# - q 64: (64, 8, 3) (128-row tiles) 0.30 / 0.31 of copy at batch 1 / 8 against 0.31 / 0.29
#   for (64, 4, 3); its 128-row tiles halve the K/V re-reads. Below 128 rows a 64-row tile
#   runs and takes the q 16 pick (8 warps on 64 rows lost: 0.50-0.64 against 0.67-0.92).
# At heads of <= WIDE_N_MAX_HEAD_DIM dims (the default model's 64), 128-key tiles: 38.2 vs
# 41.4 us (q 1) and 41.2 vs 43.6 us (q 16) per 185k-key launch (bench.attn_floor --configs).
MEASURED_PICKS: dict[str, dict[int, TileConfig]] = {
    "hopper": {1: (64, 4, 3), 16: (64, 4, 3), 64: (64, 8, 3)},
}
MEASURED_PICKS_NARROW_HEADS: dict[str, dict[int, TileConfig]] = {
    "hopper": {1: (128, 4, 3), 16: (128, 4, 3), 64: (64, 8, 3)},
}


def measured_pick(capability: tuple[int, int], max_q_len: int, head_dim: int | None,
                  rows: int | None = None) -> TileConfig | None:  # fmt: skip
    """The measured config replacing autotuning for this GPU, q_len and head dim, if any.
    rows (q_len * G): a wide-tile (8-warp) pick applies only at >= WIDE_M_MIN_ROWS rows;
    below, the launch tiles 64 rows and takes the next smaller bucket's pick."""
    picks = MEASURED_PICKS
    if head_dim is not None and head_dim <= WIDE_N_MAX_HEAD_DIM:
        picks = MEASURED_PICKS_NARROW_HEADS
    by_bucket = picks.get(config_set_for(capability), {})
    fits = sorted(b for b in by_bucket if b >= max_q_len)
    if not fits:
        return None
    pick = by_bucket[fits[0]]
    if pick[1] >= WIDE_M_MIN_WARPS and rows is not None and rows < WIDE_M_MIN_ROWS:
        narrower = [by_bucket[b] for b in sorted(by_bucket, reverse=True) if b < fits[0]]
        pick = next((c for c in narrower if c[1] < WIDE_M_MIN_WARPS), pick)
    return pick


# The drafter's block attention (kernels/draft_attention.py), per config set: one config for
# every context length, so a drafter never autotunes while serving (its autotune key holds
# the context's KV bucket: each new power of two stalled a live draft step ~1.0 s on the
# H200, bench/RESULTS.md "Session 24"). Heads of <= WIDE_N_MAX_HEAD_DIM dims, measured
# (`python -m bench.draft_attn_sweep`, the shipped drafter's shape, block 16, context 2k-185k
# and the 512-key window, batch 1 and 8): (64, 4, 4) is within 1.10x of each point's fastest
# config (within 1.03x at >= 8k and in the window), the smallest worst case of the set;
# (128, 4, 3) wins at 185k but is 1.17x in the window that two of three layers read.
# Wider heads: (64, 4, 3), REASONED from the paged kernel's D 128 sweeps (the same loop),
# not measured for the drafter: (64, 4, 4) needs 128 KiB there, one program per SM.
MEASURED_DRAFT_PICKS: dict[str, TileConfig] = {"hopper": (64, 4, 4)}
DRAFT_PICKS_WIDE_HEADS: dict[str, TileConfig] = {"hopper": (64, 4, 3)}


def draft_pick(capability: tuple[int, int], head_dim: int) -> TileConfig | None:
    """The draft-attention config for this GPU and head dim, or None (autotune)."""
    picks = MEASURED_DRAFT_PICKS if head_dim <= WIDE_N_MAX_HEAD_DIM else DRAFT_PICKS_WIDE_HEADS
    return picks.get(config_set_for(capability))
