"""`splitflash up`: three named processes, a dead worker restarted, Ctrl-C stops all."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import free_port, http_get

pytestmark = pytest.mark.real_model


def children(pid: int) -> dict[str, int]:
    """Service name -> pid of the processes whose parent is `pid`."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == pid and b"serve" in cmd:
            found[cmd[cmd.index(b"serve") + 1].decode()] = int(stat.parent.name)
    return found


def wait(check, what, timeout=180.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(what)


def test_up_supervises_and_stops_everything_on_ctrl_c(real_model_path):
    port, base = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "SPLITFLASH_VERIFY_METRICS_PORT": "0",
        "SPLITFLASH_DRAFT_METRICS_PORT": "0",
    }
    up = subprocess.Popen(
        [sys.executable, "-m", "splitflash", "up", "--port", str(port), "--base-port", str(base)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait(lambda: http_get(url + "/ready", 2)[0] == 200, "ready")
        procs = children(up.pid)
        assert set(procs) == {"verify", "draft", "gateway"}
        os.kill(procs["draft"], signal.SIGKILL)  # a worker dies: restarted with backoff
        wait(
            lambda: children(up.pid).get("draft") not in (None, procs["draft"]),
            "draft restarted",
            60,
        )
        wait(
            lambda: json.loads(http_get(url + "/ready", 2)[1])["draft"]["alive"],
            "restarted drafter connected",
        )
        running = children(up.pid)
        assert set(running) == {"verify", "draft", "gateway"}
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        for pid in running.values():
            wait(
                lambda p=pid: (
                    not Path(f"/proc/{p}").exists()
                    or "Z" in Path(f"/proc/{p}/stat").read_text().split()[2]
                ),
                f"{pid} gone",
                30,
            )
    finally:
        if up.poll() is None:
            up.kill()
        for pid in children(up.pid).values():
            os.kill(pid, signal.SIGKILL)
