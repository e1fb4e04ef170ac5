"""The drafter's Triton attention backend: same draft logits as torch `block_attention`
below, at and past the window (sliding + full layers, both causalities), reads bounded by
the window as the kernel itself counts them, and the automatic backend choice."""

from __future__ import annotations

import logging

import pytest
import torch

from splitflash.models.dflash import load_dflash
from splitflash.models.dflash.cache import (
    TORCH_ATTENTION,
    TRITON_ATTENTION,
    AttentionBackend,
    _announce,
    auto_attention_backend,
    triton_block_attention,
)
from tests.unit.kernel_env import CUDA, DEVICE, INTERPRET, needs_triton
from tests.unit.test_dflash_support import N_TARGET, cfg_dict, feats, make, public_checkpoint

W = 8  # cfg_dict's window: layers 0, 1 sliding, layer 2 full
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")  # the kernel even on CPU tensors


def twins(cfg, backend):
    """The same random drafter twice: torch attention and `backend`."""
    return tuple(make(cfg, attention_backend=b).to(DEVICE) for b in (TORCH_ATTENTION, backend))


def fill_both(drafters, n, chunks):
    f, states = feats(n, seed=n), []
    for d in drafters:
        state, pos = d.new_state(), 0
        for c in chunks:
            d.append_context(state, f[pos : pos + c], pos)
            pos += c
        states.append(state)
    return states


@needs_triton
@pytest.mark.parametrize("causal", [None, True], ids=["bidir", "causal"])
def test_triton_backend_matches_torch_logits(forced, causal):
    torch_d, triton_d = twins(cfg_dict(causal=causal), TRITON_ATTENTION)
    assert triton_d.policy_info()["attention_backend"] == "triton"
    # Below, at and past the window, several appends; one batch of requests of mixed lengths.
    lengths, chunks = [0, 3, W - 1, W, W + 1, 5 * W + 3], {5 * W + 3: [17, 1, 25]}
    pairs = [fill_both((torch_d, triton_d), n, chunks.get(n, [n] if n else [])) for n in lengths]
    anchors = [int(t) for t in torch.randint(0, 90, (len(lengths),))]
    want = torch_d.draft_batch([p[0] for p in pairs], anchors, lengths, 6)
    got = triton_d.draft_batch([p[1] for p in pairs], anchors, lengths, 6)
    torch.testing.assert_close(got, want, **TOL)
    for (s_torch, s_triton), n in zip(pairs, lengths, strict=True):
        assert s_triton.keys_read_last == s_torch.keys_read_last == [min(n, W - 1)] * 2 + [n]
    # A block smaller than trained, and one drafter of full layers only.
    s_torch, s_triton = pairs[-1]
    torch.testing.assert_close(
        triton_d.draft(s_triton, 5, 5 * W + 3, 2), torch_d.draft(s_torch, 5, 5 * W + 3, 2), **TOL
    )
    full = twins(cfg_dict(layer_types=("full_attention",) * 2, causal=causal), TRITON_ATTENTION)
    states = fill_both(full, 30, [11, 19])
    got, want = (d.draft(s, 9, 30) for d, s in zip(full[::-1], states[::-1], strict=True))
    torch.testing.assert_close(got, want, **TOL)


def kernel_counted_backend(log: list[int]) -> AttentionBackend:
    """TRITON_ATTENTION whose reported reads are the context keys the kernel LOADED."""

    def fn(q, ctx_k, ctx_v, n_ctx, window, blk_k, blk_v, causal):
        counted = torch.zeros(1, dtype=torch.int32, device=q.device)
        out, host = triton_block_attention(
            q, ctx_k, ctx_v, n_ctx, window, blk_k, blk_v, causal, keys_read=counted
        )
        log.append(host)
        return out, int(counted[0])

    return AttentionBackend("triton+count", fn, bounds_window_reads=True)


@needs_triton
@pytest.mark.parametrize("mult", [1, 4, 16])
def test_triton_sliding_reads_bounded_by_window(forced, mult):
    host: list[int] = []
    torch_d, counted_d = twins(cfg_dict(), kernel_counted_backend(host))
    n = mult * W
    s_torch, s_counted = fill_both((torch_d, counted_d), n, [3] * (n // 3) + [n % 3])
    got = counted_d.draft(s_counted, 5, n)
    assert s_counted.keys_read_last == host == [W - 1, W - 1, n]  # kernel count == host count
    assert s_counted.keys_read_by_kind() == {"sliding": W - 1, "full": n}
    assert all(rows <= W for rows in s_counted.cache_rows()[:2])
    torch.testing.assert_close(got, torch_d.draft(s_torch, 5, n), **TOL)


def test_backend_chosen_by_weights_device(tmp_path, caplog):
    assert auto_attention_backend("cuda") is TRITON_ATTENTION
    assert auto_attention_backend(torch.device("cpu")) is TORCH_ATTENTION
    _announce.cache_clear()
    with caplog.at_level(logging.INFO, logger="splitflash.dflash"):
        drafter = make()  # no backend given: weights on CPU -> torch
        assert drafter.backend is TORCH_ATTENTION
        assert drafter.policy_info()["attention_backend"] == "torch"
        drafter.draft(drafter.new_state(), 1, 0)
    chosen = [r for r in caplog.records if "attention backend" in r.getMessage()]
    assert len(chosen) == 1 and "torch" in chosen[0].getMessage()  # logged once
    explicit = make(attention_backend=TRITON_ATTENTION)
    assert explicit.backend is TRITON_ATTENTION  # an explicit backend wins over the device
    emb, head = torch.nn.Embedding(97, 64), torch.randn(97, 64)
    public_checkpoint(tmp_path)  # the service's path: load_dflash without a backend
    loaded = load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    assert loaded.backend is TORCH_ATTENTION and loaded._explicit_backend is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")
def test_cuda_drafter_picks_triton_and_matches_torch():
    cuda_d = make().cuda()
    torch_d = make(attention_backend=TORCH_ATTENTION).cuda()
    assert cuda_d.backend is TRITON_ATTENTION
    assert cuda_d.policy_info()["attention_backend"] == "triton"
    for n in (0, W - 1, W + 1, 16 * W):
        states = fill_both((torch_d, cuda_d), n, [n] if n else [])
        # fp32 on the GPU: the kernel's dots run in IEEE fp32 (no tf32).
        want, got = (d.draft(s, 3, n) for d, s in zip((torch_d, cuda_d), states, strict=True))
        torch.testing.assert_close(got, want, **TOL)
