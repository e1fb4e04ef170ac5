"""The drafter through the fused kernels (models/dflash/fused.py, kernels/head_norm_rope.py):
the per-head norm + RoPE kernel against its reference and fp64 (DESIGN.md 9), and the fused
drafter's context K/V and draft logits against the module path, which the dense-mask
reference drafter checks elsewhere (test_dflash.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from splitflash.kernels.head_norm_rope import head_norm_rope_ref
from splitflash.models.dflash import fused
from splitflash.models.dflash.layers import RMSNorm, apply_rope, rope_cos_sin
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton
from tests.unit.test_dflash_support import cfg_dict, feats, make

EPS = 1e-6
# (M, H, hd, width): one row, the default drafter's heads (9 / 3 of 64), many heads, a
# narrow head; width > H * hd: x is a slice of wider rows, as q / k of a joined qkv output.
CASES = [(1, 1, 16, 16), (7, 9, 64, 960), (16, 3, 64, 192), (5, 32, 128, 4200), (3, 3, 8, 40)]
IDS = ["x".join(map(str, c)) for c in CASES]


def make_case(m, h, hd, width, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, width, generator=gen) * (torch.rand(m, 1, generator=gen) * 6 + 0.1)
    rows = rows.to(dtype=dtype, device=DEVICE)
    x = rows[:, width - h * hd :].unflatten(-1, (h, hd))  # the last H * hd columns
    w = (0.5 + torch.rand(hd, generator=gen)).to(dtype=dtype, device=DEVICE)
    cos, sin = rope_cos_sin(torch.randint(0, 190_000, (m,), generator=gen), hd, 1e6, dtype)
    return x, w, cos.to(DEVICE), sin.to(DEVICE)


def oracle(x, w, cos, sin):
    x, w, cos, sin = (t.double().cpu() for t in (x, w, cos, sin))
    y = w * x / (x.square().mean(-1, keepdim=True) + EPS).sqrt()
    return apply_rope(y, cos, sin)


def check_kernel(m, h, hd, width, dtype):
    from splitflash.kernels.head_norm_rope import head_norm_rope_triton

    x, w, cos, sin = make_case(m, h, hd, width, dtype, seed=m * h + hd)
    assert not x.is_contiguous() or width == h * hd
    got = head_norm_rope_triton(x, w, EPS, cos, sin)
    low = head_norm_rope_ref(x, w, EPS, cos, sin)
    want = oracle(x, w, cos, sin)
    e_kernel = (got.double().cpu() - want).abs().max().item()
    e_low = (low.double().cpu() - want).abs().max().item()
    assert got.shape == low.shape and got.dtype == low.dtype
    assert e_kernel <= 2 * e_low + ATOL[dtype], (e_kernel, e_low)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,h,hd,width", CASES, ids=IDS)
def test_head_norm_rope_kernel_matches_oracle(m, h, hd, width, dtype):
    check_kernel(m, h, hd, width, dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,h,hd,width", CASES, ids=IDS)
def test_head_norm_rope_kernel_matches_oracle_bf16_gpu(m, h, hd, width):
    check_kernel(m, h, hd, width, torch.bfloat16)


def test_reference_is_the_modules_op_sequence():
    x, w, cos, sin = make_case(6, 3, 16, 48, torch.bfloat16, seed=3)
    norm = RMSNorm(16, EPS).to(torch.bfloat16)
    norm.weight.data.copy_(w)
    want = apply_rope(norm(x.cpu()), cos.cpu(), sin.cpu())
    assert torch.equal(head_norm_rope_ref(x.cpu(), w.cpu(), EPS, cos.cpu(), sin.cpu()), want)
    with pytest.raises(ValueError, match=r"cos and sin must be \[M, hd\]"):
        head_norm_rope_ref(x.cpu(), w.cpu(), EPS, cos[:2].cpu(), sin.cpu())
    with pytest.raises(ValueError, match="even hd"):
        head_norm_rope_ref(x.cpu()[..., :15], w.cpu()[:15], EPS, cos.cpu(), sin.cpu())


def drafters():
    """The same random drafter twice (torch attention), on the test device."""
    return make(cfg_dict()).to(DEVICE), make(cfg_dict()).to(DEVICE)


def test_layer_path_choice_is_logged(monkeypatch, caplog):
    from splitflash.kernels.dispatch import _announce

    _announce.cache_clear()  # logged once per process: earlier tests may have taken it
    w = make(cfg_dict()).fc.weight  # on CPU
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        monkeypatch.delenv("SPLITFLASH_FORCE_TRITON", raising=False)
        assert not fused.fused_path(w)
        monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
        monkeypatch.setenv("SPLITFLASH_FUSED_DRAFTER", "0")
        assert not fused.fused_path(w)
        monkeypatch.setenv("SPLITFLASH_FUSED_DRAFTER", "1")
        assert not fused.fused_path(w)  # autograd records for w: modules (no backward here)
        with torch.no_grad():
            assert fused.fused_path(w)
    text = caplog.text
    assert "dflash_layers: using torch modules (weights need gradients" in text
    assert "dflash_layers: using fused kernels (SPLITFLASH_FORCE_TRITON=1)" in text
    assert "dflash_layers: using torch modules (tensors on cpu)" in text
    assert "dflash_layers: using torch modules (SPLITFLASH_FUSED_DRAFTER=0)" in text


@torch.no_grad()
def run_both(monkeypatch, fn):
    """fn(drafter) on the module path, then on the fused path (Triton forced on CPU)."""
    plain, fused_d = drafters()
    monkeypatch.setenv("SPLITFLASH_FUSED_DRAFTER", "0")
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    assert not fused.fused_path(plain.fc.weight)
    want = fn(plain)
    monkeypatch.setenv("SPLITFLASH_FUSED_DRAFTER", "1")
    assert fused.fused_path(fused_d.fc.weight)
    return fn(fused_d), want


@needs_triton
def test_fused_context_kv_matches_module_path(monkeypatch):
    f = feats(13, seed=4).to(DEVICE)
    pos = torch.arange(100, 113, device=DEVICE)
    got, want = run_both(monkeypatch, lambda d: d.context_kv(f, pos))
    assert len(got) == len(want) == 3
    for (k, v), (k0, v0) in zip(got, want, strict=True):
        torch.testing.assert_close(k, k0, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, v0, atol=2e-5, rtol=1e-5)


@needs_triton
def test_fused_draft_logits_match_module_path(monkeypatch):
    """Three requests past the window (sliding layers) and below it, one batch."""

    def draft(d):
        states = []
        for n, seed in ((3, 1), (20, 2), (9, 3)):
            state = d.new_state()
            d.append_context(state, feats(n, seed=seed).to(DEVICE), 0)
            states.append(state)
        return d.draft_batch(states, [5, 17, 60], [3, 20, 9], 6)

    got, want = run_both(monkeypatch, draft)
    assert got.shape == want.shape == (3, 5, want.shape[-1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_joined_weights_follow_their_parameters():
    d = make(cfg_dict())
    attn = d.layers[0].self_attn
    parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    first = fused.joined(attn, "_qkv_joined", parts)
    assert torch.equal(first, torch.cat(parts))
    assert fused.joined(attn, "_qkv_joined", parts) is first
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)  # an in-place change: the cache must not serve stale rows
    again = fused.joined(attn, "_qkv_joined", parts)
    assert again is not first and torch.equal(again, torch.cat(parts))
    assert "_qkv_joined" not in d.state_dict()
