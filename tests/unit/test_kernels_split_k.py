"""Split-K launches of the small-M linear kernels (kernels/split_k.py): against the fp64
oracles (DESIGN.md 9), the same bits launch after launch (the partials are summed in split
order whoever arrives last), arrival counters left at zero, and the split plan."""

from __future__ import annotations

import pytest
import torch

from splitflash.kernels import split_k
from splitflash.kernels.linear_tiles import plan_launch
from tests.unit.kernel_env import DEVICE, needs_gpu, needs_triton
from tests.unit.test_kernels_fused_linear import (
    EPS,
    make_case,
    run_linear_residual,
    run_norm_linear,
)

# (M, K, N, splits): the default model's layers (576 / 1536 inputs in 64- / 256-wide K steps:
# 9 and 6 steps), a K that ends inside a step (100 = 64 + 36), more splits asked than steps
# (K 64: one step, so no split), two row tiles (M 32).
SPLIT_CASES = [(16, 576, 96, 3), (1, 576, 80, 4), (7, 1536, 40, 6), (5, 100, 17, 2),
               (16, 64, 32, 4), (32, 576, 48, 2), (16, 576, 64, 16)]  # fmt: skip
SPLIT_IDS = ["x".join(map(str, c)) for c in SPLIT_CASES]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def counters_zero() -> bool:
    return not split_k.arrival_counters(torch.device(DEVICE)).any().item()


@needs_triton
@DTYPES
@pytest.mark.parametrize("m,k,n,splits", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_launches_match_oracle(m, k, n, splits, dtype):
    for swiglu in (False, True):
        run_norm_linear(dtype, m, k, n, swiglu, split_k=splits)
    run_linear_residual(dtype, m, k, n, split_k=splits)
    assert counters_zero()


@needs_triton
def test_split_launch_is_split_and_repeats_its_bits():
    """The plan really splits (else the oracle tests above prove nothing new), and two
    launches give the same bits, also after a launch of another tile count."""
    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton

    x, norm_w, w, res = make_case(16, 576, 96, torch.float32, seed=5)
    launch = plan_launch(w, 16, 96, 576, None, False, None, 3)
    assert launch.grid == (6, 1, 3) and launch.k_split == 192  # 16-column tiles, 3 K steps
    first = norm_linear_triton(x, norm_w, EPS, w, 48, split_k=3)
    other = plan_launch(w, 16, 40, 128, None, False, None, 4)
    assert other.grid == (3, 1, 2)  # a split launch of other tiles on the same counters
    linear_residual_triton(x[:, :128].contiguous(), w[:40, :128], res[:, :40], split_k=4)
    assert torch.equal(first, norm_linear_triton(x, norm_w, EPS, w, 48, split_k=3))
    assert counters_zero()


def test_split_plan(monkeypatch):
    dev = torch.device("cpu")
    # A cap: that many splits, each a whole number of K steps, none empty.
    assert split_k.plan_splits(576, 64, 36, dev, 3) == (3, 192)
    assert split_k.plan_splits(576, 64, 36, dev, 4) == (3, 192)  # 9 steps: 3 + 3 + 3
    assert split_k.plan_splits(576, 64, 36, dev, 2) == (2, 320)  # 5 + 4 steps
    assert split_k.plan_splits(100, 64, 2, dev, 8) == (2, 64)  # the last split holds 36
    assert split_k.plan_splits(64, 64, 2, dev, 8) == (1, 64)  # one step: nothing to split
    assert split_k.plan_splits(2048, 16, 1, dev, 99)[0] == split_k.MAX_SPLITS
    assert split_k.plan_splits(576, 64, split_k.COUNTERS + 1, dev, 4) == (1, 576)
    # Auto: enough splits for one program per SM; none on CPU, none past one wave.
    assert split_k.plan_splits(576, 64, 36, dev, None) == (1, 576)
    monkeypatch.setattr(split_k, "device_facts", lambda index: ((9, 0), 132))
    monkeypatch.setattr(split_k, "arrival_counters", lambda device: torch.zeros(1))
    gpu = torch.device("cuda", 0)
    assert split_k.plan_splits(1536, 256, 18, gpu, None) == (6, 256)  # down: 108 programs
    assert split_k.plan_splits(2048, 64, 60, gpu, None) == (2, 1024)
    assert split_k.plan_splits(1536, 256, 96, gpu, None) == (1, 1536)  # 96 tiles: no 2nd wave
    # Short K loops are not split unless asked (o_proj and qkv of the default model).
    assert split_k.plan_splits(576, 64, 36, gpu, None) == (1, 576)
    assert split_k.plan_splits(576, 64, 36, gpu, 3) == (3, 192)
    # Without counters (a capture before any eager launch): no split.
    monkeypatch.setattr(split_k, "arrival_counters", lambda device: None)
    assert split_k.plan_splits(1536, 256, 18, gpu, None) == (1, 1536)


def test_only_fast_16_row_launches_split(monkeypatch):
    w = torch.zeros(96, 576)
    monkeypatch.delenv("SPLITFLASH_LINEAR_SPLIT_K", raising=False)
    assert plan_launch(w, 16, 96, 576, None, False, None, None).grid[2] == 1  # off by default
    assert plan_launch(w, 16, 96, 576, None, False, None, split_k.AUTO).grid[2] == 1  # CPU
    assert plan_launch(w, 16, 96, 576, None, False, None, 3).grid == (6, 1, 3)
    # Batch-invariant launches keep one K order whatever the batch; 64-row tiles (M > 32)
    # have programs enough.
    assert plan_launch(w, 16, 96, 576, None, True, None, 3).grid[2] == 1
    assert plan_launch(w, 40, 96, 576, None, False, None, 3).grid[2] == 1


def test_split_setting(monkeypatch):
    monkeypatch.delenv("SPLITFLASH_LINEAR_SPLIT_K", raising=False)
    assert split_k.split_k_cap() == 1  # off unless asked for
    for text, want in (("", 1), ("auto", None), ("AUTO", None), ("1", 1), ("0", 1), ("6", 6)):
        monkeypatch.setenv("SPLITFLASH_LINEAR_SPLIT_K", text)
        assert split_k.split_k_cap() == want
    monkeypatch.setenv("SPLITFLASH_LINEAR_SPLIT_K", "many")
    with pytest.raises(ValueError, match="SPLITFLASH_LINEAR_SPLIT_K.*'many'"):
        split_k.split_k_cap()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,k,n,splits", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_launches_match_oracle_bf16_gpu(m, k, n, splits):
    for swiglu in (False, True):
        run_norm_linear(torch.bfloat16, m, k, n, swiglu, split_k=splits)
    run_linear_residual(torch.bfloat16, m, k, n, split_k=splits)
    assert counters_zero()


@pytest.mark.gpu
@needs_gpu
def test_split_launch_in_a_cuda_graph_replays_exactly():
    """Replays reuse the counters (each launch leaves them at zero) and the workspace."""
    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton

    x, norm_w, w, res = make_case(16, 1536, 576, torch.bfloat16, seed=2)  # w [576, 1536]
    w_up = torch.cat([w, w.flip(0)])[:1024, :576].contiguous()  # SwiGLU [2 x 512, 576]

    def step():
        act = norm_linear_triton(x[:, :576], norm_w[:576], EPS, w_up, 512, split_k=3)
        return linear_residual_triton(torch.cat([act, act, act], 1), w, res, split_k=6)

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert counters_zero()
