"""`splitflash bench NAME`: every listed benchmark exists with a main(argv), and the CLI runs
one (the CPU host-step benchmark) end to end."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from splitflash.cli.bench_cmd import BENCHES


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_listed_benchmark_has_a_main(name):
    module = importlib.import_module(BENCHES[name])
    assert callable(module.main) and module.__doc__, name


def test_every_benchmark_module_is_listed():
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    modules = {f"bench.{p.stem}" for p in bench_dir.glob("*.py") if p.stem != "__init__"}
    assert modules == set(BENCHES.values())


def test_cli_runs_the_host_step_benchmark():
    out = subprocess.run(
        [sys.executable, "-m", "splitflash", "bench", "host_step", "--",
         "--contexts", "512", "4096", "--reps", "5", "--batches", "1", "3"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    rows = [line.split() for line in lines[1:3]]
    assert [r[0] for r in rows] == ["512", "4096"] and all(float(x) > 0 for r in rows for x in r)
    # verify() rows (context, B, ms, ms per request): 20+ steps each ran without a desync.
    steps = [line.split() for line in lines[4:]]
    assert [(r[0], r[1]) for r in steps] == [("512", "1"), ("512", "3"), ("4096", "1"),
                                             ("4096", "3")]  # fmt: skip
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in steps)


def test_cli_runs_the_draft_host_benchmark():
    """It times the graph path (it exits non-zero when the step would run eagerly)."""
    out = subprocess.run(
        [sys.executable, "-m", "splitflash", "bench", "draft_host", "--",
         "--batches", "1", "2", "--reps", "5"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.replace(":", "").split() for line in out.splitlines() if line.startswith("B ")]
    assert [r[1] for r in rows] == ["1", "2"] and all(float(r[2]) > 0 for r in rows), out


def test_cli_runs_the_feature_send_benchmark():
    """Both ways deliver every request's features (the bench exits non-zero otherwise)."""
    out = subprocess.run(
        [sys.executable, "-m", "splitflash", "bench", "feature_send", "--",
         "--batches", "1", "3", "--reps", "5", "--rows", "4"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.replace(":", "").split() for line in out.splitlines() if line.startswith("B ")]
    assert [r[1] for r in rows] == ["1", "3"]
    assert all(float(r[5]) > 0 and float(r[8]) > 0 for r in rows), out


def test_cli_runs_the_long_context_benchmark_losslessly(real_model_path, tmp_path):
    """The real model and the shipped drafter, both windows, two contexts: in fp32 every
    DFlash output equals target-only decoding token for token (no divergence at all, not
    even one the bench would take as a rounding tie)."""
    out = tmp_path / "lc.json"
    subprocess.run(
        [sys.executable, "-m", "splitflash", "bench", "long_context", "--",
         "--device", "cpu", "--target", str(real_model_path), "--contexts", "48", "160",
         "--max-tokens", "10", "--block-size", "4", "--warm-steps", "1",
         "--windows", "checkpoint", "off", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["context"], r["way"]) for r in rows] == [
        (c, w) for c in (48, 160) for w in ("target-only", "dflash (checkpoint)", "dflash (off)")
    ]
    assert all(r["tokens"] == 10 and r["decode_tok_s"] > 0 and not r["violations"] for r in rows)
    assert all(r["mean_commit_len"] == 1.0 for r in rows if r["way"] == "target-only")
    assert not [r for r in rows if "divergence" in r]


def test_cli_runs_the_context_append_benchmark():
    """Per-request and batched appends leave equal caches (the bench asserts it)."""
    out = subprocess.run(
        [sys.executable, "-m", "splitflash", "bench", "context_append", "--",
         "--device", "cpu", "--batches", "1", "3", "--reps", "3", "--context", "40"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.replace(":", "").split() for line in out.splitlines() if line.startswith("B ")]
    assert [r[1] for r in rows] == ["1", "3"]
    assert all(float(r[5]) > 0 and float(r[8]) > 0 for r in rows), out


def test_the_kernel_benchmark_streams_several_l2_sizes_per_timed_call(monkeypatch):
    """L2 cold: K/V under L2_MULTIPLE x L2 gets copies enough to stream that much per call
    (at 8k keys, batch 1, the issue's shape holds 34 MB, under an H100's 50 MB L2)."""
    from bench import kernels

    monkeypatch.setattr(kernels, "l2_bytes", lambda: 50 << 20)
    issue_8k = 2 * 8192 * 8 * 128 * 2  # K and V, batch 1, bf16
    copies = kernels.copies_for(issue_8k, "cold")
    assert copies * issue_8k >= kernels.L2_MULTIPLE * (50 << 20) > (copies - 1) * issue_8k
    assert kernels.copies_for(64 * issue_8k, "cold") == 1  # 2 GiB: far past L2 already
    assert kernels.copies_for(1, "cold") == kernels.MAX_COPIES
    assert kernels.copies_for(issue_8k, "warm") == 1
