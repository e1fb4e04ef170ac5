"""Paged verify attention: the launch paths the default cases may miss (issue 5 rework).

- full prefix tiles (no masks, page ids carried one tile ahead) next to a partial tail tile,
  for several BLOCK_N, with prefixes ending on, just after and just before a tile edge;
- 128-row tiles (an 8-warp explicit config) with several row tiles AND several splits, so
  the grid order (split * m_tiles + m_tile in program_id 0) is checked end to end;
- the explicit config / waves overrides, and the planning helpers in pure Python.
Kernel tests run in the interpreter (TRITON_INTERPRET=1) or on CUDA, like test_kernels_paged.
"""

from __future__ import annotations

import pytest
import torch

from splitflash.kernels.kv_splits import SPLIT_ALIGN, default_waves, plan_launch, plan_splits
from splitflash.kernels.tuning import autotune_prune, draft_pick, measured_pick, pick_block_m
from tests.unit.kernel_env import needs_triton
from tests.unit.test_kernels_paged import check_against_oracle, make_case

F32 = torch.float32

# (kv_lens, q_lens, H, H_KV, D, page, config (BLOCK_N, warps, stages), splits)
PATH_CASES = [
    # prefix 128 = 2 full 64-key tiles exactly: no tail tile, block keys in their own tile
    ([135], [7], 4, 2, 16, 16, (64, 4, 1), 1),
    # prefix 293 over 3 splits of 128: full tiles in every split, tail [288, 293) in the last
    ([300], [7], 4, 2, 16, 16, (32, 4, 1), 3),
    # prefix 129: one key past a tile edge; 128-key tiles, page size not dividing BLOCK_N
    ([145], [16], 8, 2, 16, 3, (128, 4, 1), 2),
    # no prefix at all (kv_len == q_len) and a request whose splits lie past its kv_len
    ([16, 600], [16, 1], 4, 1, 16, 16, (64, 4, 1), 4),
    # head dim 24 < BLOCK_D 32: the full-tile loads keep the head-dim mask
    ([231], [5], 6, 3, 24, 16, (32, 4, 1), 2),
]
PATH_IDS = [f"kv{c[0]}-q{c[1]}-d{c[4]}-p{c[5]}-bn{c[6][0]}-s{c[7]}" for c in PATH_CASES]


@needs_triton
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,config,splits", PATH_CASES,
                         ids=PATH_IDS)  # fmt: skip
def test_full_and_tail_tiles(kv_lens, q_lens, heads, kv_heads, dim, page, config, splits):
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, F32, seed=sum(kv_lens))
    check_against_oracle(case, F32, config=config, num_splits=splits)


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
def test_wide_row_tiles_with_splits(splits):
    """q_len 64 x G 4 = 256 rows: an 8-warp config gives 128-row tiles, 2 per request; the
    second request (5 x 4 = 20 rows) leaves its second tile idle (early return). Split and
    tile counts share a factor, so a wrong program_id(0) decomposition cannot pass."""
    case = make_case([500, 97], [64, 5], 8, 2, 16, 16, F32, seed=7)
    check_against_oracle(case, F32, config=(32, 8, 1), num_splits=splits)


@needs_triton
def test_many_row_tiles_split_fastest_grid():
    """4 row tiles of 64 (4-warp config) x 6 splits: program_id(0) = split * 4 + m_tile."""
    case = make_case([700], [64], 4, 1, 16, 16, F32, seed=3, chain=True)
    check_against_oracle(case, F32, config=(64, 4, 1), num_splits=6)


@needs_triton
def test_waves_override_matches_default():
    from splitflash.kernels.paged_attention import paged_attention_triton

    case = make_case([1000, 300], [16, 9], 8, 2, 16, 16, F32, seed=11)
    base = paged_attention_triton(**case)
    for waves in (1, 8):
        got = paged_attention_triton(**case, waves=waves)
        torch.testing.assert_close(got, base, rtol=1e-4, atol=1e-5)


def test_plan_splits_legacy_default_unchanged():
    # No waves: ~2 programs per SM rounded up (the rule the drafter and q_len 1 use).
    assert plan_splits(131072, 64, 132).num_splits == 5
    assert plan_splits(32768, 8, 132).num_splits == 32  # 33 wanted, 1024-key splits
    assert plan_splits(100, 1, 132).num_splits == 1  # never below SPLIT_ALIGN keys


@pytest.mark.parametrize("waves,base,want", [(2, 64, 4), (1, 64, 2), (1, 128, 1), (1, 256, 1),
                                             (8, 8, 132), (0.5, 8, 8)])  # fmt: skip
def test_plan_splits_waves_never_overfill(waves, base, want):
    plan = plan_splits(1 << 20, base, 132, waves=waves)
    assert want - 1 <= plan.num_splits <= want  # rounding splits up to SPLIT_ALIGN keys
    assert plan.num_splits * base <= max(base, waves * 132)
    assert plan.split_len % SPLIT_ALIGN == 0
    assert plan.num_splits * plan.split_len >= 1 << 20


