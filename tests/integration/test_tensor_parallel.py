"""Tensor parallelism (splitflash/parallel) against the single-process model.

Two ranks on CPU over gloo (loopback), spawned by run_tp: every rank builds the same tiny
model from the same seed, shards it, and sends its results back to this process, where
they are compared with the unsharded model run here. A failing or stuck rank fails the
test through run_tp (traceback or deadline), never a hang.
"""

from __future__ import annotations

import pytest
import torch

from splitflash.models.attention import AttentionMeta
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import ForwardBatch
from splitflash.parallel import (
    BroadcastForward,
    follow,
    local_kv_heads,
    pack_forward,
    run_tp,
    shard_target,
    unpack_forward,
)
from splitflash.services.verify.engine import TargetEngine
from tests.conftest import tiny_model
from tests.integration.engine_steps import greedy_oracle, steps_with_drafts

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integration/conftest.py

WORLD = 2
PAGES, PAGE = 64, 4
HIDDEN_IDS = (0, 2)
FAMILIES = ("llama", "qwen3")  # tied LM head / untied with q-k norms; V = 97 pads a shard
PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], "c": [2, 7]}
DRAFT_LENS = (3, 5, 0, 2, 4, 1, 3)  # drafts per verify step; odd steps get one wrong token
NEW_TOKENS = 40  # target-only greedy tokens: the oracle the drafts are taken from
RUN_TIMEOUT_S = 90


def _cache(model, kv_heads: int, device="cpu") -> PagedKVCache:
    cfg = model.cfg
    return PagedKVCache(cfg.num_layers, PAGES, PAGE, kv_heads, cfg.head_dim, device=device)


# --- driving forwards directly ---------------------------------------------------------
def _batch(cache: PagedKVCache, spans, anc_bits=None, kv_bound=None) -> ForwardBatch:
    """spans: (request id, new tokens, positions); reserves the KV, like the engine."""
    ids, pos, slots, q_lens, kv_lens = [], [], [], [], []
    for rid, toks, positions in spans:
        start = cache.seq(rid).length
        cache.reserve(rid, start + len(toks))
        ids += toks
        pos += positions
        slots.append(cache.slots(rid, start, start + len(toks)))
        q_lens.append(len(toks))
        kv_lens.append(start + len(toks))
    meta = AttentionMeta(
        cu_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        page_table=cache.page_table([s[0] for s in spans]),
        anc_bits=anc_bits,
        q_lens=q_lens,
        kv_lens_list=kv_lens,
        kv_bound=kv_bound,
    )
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(slots), meta)


@torch.inference_mode()
def _forward_steps(model, cache: PagedKVCache) -> list:
    """A batched prefill of 3 prompts, a causal verify block, a tree block -> outputs."""
    outs = []
    for rid in PROMPTS:
        cache.add(rid)
    prefill = [(rid, toks, list(range(len(toks)))) for rid, toks in PROMPTS.items()]
    batch = _batch(cache, prefill)
    rows = batch.meta.cu_q[1:].long() - 1  # last prompt token of each request
    outs.append(model(batch, cache, rows, HIDDEN_IDS))
    for rid, toks in PROMPTS.items():
        cache.seq(rid).length = len(toks)
    # Chain block of 4 (causal bits implied), every row's logits.
    spans = []
    for i, (rid, toks) in enumerate(PROMPTS.items()):
        spans.append(
            (rid, [(7 * i + j) % 90 for j in range(4)], list(range(len(toks), len(toks) + 4)))
        )
    outs.append(model(_batch(cache, spans), cache, None, HIDDEN_IDS))
    for rid in PROMPTS:
        cache.seq(rid).length += 4
    # Tree block: root, two children, one grandchild (ancestor bits), kv_bound given.
    tree_bits = [0b1, 0b11, 0b101, 0b1011]
    spans = []
    for i, rid in enumerate(PROMPTS):
        p = cache.seq(rid).length
        spans.append((rid, [(11 * i + j) % 90 for j in range(4)], [p, p + 1, p + 1, p + 2]))
    bits = torch.tensor(tree_bits * len(PROMPTS), dtype=torch.int64)
    outs.append(model(_batch(cache, spans, bits, kv_bound=64), cache, None, HIDDEN_IDS))
    return [(o.logits, o.hidden) for o in outs]


def _forward_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)  # two ranks on two cores
    got = {}
    for family in FAMILIES:
        model = shard_target(tiny_model(family), rank, world)
        cache = _cache(model, local_kv_heads(model.cfg, world))
        if rank == 0:
            with BroadcastForward(model) as wrapped:
                outs = _forward_steps(wrapped, cache)
        else:
            seen = []
            follow(model, cache, on_output=seen.append)
            outs = [(o.logits, o.hidden) for o in seen]
        got[family] = (outs, cache.k, cache.v)
    return got


# --- driving the engine ----------------------------------------------------------------
def _generate(engine: TargetEngine, oracle: dict[str, list[int]]) -> list:
    """Prefill 2 prompts, then verify steps with drafts cut from the oracle (some wrong)."""
    return steps_with_drafts(engine, PROMPTS, oracle, DRAFT_LENS)


