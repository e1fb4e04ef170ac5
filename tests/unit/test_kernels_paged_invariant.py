"""Batch-invariant paged attention (kernels/paged_attention_invariant.py).

Two oracles: the fp64 dense-mask oracle (err <= 2 * err(torch reference) + atol, DESIGN.md
9), and the kernel against ITSELF: the row of position p must come out with the same bits in
a 16-token verify block, in a one-token decode step at p, and next to another request, with
any number of programs along the keys. That equality is what makes greedy speculative
output bit-identical to target-only output (TargetModel.batch_invariant).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from splitflash.kernels import split_combine
from splitflash.kernels.paged_attention_invariant import (
    GRANULE,
    GRANULE_LARGE,
    GRANULE_SMALL,
    MID_SPAN,
    SMALL_SPAN,
    _granule_count,
    _granule_start,
    granule_count,
    granule_start,
    paged_attention_invariant,
    plan_programs,
)
from splitflash.kernels.paged_attention_ref import paged_attention_ref
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton
from tests.unit.test_kernels_paged import CASES, IDS, as_fp64, dense_oracle, make_case


def test_granules_tile_the_keys_at_fixed_positions():
    assert [granule_start(g) for g in (0, 1, 15, 16, 17)] == [0, 256, 3840, 4096, 4096 + GRANULE]
    n_mid = 16 + (MID_SPAN - SMALL_SPAN) // GRANULE  # 76
    assert granule_start(n_mid - 1) == MID_SPAN - GRANULE and granule_start(n_mid) == MID_SPAN
    assert granule_start(n_mid + 1) == MID_SPAN + GRANULE_LARGE
    lens = (1, 256, 257, SMALL_SPAN, SMALL_SPAN + 1, MID_SPAN, MID_SPAN + 1)
    assert [granule_count(n) for n in lens] == [1, 1, 2, 16, 17, n_mid, n_mid + 1]
    assert granule_count(185_000) == n_mid + -(-(185_000 - MID_SPAN) // GRANULE_LARGE) == 135
    for n in (1, 300, 4096, 4097, 70_000, 185_000):  # the last granule holds key n - 1
        g = granule_count(n) - 1
        assert granule_start(g) < n <= granule_start(g + 1)
    # Programs along the keys: about 4 per SM overall, at most one per granule.
    assert plan_programs(135, 3, 132) == 135 and plan_programs(300, 3, 132) == 176
    assert plan_programs(3, 1, 132) == 3 and plan_programs(50, 1000, 132) == 1


@triton.jit
def _map_kernel(starts_ptr, counts_ptr, keys_ptr, n_keys, GS: tl.constexpr,
                SS: tl.constexpr, G: tl.constexpr, MS: tl.constexpr, GL: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK)
    tl.store(starts_ptr + i, _granule_start(i, GS, SS, G, MS, GL))
    keys = tl.load(keys_ptr + i, mask=i < n_keys, other=0)
    tl.store(counts_ptr + i, _granule_count(keys, GS, SS, G, MS, GL), mask=i < n_keys)


@needs_triton
def test_device_granule_map_is_the_hosts():
    """The kernel's granule starts and counts (all three sizes; the count also shares the
    granules out between programs) are the ones the launch plans with."""
    block = 256
    keys = sorted({0, 1, 255, 256, 257, SMALL_SPAN - 1, SMALL_SPAN, SMALL_SPAN + 1,
                   MID_SPAN - 1, MID_SPAN, MID_SPAN + 1, MID_SPAN + 2048, 185_000}
                  | set(range(0, 300_000, 1500)))  # fmt: skip
    starts = torch.empty(block, dtype=torch.int32, device=DEVICE)
    counts = torch.empty(len(keys), dtype=torch.int32, device=DEVICE)
    key_t = torch.tensor(keys, dtype=torch.int32, device=DEVICE)
    _map_kernel[(1,)](starts, counts, key_t, len(keys), GRANULE_SMALL, SMALL_SPAN, GRANULE,
                      MID_SPAN, GRANULE_LARGE, BLOCK=block)  # fmt: skip
    assert starts.tolist() == [granule_start(g) for g in range(block)]
    assert counts.tolist() == [granule_count(k) for k in keys]


def test_fewer_programs_than_granules_share_out_the_keys():
    """With fewer programs than granules, program p takes granules [count(p S / P),
    count((p+1) S / P)) of the span S: together every granule exactly once, and no program
    more than one granule over an equal share of the keys."""
    for kv_len, n_prog in ((32768, 22), (131072, 22), (185_000, 100), (300, 1), (70_000, 3)):
        n_gran = granule_count(kv_len)
        span = granule_start(n_gran)
        bounds = [granule_count(p * span // n_prog) for p in range(n_prog + 1)]
        assert bounds[0] == 0 and bounds[-1] == n_gran and bounds == sorted(bounds)
        for lo, hi in itertools.pairwise(bounds):
            assert granule_start(hi) - granule_start(lo) <= span / n_prog + GRANULE_LARGE


# fp16 skips the two slowest interpreter cases (~10 s each); fp32 runs every case.
LIGHT = [c for c in CASES if sum(c[0]) * max(c[1]) < 20_000]


@needs_triton
@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, torch.float32) for c in CASES] + [(c, torch.float16) for c in LIGHT],
    ids=[f"{i}-fp32" for i in IDS] + [f"{IDS[CASES.index(c)]}-fp16" for c in LIGHT],
)
def test_matches_fp64_oracle(case, dtype):
    kv_lens, q_lens, heads, kv_heads, dim, page, _ = case
    c = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=3)
    want = dense_oracle(c)
    got = paged_attention_invariant(**c)
    assert got.dtype == dtype and got.shape == c["q"].shape
    low = paged_attention_ref(**c)
    ref_err = (low.double().cpu() - want).abs().max().item()
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= 2 * ref_err + ATOL[dtype], (err, ref_err)
    torch.testing.assert_close(paged_attention_ref(**as_fp64(c)).cpu(), want)


@needs_triton
def test_combine_over_several_chunks_matches_fp64_oracle(monkeypatch):
    """The combine's chunks (in order, each a fixed-shape sum): 17 granules in chunks of 16
    here (the shipped chunk at D 64 is 64 granules: 185k keys take three)."""
    monkeypatch.setattr(split_combine, "COMBINE_ELEMS", 16 * 32)  # 16 granules per chunk at D 32
    c = make_case([SMALL_SPAN + 100, 40], [16, 3], 4, 2, 32, 16, torch.float32, seed=5)
    assert granule_count(SMALL_SPAN + 100) == 17
    want = dense_oracle(c)
    err = (paged_attention_invariant(**c).double().cpu() - want).abs().max().item()
    ref_err = (paged_attention_ref(**c).double().cpu() - want).abs().max().item()
    assert err <= 2 * ref_err + ATOL[torch.float32], (err, ref_err)


def _pick(case: dict, rows: list[int], req: int, kv_len: int) -> dict:
    """A launch of request `req`'s rows `rows` (a chain ending at kv_len) on the same pages."""
    n = len(rows)
    anc = [(1 << (i + 1)) - 1 for i in range(n)]
    return dict(case, q=case["q"][rows], page_table=case["page_table"][req : req + 1],
                kv_lens=torch.tensor([kv_len], dtype=torch.int32, device=DEVICE),
                cu_q=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                anc_bits=torch.tensor(anc, dtype=torch.int64, device=DEVICE))  # fmt: skip


