"""Batch-invariant verify steps (TargetModel.batch_invariant): the oracle is the model itself.

A 16-token verify block's logits must equal, bit for bit, the logits of the 16 one-token
decode steps that produce the same tokens (so greedy speculative output is target-only
output in bf16), also next to another request and replayed from a CUDA graph. The GPU test
checks every row in bf16 on the default model's shape; on CPU the interpreter checks row 0
only (its tl.dot is numpy's BLAS, whose result for a row depends on the row's place in the
tile, see test_kernels_paged_invariant.py) and the CPU path must be unchanged by the flag.
"""

from __future__ import annotations

import os

import pytest
import torch

from splitflash.models.config import TargetConfig
from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import TargetModel
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine
from tests.conftest import tiny_model
from tests.unit.kernel_env import INTERPRET, needs_triton

SMOLLM2 = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
               rms_norm_eps=1e-5, max_position_embeddings=200_000)  # fmt: skip


def _engine(model: TargetModel, pages: int, page: int = 16, graphs: bool = False):
    cfg, w = model.cfg, model.embed_tokens.weight
    cache = PagedKVCache(cfg.num_layers, pages, page, cfg.num_kv_heads, cfg.head_dim,
                         dtype=w.dtype, device=w.device,
                         scratch_pages=8 if graphs else 0)  # fmt: skip
    runner = VerifyGraphs(model, cache, (1, 2)) if graphs else None
    return TargetEngine(model, cache, graphs=runner)


def _open(engine: TargetEngine, rid: str, prompt: list[int]) -> None:
    """K/V of all the prompt's tokens but the last (one prefill forward): the last one is
    the first step's anchor, as in TargetEngine. Off CUDA the prefill takes the torch
    references even when the steps are forced onto the interpreter (its RoPE kernel over
    300 rows costs minutes there); every path compared shares the same prefill."""
    engine.cache.add(rid)
    engine.cache.reserve(rid, len(prompt) - 1)
    rows = torch.tensor([0], device=engine.device)
    forced = os.environ.pop("SPLITFLASH_FORCE_TRITON", None)
    try:
        engine.model(engine._batch([(rid, prompt[:-1], 0)]), engine.cache, rows)
    finally:
        if forced is not None:
            os.environ["SPLITFLASH_FORCE_TRITON"] = forced
    engine.cache.seq(rid).length = len(prompt) - 1


def _step(engine: TargetEngine, spans: list[tuple[str, list[int]]]) -> torch.Tensor:
    """One forward over every span's new tokens after its cached keys -> logits [N, V]."""
    full = []
    for rid, toks in spans:
        start = engine.cache.seq(rid).length
        engine.cache.reserve(rid, start + len(toks))
        full.append((rid, toks, start))
    logits = engine.model(engine._batch(full), engine.cache, None).logits
    for rid, toks, start in full:
        engine.cache.seq(rid).length = start + len(toks)
    return logits


@torch.inference_mode()  # as the engine runs (the fused kernels have no backward)
def decode_and_verify(model: TargetModel, prompt: list[int], n: int, other: list[int]):
    """(logits of n one-token decode steps [n, V], of one n-token verify block of the same
    tokens [n, V], of that block next to a one-token step of `other` [n, V])."""
    pages = 3 * -(-(len(prompt) + n) // 16) + -(-(len(other) + 1) // 16) + 8
    engine = _engine(model, pages)
    _open(engine, "decode", prompt)
    tokens, steps = [prompt[-1]], []
    for _ in range(n):
        steps.append(_step(engine, [("decode", tokens[-1:])])[0])
        tokens.append(int(steps[-1].argmax()))
    _open(engine, "verify", prompt)
    block = _step(engine, [("verify", tokens[:n])])
    _open(engine, "batched", prompt)
    _open(engine, "other", other)
    batched = _step(engine, [("batched", tokens[:n]), ("other", other[-1:])])[:n]
    return torch.stack(steps), block, batched


def test_flag_leaves_the_cpu_path_alone():
    """On CPU (torch references) the flag routes the final norm through norm_linear's
    reference: the same ops, so the same logits."""
    prompt = [5, 17, 3, 88, 41, 9, 60]
    model = tiny_model()
    want = decode_and_verify(model, prompt, 5, [7, 7, 2])
    model.batch_invariant = True
    got = decode_and_verify(model, prompt, 5, [7, 7, 2])
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@needs_triton
@pytest.mark.skipif(not INTERPRET, reason="the interpreter run; the GPU test checks all rows")
def test_row_zero_same_bits_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    model = tiny_model(max_position_embeddings=1024)
    model.batch_invariant = True
    steps, block, batched = decode_and_verify(model, prompt, 4, prompt[:40])
    assert torch.equal(steps[0], block[0]) and torch.equal(block[0], batched[0])
    # and the invariant path computes the model: close to the fast kernels' logits
    model.batch_invariant = False
    _, fast_block, _ = decode_and_verify(model, prompt, 4, prompt[:40])
    torch.testing.assert_close(block, fast_block, rtol=1e-4, atol=1e-4)


def test_settings_refuse_tensor_parallel_invariance():
    with pytest.raises(ValueError, match="batch_invariant is not supported with tp_size > 1"):
        VerifySettings(batch_invariant=True, tp_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("prompt_len", [1000, 40_000])
def test_verify_block_equals_decode_steps_bit_for_bit_on_gpu(prompt_len):
    torch.manual_seed(0)
    model = TargetModel(TargetConfig(**SMOLLM2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.05)
    model = model.to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 49152, (prompt_len,), generator=gen).tolist()
    other = torch.randint(0, 49152, (prompt_len // 2 + 777,), generator=gen).tolist()
    fast = decode_and_verify(model, prompt, 16, other)
    model.batch_invariant = True
    steps, block, batched = decode_and_verify(model, prompt, 16, other)
    # What the flag fixes: without it the rows differ (reported, not asserted).
    diff = (fast[0] - fast[1]).abs().max()
    print(f"fast kernels, {prompt_len} keys: verify block == decode steps: "
          f"{torch.equal(fast[0], fast[1])}, max |diff| {diff:.3g}")  # fmt: skip
    for i in range(16):
        assert torch.equal(steps[i], block[i]), f"row {i}: decode step != verify block"
        assert torch.equal(block[i], batched[i]), f"row {i}: batched != alone"
    # The same block replayed from a CUDA graph (its split plan sized for the KV bucket).
    engine = _engine(model, 3 * -(-(prompt_len + 16) // 16) + 8, graphs=True)
    with torch.inference_mode():
        _open(engine, "g", prompt)
        engine.cache.reserve("g", prompt_len - 1 + 16)
        tokens = [prompt[-1]] + steps[:15].argmax(-1).tolist()
        out = engine.graphs.run(engine._step_host([("g", tokens, prompt_len - 1)]), ())
    assert out is not None and engine.graphs.captures == 1
    assert torch.equal(out.logits, block)
