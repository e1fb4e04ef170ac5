"""A prefill chunk's attention split in two and merged by log-sum-exp (chunk_attention.py)
equals SDPA with the bottom-right causal mask, and a prompt prefilled in chunks through it
leaves what one forward leaves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import splitflash.models.chunk_attention as mod
from splitflash.models.chunk_attention import chunk_attention, chunk_attention_split
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_engine, tiny_model


def _case(chunk: int, cached: int, device="cpu", dtype=torch.float32, heads=4, dim=16):
    g = torch.Generator(device).manual_seed(chunk * 1000 + cached)
    q = torch.randn(1, heads, chunk, dim, generator=g, device=device).to(dtype)
    k = torch.randn(1, heads, cached + chunk, dim, generator=g, device=device).to(dtype)
    v = torch.randn(1, heads, cached + chunk, dim, generator=g, device=device).to(dtype)
    return q, k, v


def _masked(q, k, v, scale=None):
    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize(("chunk", "cached"), [(1, 1), (7, 13), (16, 113), (64, 4097), (65, 3)])
def test_the_split_chunk_equals_the_masked_chunk(chunk, cached):
    q, k, v = _case(chunk, cached)
    want = _masked(q.double(), k.double(), v.double(), scale=0.2)
    got = chunk_attention_split(q, k, v, 0.2)
    low = _masked(q, k, v, scale=0.2)  # the fp32 kernel's own error sets the bound
    bound = 2 * (low.double() - want).abs().max() + 1e-6
    assert (got.double() - want).abs().max() <= bound


def _spy_split(monkeypatch, fail: bool = False) -> list:
    """Record (or fail) the calls that reach chunk_attention_split; the masked path stays."""
    calls = []

    def split(*args):
        calls.append(args)
        if fail:
            raise RuntimeError("no cuDNN graph for this shape")
        return args[0]

    monkeypatch.setattr(mod, "chunk_attention_split", split)
    monkeypatch.setattr(mod, "_split_refused", False)
    return calls


def test_the_switch_picks_the_split_only_for_a_chunk_after_cached_keys(monkeypatch):
    calls = _spy_split(monkeypatch)
    q, k, v = _case(5, 0)
    monkeypatch.setenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "1")
    chunk_attention(q, k, v, None)  # the whole prompt: square causal, never split
    assert not calls
    q, k, v = _case(5, 9)
    chunk_attention(q, k, v, None)
    assert len(calls) == 1
    monkeypatch.delenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION")  # unset: split too
    chunk_attention(q, k, v, None)
    assert len(calls) == 2
    monkeypatch.setenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "0")
    torch.testing.assert_close(chunk_attention(q, k, v, None), _masked(q, k, v))
    assert len(calls) == 2


def test_a_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "yes")
    q, k, v = _case(5, 9)
    with pytest.raises(ValueError, match="SPLITFLASH_PREFILL_SPLIT_ATTENTION must be 0, 1"):
        chunk_attention(q, k, v, None)


def test_a_split_that_raises_is_logged_once_and_masked_from_then_on(monkeypatch, caplog):
    calls = _spy_split(monkeypatch, fail=True)
    monkeypatch.setenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "1")
    q, k, v = _case(7, 13)
    with caplog.at_level("WARNING", logger=mod.__name__):
        first = chunk_attention(q, k, v, None)
        second = chunk_attention(q, k, v, None)
    torch.testing.assert_close(first, _masked(q, k, v))
    torch.testing.assert_close(second, _masked(q, k, v))
    assert len(calls) == 1  # refused once: the second chunk never tried
    assert [r.message for r in caplog.records if "fused attention call raised" in r.message]


def test_a_prompt_prefilled_through_split_chunks_leaves_what_one_forward_leaves(monkeypatch):
    monkeypatch.setenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "1")
    prompt = [(i * 37 + 11) % 97 for i in range(150)]  # past 64: the SDPA prefill path
    model = tiny_model()
    whole, chunked = tiny_engine(model, pages=96), tiny_engine(model, pages=96)
    whole.feature_layer_ids = chunked.feature_layer_ids = (0, 2)
    chunked.prefill_chunk = 65
    got = chunked.prefill("r", prompt, Sampling(), (), 100)
    want = whole.prefill("r", prompt, Sampling(), (), 100)
    assert got.outcome.committed == want.outcome.committed
    torch.testing.assert_close(got.features, want.features, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("chunk", "cached"), [(65, 3), (512, 4097), (2048, 30000)])
@pytest.mark.parametrize("min_work", [0.0, float("inf")], ids=["cudnn", "flash"])
def test_the_split_chunk_on_the_gpu_in_bf16(monkeypatch, chunk, cached, min_work):
    """The CUDA paths: cuDNN's op or FlashAttention's, and their log-sum-exps."""
    monkeypatch.setattr(mod, "CUDNN_MIN_WORK", min_work)
    assert mod.flash_lse_agrees(torch.device("cuda"), torch.bfloat16, 64)  # else no flash
    q, k, v = _case(chunk, cached, "cuda", torch.bfloat16, heads=9, dim=64)
    want = _masked(q.float(), k.float(), v.float())
    got = chunk_attention_split(q, k, v, None).float()
    low = _masked(q, k, v).float()
    assert (got - want).abs().max() <= 2 * (low - want).abs().max() + 1e-3
    if cached == 3:  # the whole prompt (square causal) through the same choice
        q, k, v = _case(chunk, 0, "cuda", torch.bfloat16, heads=9, dim=64)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        low = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        got = chunk_attention(q, k, v, None).float()
        assert (got - want).abs().max() <= 2 * (low - want).abs().max() + 1e-3


def test_cudnn_takes_big_chunks_and_recurring_shapes_of_enough_tokens(monkeypatch):
    """cuDNN's first call of a shape builds a graph (~50 ms on an H100): a new shape goes to
    cuDNN only with the work to pay for it; a shape asked for again from CUDNN_MIN_CHUNK
    tokens on if it is aligned as fixed-size chunks are (they recur from prompt to prompt,
    and a build serves every later prompt), not a time budget's chunk of 2049 tokens; a
    small chunk never (FlashAttention is the faster one)."""
    monkeypatch.setattr(mod, "_asked", set())
    tag = ("cuda:0", torch.bfloat16, False, 9, 64)  # 9 heads of 64
    assert [mod.cudnn_pays(tag, 8192, 16384) for _ in range(3)] == [False, True, True]
    assert [mod.cudnn_pays(tag, 4096, 185_000) for _ in range(2)] == [True, True]  # 4.4e11
    assert [mod.cudnn_pays(tag, 256, 185_000) for _ in range(3)] == [False] * 3
    assert [mod.cudnn_pays(tag, 2047, 65536) for _ in range(2)] == [False, False]
    assert [mod.cudnn_pays(tag, 2048, 65536) for _ in range(2)] == [False, True]
    assert [mod.cudnn_pays(tag, 2049, 65536) for _ in range(2)] == [False, False]
    assert [mod.cudnn_pays(tag, 8192, 65537) for _ in range(2)] == [False, False]
    # shapes of another tag (a whole prompt, other heads, another GPU) are their own
    assert not mod.cudnn_pays(("cuda:1", *tag[1:]), 8192, 16384)
    assert not mod.cudnn_pays(tag[:2] + (True,) + tag[3:], 8192, 16384)


def test_the_shapes_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(mod, "_asked", set())
    monkeypatch.setattr(mod, "SHAPES_HELD", 5)
    tag = ("cuda:0", torch.bfloat16, False, 9, 64)
    for cached in range(0, 1280, 256):
        mod.cudnn_pays(tag, 4096, cached)
    assert mod.cudnn_pays(tag, 4096, 0)  # still remembered: recurring
    mod.cudnn_pays(tag, 4096, 99 * 256)  # a sixth shape: the memory starts again
    assert len(mod._asked) == 1
    assert not mod.cudnn_pays(tag, 4096, 0)


def test_cudnn_is_never_chosen_for_a_cpu_chunk(monkeypatch):
    monkeypatch.setattr(mod, "_asked", set())
    q = torch.zeros(1, 9, 8192, 64)
    assert not mod.cudnn_chosen(q, 185_000) and not mod._asked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_chunks_take_flash_attention_and_big_or_recurring_ones_cudnn(monkeypatch):
    assert mod.flash_lse_agrees(torch.device("cuda"), torch.bfloat16, 64)  # checked before
    monkeypatch.setattr(mod, "_asked", set())
    seen = []
    real = mod._attend_lse
    monkeypatch.setattr(mod, "_attend_lse", lambda *a: seen.append(a[-1]) or real(*a))
    cases = ((256, 185_000, False), (256, 185_000, False), (4096, 185_000, True),
             (4096, 16384, False), (4096, 16384, True))  # fmt: skip
    for chunk, cached, cudnn in cases:
        q, k, v = _case(chunk, cached, "cuda", torch.bfloat16, heads=9, dim=64)
        chunk_attention_split(q, k, v, None)
        assert seen == [cudnn, cudnn], (chunk, cached)
        seen.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_splits_cudnn_shapes_and_masks_the_others(monkeypatch):
    monkeypatch.delenv("SPLITFLASH_PREFILL_SPLIT_ATTENTION", raising=False)
    calls = _spy_split(monkeypatch)
    for dtype, dim, splits in ((torch.bfloat16, 64, 1), (torch.float32, 64, 0),
                               (torch.float16, 256, 0)):  # fmt: skip
        q, k, v = _case(16, 40, "cuda", dtype, heads=2, dim=dim)
        got = chunk_attention(q, k, v, None)
        if splits == 0:
            torch.testing.assert_close(got, _masked(q, k, v))
        assert len(calls) == splits, (dtype, dim)
        calls.clear()


@pytest.mark.parametrize("lse_as", ["natural", "base 2", "zeros"])
def test_the_flash_check_fails_a_log_sum_exp_of_another_convention(monkeypatch, lse_as):
    """flash_lse_agrees passes the kernel's own log-sum-exp (the CPU kernel stands in for
    CUDA's here) and fails one in another base or none: such a kernel gets no chunk."""
    real = mod._attend_lse

    def attend(*args):
        out, lse = real(*args)
        return out, {"natural": lse, "base 2": lse / 0.6931471805599453, "zeros": 0 * lse}[lse_as]

    monkeypatch.setattr(mod, "_attend_lse", attend)
    monkeypatch.setattr(mod, "_flash_checked", {})
    assert mod.flash_lse_agrees(torch.device("cpu"), torch.float32, 16) == (lse_as == "natural")