def check_rows_invariant(prefix: int, dtype, rows: tuple[int, ...], heads=6, kv_heads=2,
                         dim=32, page=16):  # fmt: skip
    """A 16-token chain block after `prefix` keys, launched as one verify block, as decode
    steps of its `rows`, and as a decode step batched with a longer request: equal bits."""
    q_len, other = 16, prefix + 700
    c = make_case([prefix + q_len, other], [q_len, 1], heads, kv_heads, dim, page, dtype,
                  seed=1, chain=True)  # fmt: skip
    block = paged_attention_invariant(**_pick(c, list(range(q_len)), 0, prefix + q_len))
    one_program = paged_attention_invariant(**_pick(c, list(range(q_len)), 0, prefix + q_len),
                                            programs=1)  # fmt: skip
    assert torch.equal(block, one_program)
    for i in rows:
        step = paged_attention_invariant(**_pick(c, [i], 0, prefix + i + 1))
        assert torch.equal(step[0], block[i]), f"row {i}: decode step != verify block"
    # The last row's decode step next to the other request (more keys, so more granules and
    # more programs in the launch).
    i = rows[-1]
    batch = dict(c, q=torch.cat([c["q"][i : i + 1], c["q"][q_len:]]),
                 kv_lens=torch.tensor([prefix + i + 1, other], dtype=torch.int32,
                                      device=DEVICE),
                 cu_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                 anc_bits=torch.ones(2, dtype=torch.int64, device=DEVICE))  # fmt: skip
    assert torch.equal(paged_attention_invariant(**batch)[0], block[i])


@needs_triton
@pytest.mark.parametrize("prefix", [3, 255, SMALL_SPAN - 1], ids=lambda p: f"prefix{p}")
def test_a_row_has_the_same_bits_in_any_launch(prefix):
    """fp32 in the interpreter, row 0 only: the interpreter's tl.dot is numpy's BLAS, whose
    result for a row depends on where it sits in the tile (a row at 45 of 64 differs from
    the same row at 0), which no GPU MMA does; the bf16 test below checks every row. Row 0
    sees `prefix` + 1 keys while the block's launch reads 15 more: past a tile (3), past a
    granule (255) and past the small granules (SMALL_SPAN - 1), so the two launches differ
    in tiles, granule count and combine length."""
    check_rows_invariant(prefix, torch.float32, rows=(0,))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [250, SMALL_SPAN - 7, 40_000, 131_000])
def test_a_row_has_the_same_bits_in_any_launch_bf16(prefix):
    check_rows_invariant(prefix, torch.bfloat16, tuple(range(16)), heads=9, kv_heads=3, dim=64)
