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
from dataclasses import dataclass
from functools import lru_cache

# (BLOCK_N, num_warps, num_stages): BLOCK_N = keys per inner-loop tile.
_TileConfig = tuple[int, int, int]

HOPPER_CONFIGS: tuple[_TileConfig, ...] = (
    (64, 4, 2),
    (64, 4, 3),
    (128, 4, 2),
    (128, 8, 3),
    (32, 4, 4),
)

# Reasoned from the hardware, not measured (see module docstring).
BLACKWELL_DC_CONFIGS: tuple[_TileConfig, ...] = (
    (64, 4, 3),
    (128, 4, 3),
    (128, 8, 4),
    (32, 4, 4),
)

# Reasoned from the hardware, not measured (see module docstring): ~100 KiB smem per SM.
BLACKWELL_RTX_CONFIGS: tuple[_TileConfig, ...] = (
    (32, 4, 2),
    (64, 4, 2),
    (64, 4, 3),
    (128, 4, 2),
)

# Anything else (Ampere, Ada, unknown): a small safe set.
GENERIC_CONFIGS: tuple[_TileConfig, ...] = ((64, 4, 2), (32, 4, 2))

# The interpreter runs one program at a time in numpy: one config, no autotuning.
INTERPRETER_CONFIG: _TileConfig = (32, 1, 1)

# Keys per split are a multiple of this, so every tile config divides a split evenly
# except at the very end of a request.
SPLIT_ALIGN = 128


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


CONFIG_SETS: dict[str, tuple[_TileConfig, ...]] = {
    "hopper": HOPPER_CONFIGS,
    "blackwell_dc": BLACKWELL_DC_CONFIGS,
    "blackwell_rtx": BLACKWELL_RTX_CONFIGS,
    "generic": GENERIC_CONFIGS,
}


def config_set_for(capability: tuple[int, int]) -> str:
    """Name of the config set (a key of CONFIG_SETS) for a compute capability."""
    return {9: "hopper", 10: "blackwell_dc", 12: "blackwell_rtx"}.get(capability[0], "generic")


def autotuned(kernel, set_name: str, key: list[str]):
    """kernel wrapped in Triton's autotuner over one architecture's config set."""
    import triton

    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w, s in CONFIG_SETS[set_name]
        ],
        key=key,
    )(kernel)


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


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int  # programs along the KV axis per (request, kv head, row tile)
    split_len: int  # keys per split, a multiple of SPLIT_ALIGN


def plan_splits(
    max_kv_len: int, base_programs: int, sm_count: int, num_splits: int | None = None
) -> SplitPlan:
    """Choose how many KV splits to launch.

    Decode has few (request, head) programs and long KV: without splitting, a handful of SMs
    would stream all the KV while the rest idle. Aim for ~2 waves of programs, but never
    split below SPLIT_ALIGN keys (the combine pass would cost more than it saves).
    """
    max_kv_len = max(1, int(max_kv_len))
    max_splits = -(-max_kv_len // SPLIT_ALIGN)
    if num_splits is None:
        want = -(-2 * sm_count // max(1, base_programs))
        num_splits = want
    num_splits = max(1, min(int(num_splits), max_splits))
    split_len = -(-max_kv_len // num_splits)
    split_len = -(-split_len // SPLIT_ALIGN) * SPLIT_ALIGN
    return SplitPlan(num_splits=-(-max_kv_len // split_len), split_len=split_len)
