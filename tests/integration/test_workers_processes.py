"""`splitflash serve verify` and `splitflash serve draft` as real OS processes on the real
default model: one request over tcp equals target-only greedy; SIGTERM stops them cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from splitflash.local import generate_local
from splitflash.models import store
from splitflash.models.kv_cache import PagedKVCache
from splitflash.protocol import PeerTimeout, ProtocolError
from splitflash.services.verify.engine import TargetEngine
from tests.e2e.cluster import free_port
from tests.integration.workers_harness import Run, client_for, gateway_generate

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

# Runs the CLI with the serve/health commands registered even before cli/main.py lists them.
CLI = (
    "import sys; from splitflash.cli import main, serve_cmd\n"
    "if serve_cmd not in main.COMMANDS: main.COMMANDS.append(serve_cmd)\n"
    "sys.exit(main.main(sys.argv[1:]))"
)
START_S = 60.0


def wait_healthy(service: str, addr: str, proc: subprocess.Popen, log_path) -> None:
    """Probe until it answers (each probe blocks in zmq poll, no sleep) or START_S passes."""
    from splitflash.cli.serve_cmd import probe

    end = time.monotonic() + START_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"{service} exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            probe(service, addr, 1.0)
            return
        except (PeerTimeout, ProtocolError):
            continue
    pytest.fail(f"{service} not healthy within {START_S} s:\n{log_path.read_text()}")


def test_serve_processes_generate_like_target_only(real_target, tmp_path):
    model, tokenizer = real_target
    env = {**os.environ, "SPLITFLASH_CACHE": str(store.cache_dir())}
    vaddr, daddr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    cmds = {
        "draft": ["serve", "draft", "--bind", daddr, "--metrics-port", "0"],
        "verify": [
            "serve",
            "verify",
            "--bind",
            vaddr,
            "--metrics-port",
            "0",
            "--kv-pages",
            "64",
            "--draft-addr",
            "",
        ],
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in cmds.items():
            log = tmp_path / f"{name}.log"
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", CLI, *argv],
                env=env,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
        for name, addr in (("draft", daddr), ("verify", vaddr)):
            wait_healthy(name, addr, procs[name], tmp_path / f"{name}.log")
        health = subprocess.run(
            [sys.executable, "-c", CLI, "health", "verify", "--addr", vaddr],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0, health.stdout + health.stderr

        prompt = tokenizer("List the days of the week: Monday, Tuesday,").input_ids
        run = Run("real", prompt, max_tokens=16)
        with client_for(vaddr, "verify") as vc, client_for(daddr, "draft") as dc:
            gateway_generate(vc, dc, [run], block=6)
        cfg = model.cfg
        engine = TargetEngine(
            model, PagedKVCache(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim)
        )
        stop = tuple(cfg.eos_token_ids)
        want = generate_local(engine, None, prompt, 16, stop_ids=stop).token_ids
        assert run.out == want
        assert sum(r.accepted_drafts for r in run.results) > 0  # the days of the week repeat

        for name, proc in procs.items():
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0, (tmp_path / f"{name}.log").read_text()
        assert "verify stopped" in (tmp_path / "verify.log").read_text()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