def test_plan_splits_override_and_cap():
    assert plan_splits(4096, 8, 132, num_splits=3, waves=8).num_splits == 3
    assert plan_splits(1000, 1, 132, waves=8).num_splits == -(-1000 // SPLIT_ALIGN)


def test_pick_block_m_and_prune():
    import triton

    assert pick_block_m(4, wide_ok=True) == 16
    assert pick_block_m(64, wide_ok=True) == 64
    assert pick_block_m(256, wide_ok=False) == 64
    assert pick_block_m(256, wide_ok=True) == 128
    configs = [triton.Config({"BLOCK_N": 64}, num_warps=w, num_stages=3) for w in (4, 8)]
    assert [c.num_warps for c in autotune_prune(configs, {}, BLOCK_M=128)] == [8]
    assert autotune_prune(configs, {}, BLOCK_M=64) == configs
    assert autotune_prune(configs[:1], {}, BLOCK_M=128) == configs[:1]  # never empty
    wide_n = [triton.Config({"BLOCK_N": n}, num_warps=4, num_stages=3) for n in (64, 128)]
    assert [c.kwargs["BLOCK_N"] for c in autotune_prune(wide_n, {}, D=128)] == [64]
    assert autotune_prune(wide_n, {}, D=64) == wide_n  # 128-key tiles fit narrow heads
    assert autotune_prune(wide_n[1:], {}, D=128) == wide_n[1:]


def test_measured_picks_by_head_dim():
    hopper = (9, 0)
    assert measured_pick(hopper, 1, 64) == (128, 4, 3)  # the default model's heads
    assert measured_pick(hopper, 1, 128) == measured_pick(hopper, 1, None) == (64, 4, 3)
    assert measured_pick((8, 0), 1, 64) is None  # no measured pick off Hopper


@pytest.mark.parametrize("q_len", [1, 2, 7, 16, 17, 33, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_hopper_never_autotunes_and_tiles_fit_the_pick(q_len, head_dim, group):
    """Every verify shape has a measured pick on Hopper (autotuning inside a live step
    stalled it ~1.1 s), and an 8-warp pick only where the launch tiles 128 rows."""
    rows = q_len * group
    pick = measured_pick((9, 0), q_len, head_dim, rows)
    assert pick is not None
    plan = plan_launch(torch.device("cpu"), rows, q_len, 1, 3, 4096, config=pick)
    assert (plan.block_m == 128) == (pick[1] >= 8)
    assert plan.block_m >= min(rows, 64)


def test_default_waves_by_tile():
    assert default_waves(1, 16) is None  # legacy rule for decode
    assert default_waves(16, 64) == default_waves(2, 64) == default_waves(40, 64) == 2.0
    assert default_waves(64, 128) == 1.0  # one 8-warp program per SM
    # Hopper, heads wider than 64 dims: 1.5 for q 1 and 64-row tiles (H100 sweeps)
    assert default_waves(1, 16, 128, "hopper") == default_waves(16, 64, 128, "hopper") == 1.5
    assert default_waves(64, 128, 128, "hopper") == 1.0
    assert default_waves(1, 16, 64, "hopper") is None and default_waves(16, 64, 64, "hopper") == 2
    assert default_waves(1, 16, 128) is None  # unmeasured sets keep the rules above
    # 64-row tiles whose splits at 2 waves would be long keep 2; q 1 takes 1.5 regardless
    assert default_waves(16, 64, 128, "hopper", long_splits=True) == 2.0
    assert default_waves(1, 16, 128, "hopper", long_splits=True) == 1.5


def test_draft_attention_has_a_pick_on_hopper_only():
    """The drafter never autotunes on Hopper (a new context bucket stalled a live draft step
    ~1 s); a 4-stage pick only where a K+V stage is small enough (narrow heads)."""
    assert draft_pick((9, 0), 64) == (64, 4, 4)
    assert draft_pick((9, 0), 128)[2] <= 3
    assert draft_pick((8, 0), 64) is None


@needs_triton
@pytest.mark.parametrize("block_m", [16, 32])
def test_fewer_rows_per_program_than_the_request_has(block_m):
    """block_m override (sweeps): 16 x 4 = 64 rows in 4 / 2 row tiles, each re-reading the
    K/V of its splits; a tree block and a decode row in one launch."""
    from splitflash.kernels.kv_splits import plan_launch

    lp = plan_launch(torch.device("cpu"), 64, 16, 2, 2, 900, block_m=block_m)
    assert (lp.block_m, lp.m_tiles) == (block_m, 64 // block_m)
    case = make_case([900, 77], [16, 1], 8, 2, 16, 16, F32, seed=block_m)
    check_against_oracle(case, F32, config=(32, 4, 1), num_splits=3, block_m=block_m)


@pytest.mark.parametrize("block_m,config", [(8, None), (48, None), (128, (64, 4, 3))])
def test_block_m_override_is_checked(block_m, config):
    from splitflash.kernels.kv_splits import plan_launch

    with pytest.raises(ValueError, match="block_m must be 16, 32 or 64"):
        plan_launch(torch.device("cpu"), 64, 16, 1, 2, 900, config=config, block_m=block_m)
