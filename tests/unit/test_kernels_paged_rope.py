"""Paged verify attention applying RoPE and writing the block's K/V itself (kernels/rope_rows.py):
against the two-launch path it replaces (RoPE + K/V-write kernel, then attention over the
pages: the same pages bit for bit) and against an fp64 oracle by the accuracy rule of
DESIGN.md 9.

Kernel tests run under TRITON_INTERPRET=1 on CPU (fp32, fp16) or natively on CUDA; bf16 needs
a GPU.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from splitflash.kernels import dispatch
from splitflash.kernels.paged_attention_ref import RopeWrite, paged_attention_ref
from splitflash.kernels.rope_kv import rope_kv_write_ref
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton
from tests.unit.test_kernels_fused import rope_oracle
from tests.unit.test_kernels_paged import dense_oracle, make_case


def make_rope_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=0):
    """A paged batch whose last q_len keys per request are the block still to be written:
    its pages hold nan (so a kernel reading them instead of the rows fails), q / k / v are
    views of one fused projection output, cos / sin random with unequal halves."""
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=seed,
                     head_major=True)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    n = case["q"].shape[0]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    cos, sin = (torch.randn(n, 1, dim, generator=gen).to(dtype=dtype, device=DEVICE)
                for _ in range(2))  # fmt: skip
    slots = []
    for b, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        for t in range(kv_len - q_len, kv_len):  # the block's positions through the table
            slots.append(int(case["page_table"][b, t // page]) * page + t % page)
    slots = torch.tensor(slots, device=DEVICE)
    for pages in (case["k_pages"], case["v_pages"]):
        pages.flatten(0, 1)[slots] = float("nan")
    case["q"] = q.view(n, heads, dim)
    rope = RopeWrite(k.view(n, kv_heads, dim), v.view(n, kv_heads, dim), cos, sin, slots)
    return case, rope


def two_launches(case, rope, attention):
    """rope_kv_write_ref's contract then attention, on copies of the pages."""
    case = {**case, "k_pages": case["k_pages"].clone(), "v_pages": case["v_pages"].clone()}
    if attention is paged_attention_ref:
        rotate = rope_kv_write_ref
    else:
        from splitflash.kernels.rope_kv import rope_kv_write_triton as rotate
    q_rot = rotate(case["q"], rope.k, rope.v, rope.cos, rope.sin, case["k_pages"],
                   case["v_pages"], rope.slots)  # fmt: skip
    return attention(**{**case, "q": q_rot}), case


def fp64_oracle(case, rope):
    """RoPE in fp64 on q and the block's k, the block written in fp64, dense attention."""
    c = {k: v.double().cpu() if torch.is_tensor(v) and v.is_floating_point() else v.cpu()
         if torch.is_tensor(v) else v for k, v in case.items()}  # fmt: skip
    slots = rope.slots.cpu()
    c["q"] = rope_oracle(case["q"], rope.cos, rope.sin)
    c["k_pages"].flatten(0, 1)[slots] = rope_oracle(rope.k, rope.cos, rope.sin)
    c["v_pages"].flatten(0, 1)[slots] = rope.v.double().cpu()
    return dense_oracle(c)


def check_fused(case, rope, dtype, **kw):
    from splitflash.kernels.paged_attention import paged_attention_triton

    def triton_attention(**c):
        return paged_attention_triton(**c, **kw)

    fused_case = {**case, "k_pages": case["k_pages"].clone(), "v_pages": case["v_pages"].clone()}
    got = paged_attention_triton(**fused_case, rope=rope, **kw)
    two, two_case = two_launches(case, rope, triton_attention)
    low, _ = two_launches(case, rope, paged_attention_ref)
    assert got.dtype == dtype and got.shape == case["q"].shape
    # The same roundings as the two-launch path: equal pages (nan included: nothing else
    # was written). The outputs fold the block's keys in 16-key tiles, not BLOCK_N ones: the
    # online softmax's order differs, so they agree to rounding (the rule below, for both).
    for name in ("k_pages", "v_pages"):
        assert torch.equal(fused_case[name].nan_to_num(7.0), two_case[name].nan_to_num(7.0))
        assert not fused_case[name].flatten(0, 1)[rope.slots].isnan().any()
    want = fp64_oracle(case, rope)
    err_low = (low.double().cpu() - want).abs().max().item()
    for out in (got, two):
        err_kernel = (out.double().cpu() - want).abs().max().item()
        assert err_kernel <= 2 * err_low + ATOL[dtype], (err_kernel, err_low)