def _engine_worker(rank: int, world: int, family: str, oracle, device: str) -> dict:
    torch.set_num_threads(1)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    model = shard_target(tiny_model(family).to(dev), rank, world)
    cache = _cache(model, local_kv_heads(model.cfg, world), dev)
    if rank != 0:
        return {"forwards": follow(model, cache)}
    with BroadcastForward(model) as wrapped:
        engine = TargetEngine(wrapped, cache, feature_layer_ids=HIDDEN_IDS)
        records = _generate(engine, oracle)
    tokens = {rid: seq.tokens for rid, seq in engine.seqs.items()}
    records = [(rid, toks, f.cpu()) for rid, toks, f in records]
    return {"forwards": wrapped.forwards, "records": records, "tokens": tokens}


def _oracle(model, device="cpu") -> dict[str, list[int]]:
    """Target-only greedy (no drafts) of prompts a and b, NEW_TOKENS tokens each."""
    engine = TargetEngine(model, _cache(model, model.cfg.num_kv_heads, device))
    return greedy_oracle(engine, {rid: PROMPTS[rid] for rid in ("a", "b")}, NEW_TOKENS)


def _check_generation(family: str, device: str, atol: float) -> None:
    model = tiny_model(family).to(device)
    oracle = _oracle(model, device)
    engine = TargetEngine(
        model, _cache(model, model.cfg.num_kv_heads, device), feature_layer_ids=HIDDEN_IDS
    )
    want = _generate(engine, oracle)
    backend = "nccl" if device == "cuda" else "gloo"
    rank0, rank1 = run_tp(
        WORLD, _engine_worker, family, oracle, device, timeout_s=RUN_TIMEOUT_S, backend=backend
    )
    got = rank0["records"]
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    for (_, _, f_got), (_, _, f_want) in zip(got, want, strict=True):
        torch.testing.assert_close(f_got, f_want.cpu(), rtol=0, atol=atol)
    # Greedy speculative decoding is lossless: the same tokens as target-only greedy.
    for rid, tokens in rank0["tokens"].items():
        assert tokens == oracle[rid][: len(tokens)]
    accepted = sum(len(t) - 1 for _, t, _ in got[len(oracle) :])  # commit_len - 1 per step
    assert accepted >= 10  # the verify steps accepted drafts (and rolled back wrong ones)
    assert rank1["forwards"] == rank0["forwards"] == len(oracle) + len(DRAFT_LENS)