def test_the_aligned_chunk_starts_are_the_full_chunks_after_others():
    # a 185k prompt in chunks of 8192: chunk k after k x 8192 keys, the 22nd (4776 tokens)
    # partial; full chunks after others at 8192 .. 172032
    starts = mod.aligned_chunk_starts(8192, 185_000)
    assert starts == list(range(8192, 172_033, 8192)) and len(starts) == 21
    assert mod.aligned_chunk_starts(8192, 16384) == [8192]
    assert mod.aligned_chunk_starts(8192, 16383) == []
    assert mod.aligned_chunk_starts(2048 + 256, 10_000) == [2304, 4608, 6912]  # 9216 <= 10k
    assert mod.aligned_chunk_starts(8000, 185_000) == []  # not aligned: never recurring-cuDNN
    assert mod.aligned_chunk_starts(1024, 185_000) == []  # under CUDNN_MIN_CHUNK


def test_prebuild_does_nothing_off_cuda(monkeypatch):
    monkeypatch.setattr(mod, "_asked", set())
    assert mod.prebuild(torch.device("cpu"), torch.float32, 9, 64, 2048, [2048], 0.125) == 0
    assert not mod._asked


def test_prebuild_lays_its_chunks_out_as_a_prefill_does(monkeypatch):
    """cuDNN builds a graph per shape and strides, so what prebuild runs (chunk_inputs) must
    be laid out as a real prefill's chunks: a whole first chunk, then one after cached keys."""
    import splitflash.models.attention as attention

    seen = []
    real = attention.chunk_attention
    monkeypatch.setattr(attention, "chunk_attention",
                        lambda q, k, v, s: seen.append((q, k, v)) or real(q, k, v, s))  # fmt: skip
    model = tiny_model()
    engine = tiny_engine(model, pages=96)
    engine.prefill_chunk = 80
    engine.prefill("r", [(i * 37 + 11) % 97 for i in range(150)], Sampling(), (), 10)
    assert {(q.shape[2], k.shape[2]) for q, k, _ in seen} == {(80, 80), (70, 150)}
    cfg = model.cfg
    for q, k, v in seen:
        chunk, cached = q.shape[2], k.shape[2] - q.shape[2]
        pq, pk = mod.chunk_inputs("cpu", q.dtype, cfg.num_heads, cfg.head_dim, chunk, cached)
        assert (pq.shape, pq.stride()) == (q.shape, q.stride())
        assert (pk.shape, pk.stride()) == (k.shape, k.stride()) == (v.shape, v.stride())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prebuilt_shape_takes_cudnn_at_its_first_real_chunk(monkeypatch):
    """After prebuild the first chunk of that shape in a prompt goes to cuDNN (its graph
    was built at start-up) and still equals the masked chunk; a shape not prebuilt of the
    same small work goes to FlashAttention."""
    monkeypatch.setattr(mod, "_asked", set())
    assert mod.prebuild(torch.device("cuda"), torch.bfloat16, 9, 64, 2048, [4096], 0.125) == 1
    seen = []
    real = mod._attend_lse
    monkeypatch.setattr(mod, "_attend_lse", lambda *a: seen.append(a[-1]) or real(*a))
    for cached, cudnn in ((4096, True), (6144, False)):
        q, k, v = _case(2048, cached, "cuda", torch.bfloat16, heads=9, dim=64)
        q = q[0].transpose(0, 1).contiguous().transpose(0, 1)[None]  # the model's layout
        got = chunk_attention(q, k, v, 0.125).float()
        want = _masked(q.float(), k.float(), v.float(), 0.125)
        low = _masked(q, k, v, 0.125).float()
        assert (got - want).abs().max() <= 2 * (low - want).abs().max() + 1e-3
        assert seen == [cudnn, cudnn], cached
        seen.clear()