# (kv_lens, q_lens, H, H_KV, D, page size, forced splits or None): a block inside one split,
# a block cut by a split boundary (5 splits of 32 keys over 113), several row tiles per key
# range (q 64 x G 3), q_len 1, a request that is all block (kv_len = q_len).
CASES = [
    ([113], [16], 9, 3, 64, 16, None),
    ([113], [16], 3, 1, 32, 16, 5),
    ([300, 64, 13], [7, 64, 1], 6, 2, 16, 1, 3),
    ([1100, 129], [64, 16], 6, 2, 16, 64, 5),
    ([7], [7], 4, 4, 32, 16, None),
]
IDS = [f"kv{c[0]}-q{c[1]}-g{c[2] // c[3]}-p{c[5]}-s{c[6]}" for c in CASES]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", CASES, ids=IDS)
def test_fused_rope_equals_two_launches(kv_lens, q_lens, heads, kv_heads, dim, page, splits,
                                        dtype):  # fmt: skip
    case, rope = make_rope_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=page)
    check_fused(case, rope, dtype, num_splits=splits)


@needs_triton
def test_fused_rope_rejects_cos_of_another_dtype():
    from splitflash.kernels.paged_attention import paged_attention_triton

    case, rope = make_rope_case([40], [7], 4, 2, 16, 16, torch.float16)
    rope = copy.copy(rope)
    rope.cos = rope.cos.float()
    with pytest.raises(ValueError, match="cos / sin must be"):
        paged_attention_triton(**case, rope=rope)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", CASES, ids=IDS)
def test_fused_rope_equals_two_launches_bf16_gpu(kv_lens, q_lens, heads, kv_heads, dim, page,
                                                 splits):  # fmt: skip
    case, rope = make_rope_case(kv_lens, q_lens, heads, kv_heads, dim, page, torch.bfloat16)
    check_fused(case, rope, torch.bfloat16, num_splits=splits)


def test_dispatcher_on_cpu_rotates_writes_then_attends(monkeypatch, caplog):
    """The CPU serving path: RoPE + K/V write by the reference, then the attention reference,
    bit for bit."""

    monkeypatch.delenv("SPLITFLASH_FORCE_TRITON", raising=False)
    dispatch._announce.cache_clear()
    case, rope = make_rope_case([40, 9], [7, 1], 4, 2, 16, 16, torch.float32)
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    rope = RopeWrite(*(t.cpu() for t in (rope.k, rope.v, rope.cos, rope.sin, rope.slots)))
    want, want_case = two_launches(case, rope, paged_attention_ref)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        got = dispatch.paged_attention(**case, rope=rope)
    assert torch.equal(got, want)
    for name in ("k_pages", "v_pages"):
        assert torch.equal(case[name].nan_to_num(7.0), want_case[name].nan_to_num(7.0))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("rope_kv_write: using torch reference" in m for m in msgs), msgs


@needs_triton
def test_dispatcher_forced_triton_takes_the_fused_kernel(monkeypatch, caplog):

    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    dispatch._announce.cache_clear()
    case, rope = make_rope_case([40], [7], 4, 2, 16, 16, torch.float32)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        dispatch.paged_attention(**case, rope=rope)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("paged_attention: using triton with RoPE + K/V write" in m for m in msgs), msgs
    assert not any("rope_kv_write" in m for m in msgs), msgs  # no separate launch
    assert not case["k_pages"].flatten(0, 1)[rope.slots].isnan().any()  # written in place


@needs_triton
def test_rope_in_attention_switch_off_takes_the_separate_launch(monkeypatch, caplog):
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    monkeypatch.setenv("SPLITFLASH_ROPE_IN_ATTENTION", "0")
    dispatch._announce.cache_clear()
    case, rope = make_rope_case([40], [7], 4, 2, 16, 16, torch.float32)
    want, want_case = two_launches(case, rope, paged_attention_ref)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        got = dispatch.paged_attention(**case, rope=rope)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("rope_kv_write: using triton" in m for m in msgs), msgs
    assert not any("with RoPE" in m for m in msgs), msgs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(case["k_pages"].nan_to_num(7.0), want_case["k_pages"].nan_to_num(7.0))
