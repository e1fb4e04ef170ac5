"""SPLITFLASH_VERIFY_TP_SIZE: the verify service's target over 2 ranks (CPU, gloo, loopback).

A tiny random Llama written as an HF directory goes through the loader twice, tp_size 1 and
tp_size 2 (rank 1 a spawned process): greedy prefill + verify steps with drafts commit the
same tokens. Closing the server must leave no process behind; a dead or stuck rank must make
rank 0's step raise, naming the rank, instead of hanging. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine, VerifyInput
from splitflash.services.verify.loader import load_engine
from splitflash.services.verify.sampling import Sampling
from splitflash.services.verify.server import VerifyServer
from splitflash.services.verify.tp_engine import TPTargetEngine
from tests.integration.engine_steps import greedy_oracle, steps_with_drafts
from tests.integration.test_multiworker import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integration/conftest.py

PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]}
DRAFT_LENS = (3, 5, 0, 2, 4, 1)  # drafts per verify step; odd steps get one wrong token
NEW_TOKENS = 30  # target-only greedy tokens: the oracle the drafts are cut from


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 4 heads, 2 kv heads, MLP 128 (tiny_config): 2 ranks split them; V = 97 pads a shard.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), vocab=97)


def settings(path, **overrides) -> VerifySettings:
    base = dict(
        target=str(path), device="cpu", kv_pages=64, page_size=4, bind="tcp://127.0.0.1:*",
        metrics_port=0, draft_addr="",
    )  # fmt: skip
    return VerifySettings(**{**base, **overrides})


def oracle(engine: TargetEngine) -> dict[str, list[int]]:
    """Target-only greedy (no drafts) of every prompt, NEW_TOKENS tokens each."""
    tokens = greedy_oracle(engine, PROMPTS, NEW_TOKENS)
    for rid in PROMPTS:
        engine.release(rid)
    return tokens


def generate(engine: TargetEngine, want: dict[str, list[int]]) -> list:
    """Prefill, then verify steps with drafts cut from `want` (some wrong) -> commits."""
    return [(rid, c) for rid, c, _ in steps_with_drafts(engine, PROMPTS, want, DRAFT_LENS)]


def assert_gone(procs) -> None:
    assert procs and all(not p.is_alive() for p in procs), [p.exitcode for p in procs]
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_tp2_server_commits_the_tp1_tokens_and_leaves_no_process(checkpoint):
    single = load_engine(settings(checkpoint))
    want = oracle(single)
    expected = generate(single, want)
    accepted = sum(len(c) - 1 for _, c in expected[len(PROMPTS) :])
    assert accepted >= 8  # the steps accepted drafts (and rolled back the wrong ones)

    server = VerifyServer(settings(checkpoint, tp_size=2))
    engine = server.engine
    procs = list(engine.followers.procs.values())
    try:
        assert isinstance(engine, TPTargetEngine) and engine.graphs is None
        assert engine.cache.k.shape == (3, 64, 4, 1, 16)  # [L, P, S, H_KV / 2, D]
        assert server.describe()["device"] == "cpu"  # what the server reads still works
        got = generate(engine, want)
        assert engine.model.forwards == len(PROMPTS) + len(DRAFT_LENS)
    finally:
        server.close()
    assert got == expected
    for rid, seq in engine.seqs.items():  # lossless: target-only greedy, token for token
        assert seq.tokens == want[rid][: len(seq.tokens)]
    assert_gone(procs)
    assert [p.exitcode for p in procs] == [0]  # returned on the stop message, not killed
    server.close()  # a second close does nothing


def test_a_split_that_cannot_run_is_refused_before_any_process(checkpoint):
    with pytest.raises(ValueError, match="tp_size must be >= 1, got 0"):
        settings(checkpoint, tp_size=0)
    pattern = "TP_SIZE=3, .*not divisible: num_heads 4, num_kv_heads 2, intermediate_size 128"
    with pytest.raises(ValueError, match=pattern):
        load_engine(settings(checkpoint, tp_size=3))
    with pytest.raises(ValueError, match="needs device 'cuda' .* or 'cpu', got 'cuda:1'"):
        load_engine(settings(checkpoint, tp_size=2, device="cuda:1"))
    if torch.cuda.device_count() < 2:
        found = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"tp_size 2 needs 2 CUDA devices, found {found}"):
            load_engine(settings(checkpoint, tp_size=2, device="cuda"))
    assert not multiprocessing.active_children()


def _first_steps(engine: TargetEngine) -> None:
    engine.prefill("a", PROMPTS["a"], Sampling(), (), 10_000)
    engine.verify([VerifyInput("a", len(engine.seqs["a"].tokens), [1, 2], 10_000)])


@pytest.mark.timeout(60)
def test_a_dead_rank_fails_the_step_loudly_and_close_cleans_up(checkpoint, caplog):
    engine = load_engine(settings(checkpoint, tp_size=2))
    procs = list(engine.followers.procs.values())
    try:
        _first_steps(engine)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
            engine.verify([VerifyInput("a", len(engine.seqs["a"].tokens), [4], 10_000)])
        with pytest.raises(RuntimeError, match="rank 1"):  # and every later step, at once
            engine.prefill("b", PROMPTS["b"], Sampling(), (), 10_000)
        assert time.monotonic() - t0 < 5
    finally:
        engine.close()
    assert "rank 1 (pid" in caplog.text
    assert_gone(procs)


@pytest.mark.timeout(60)
def test_a_stuck_rank_times_out_instead_of_hanging(checkpoint):
    engine = load_engine(settings(checkpoint, tp_size=2, tp_timeout_s=3.0))
    procs = list(engine.followers.procs.values())
    try:
        _first_steps(engine)
        os.kill(procs[0].pid, signal.SIGSTOP)  # alive, but never joins the next collective
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"collective failed with ranks \[1\] alive"):
            engine.verify([VerifyInput("a", len(engine.seqs["a"].tokens), [4], 10_000)])
        assert time.monotonic() - t0 < 20  # 3 s collective timeout + 2 s to look for the dead
    finally:
        engine.close()  # a stopped process ignores SIGTERM: close() must SIGKILL it
    assert_gone(procs)