def _failing_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails before its first broadcast")
    model = shard_target(tiny_model(), rank, world)
    return follow(model, _cache(model, 1), src=1)  # waits on rank 1, which never sends


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("family,vocab", [("llama", 98), ("qwen3", 97)])
@pytest.mark.parametrize("rank", [0, 1])
def test_shards_are_the_slices_of_the_full_weights(family, vocab, rank):
    full = tiny_model(family, vocab_size=vocab)
    model = shard_target(tiny_model(family, vocab_size=vocab), rank, WORLD)
    cfg = full.cfg
    hd, d, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    h_loc, kv_loc, i_loc = cfg.num_heads // 2, cfg.num_kv_heads // 2, inter // 2
    q_heads = slice(rank * h_loc, (rank + 1) * h_loc)
    kv_heads = slice(rank * kv_loc, (rank + 1) * kv_loc)
    assert model.cfg == cfg  # the engine reads the global config
    for ref, got in zip(full.layers, model.layers, strict=True):
        q, k, v = ref.self_attn.qkv_proj.weight.split(ref.self_attn.split)
        want_qkv = torch.cat([
            q.view(cfg.num_heads, hd, d)[q_heads].reshape(-1, d),
            k.view(cfg.num_kv_heads, hd, d)[kv_heads].reshape(-1, d),
            v.view(cfg.num_kv_heads, hd, d)[kv_heads].reshape(-1, d),
        ])  # fmt: skip
        attn = got.self_attn
        assert attn.qkv_proj.weight.shape == ((h_loc + 2 * kv_loc) * hd, d)
        torch.testing.assert_close(attn.qkv_proj.weight, want_qkv, rtol=0, atol=0)
        o = ref.self_attn.o_proj.weight.view(d, cfg.num_heads, hd)[:, q_heads].reshape(d, -1)
        assert attn.o_proj.weight.shape == (d, h_loc * hd)
        torch.testing.assert_close(attn.o_proj.weight, o, rtol=0, atol=0)
        assert (attn.cfg.num_heads, attn.cfg.num_kv_heads) == (h_loc, kv_loc)
        assert attn.split == (h_loc * hd, kv_loc * hd, kv_loc * hd)
        if cfg.qk_norm:  # per head_dim: replicated
            torch.testing.assert_close(attn.q_norm.weight, ref.self_attn.q_norm.weight)
            torch.testing.assert_close(attn.k_norm.weight, ref.self_attn.k_norm.weight)
        gate, up = ref.mlp.gate_up_proj.weight.chunk(2)
        cols = slice(rank * i_loc, (rank + 1) * i_loc)
        assert got.mlp.hidden == i_loc and got.mlp.gate_up_proj.weight.shape == (2 * i_loc, d)
        torch.testing.assert_close(
            got.mlp.gate_up_proj.weight, torch.cat([gate[cols], up[cols]]), rtol=0, atol=0
        )
        assert got.mlp.down_proj.weight.shape == (d, i_loc)
        torch.testing.assert_close(
            got.mlp.down_proj.weight, ref.mlp.down_proj.weight[:, cols], rtol=0, atol=0
        )
    per = -(-vocab // 2)
    head = model.lm_head.weight
    assert head.shape == (per, d)
    real = full.lm_head.weight[rank * per : (rank + 1) * per]
    torch.testing.assert_close(head[: len(real)], real, rtol=0, atol=0)
    assert not head[len(real) :].any()  # padding rows of the last shard
    # The embedding stays whole and no longer shares storage with the LM head.
    torch.testing.assert_close(model.embed_tokens.weight, full.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "overrides,world,named",
    [
        (dict(num_heads=6, num_kv_heads=3), 2, "num_kv_heads 3"),
        (dict(num_heads=6, num_kv_heads=2), 4, "num_heads 6, num_kv_heads 2"),
        (dict(intermediate_size=130), 4, "intermediate_size 130"),
    ],
)
def test_indivisible_sizes_are_refused(overrides, world, named):
    model = tiny_model(**overrides)
    with pytest.raises(ValueError, match=f"tensor parallel size {world} .*{named}"):
        shard_target(model, 0, world)
    with pytest.raises(ValueError, match=named):
        local_kv_heads(model.cfg, world)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        shard_target(tiny_model(), 2, 2)


def test_broadcast_payload_round_trips():
    cache = _cache(tiny_model(), 2)
    for rid in ("x", "y"):
        cache.add(rid)
    spans = [("x", [5, 6, 7], [0, 1, 1]), ("y", [1, 2, 3, 4, 8], [0, 1, 2, 3, 4])]
    bits = torch.tensor([1, 3, 5, 1, 3, 7, 15, 31], dtype=torch.int64)
    batch = _batch(cache, spans, bits, kv_bound=256)
    rows = torch.tensor([2, 7])
    for rows_in, bits_in in ((rows, bits), (None, None)):
        batch.meta.anc_bits = bits_in
        header, payload = pack_forward(batch, rows_in, (0, 2))
        back, rows_out, ids = unpack_forward(header.tolist(), payload, "cpu")
        assert ids == (0, 2)
        for name in ("token_ids", "positions", "slots"):
            assert torch.equal(getattr(back, name), getattr(batch, name))
        for name in ("cu_q", "kv_lens", "page_table", "anc_bits"):
            want, got = getattr(batch.meta, name), getattr(back.meta, name)
            assert (got is None and want is None) or (
                torch.equal(got, want) and got.dtype == want.dtype
            )
        assert (back.meta.q_lens, back.meta.kv_lens_list) == ([3, 5], [3, 5])
        assert back.meta.kv_bound == 256
        assert (rows_out is None) == (rows_in is None)
        if rows_in is not None:
            assert torch.equal(rows_out, rows_in)


@pytest.mark.timeout(120)
def test_tp2_forward_equals_tp1():
    results = run_tp(WORLD, _forward_worker, timeout_s=RUN_TIMEOUT_S, backend="gloo")
    for family in FAMILIES:
        model = tiny_model(family)
        cache = _cache(model, model.cfg.num_kv_heads)
        want = _forward_steps(model, cache)
        kv_loc = local_kv_heads(model.cfg, WORLD)
        for rank, got in enumerate(results):
            outs, k, v = got[family]
            assert len(outs) == len(want) == 3
            for (logits, hidden), (w_logits, w_hidden) in zip(outs, want, strict=True):
                assert logits.shape == w_logits.shape  # full [R, V] on every rank
                torch.testing.assert_close(logits, w_logits, rtol=0, atol=1e-5)
                torch.testing.assert_close(hidden, w_hidden, rtol=0, atol=1e-5)
            # Each rank's cache holds exactly its kv heads of the full cache.
            heads = slice(rank * kv_loc, (rank + 1) * kv_loc)
            torch.testing.assert_close(k, cache.k[..., heads, :], rtol=0, atol=1e-5)
            torch.testing.assert_close(v, cache.v[..., heads, :], rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_engine_greedy_equals_single_process(family):
    _check_generation(family, "cpu", atol=1e-5)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 over NCCL needs 2 CUDA GPUs")
def test_tp2_engine_greedy_equals_single_process_on_gpus():
    # NCCL between cuda:0 and cuda:1; fp32 on the Triton kernels, so sums may reorder.
    _check_generation("llama", "cuda", atol=1e-4)


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_run_instead_of_hanging():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*before its first"):
        run_tp(WORLD, _failing_worker, timeout_s=RUN_TIMEOUT_S, backend="gloo")
