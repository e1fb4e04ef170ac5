"""The three services as real OS processes on loopback, for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Ports handed out by this process: a port is never given twice, since the service it
# was meant for may not have bound it yet.
_HANDED_OUT: set[int] = set()
# Below Linux's ephemeral range (32768-60999 by default), where bind(0) and every
# outbound connection take their ports: a port from there can be taken by some client
# socket between the check and the service's bind (CI once failed on exactly that).
_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A loopback port that binds now, outside the ephemeral range, not handed out before."""
    for _ in range(1000):
        port = random.randrange(*_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORT_RANGE}")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def http_post(url: str, body, timeout: float = 120.0, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{")[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@dataclass
class Cluster:
    drafter: str = "ngram"
    extra_env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)
    logs: Path | None = None

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.verify_addr = f"tcp://127.0.0.1:{free_port()}"
        self.draft_addr = f"tcp://127.0.0.1:{free_port()}"
        self.verify_metrics = free_port()
        self.draft_metrics = free_port()
        self.env = {
            **os.environ,
            "SPLITFLASH_VERIFY_BIND": self.verify_addr,
            "SPLITFLASH_VERIFY_DRAFT_ADDR": self.draft_addr if self.drafter != "none" else "",
            "SPLITFLASH_VERIFY_METRICS_PORT": str(self.verify_metrics),
            "SPLITFLASH_VERIFY_KV_PAGES": "512",
            "SPLITFLASH_DRAFT_BIND": self.draft_addr,
            "SPLITFLASH_DRAFT_DRAFTER": self.drafter,
            "SPLITFLASH_DRAFT_METRICS_PORT": str(self.draft_metrics),
            "SPLITFLASH_GATEWAY_PORT": str(self.port),
            "SPLITFLASH_GATEWAY_VERIFY_ADDR": self.verify_addr,
            "SPLITFLASH_GATEWAY_DRAFT_ADDR": self.draft_addr if self.drafter != "none" else "",
            "SPLITFLASH_GATEWAY_MAX_CONTEXT": "2048",
            "SPLITFLASH_GATEWAY_DRAFT_TIMEOUT_S": "5",
            # These tests check drafting itself (stats, fallbacks, a drafter's restart): the
            # speculation gate, which may pause an unprofitable drafter on a slow CI box, is
            # off here; tests/integration/test_spec_gate_services.py tests it.
            "SPLITFLASH_GATEWAY_SPEC_GATE": "0",
            **self.extra_env,
        }

    def start(self, name: str) -> None:
        if self.logs is None:
            out = subprocess.DEVNULL
        else:
            out = (self.logs / f"{name}.log").open("ab")  # the child keeps its own copy
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "splitflash", "serve", name],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        if out is not subprocess.DEVNULL:
            out.close()

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.tail(name)}")
            try:
                status, body = http_get(self.url + "/ready", timeout=2)
                if status == 200:
                    return json.loads(body)
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"gateway not ready after {timeout} s")

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.25)
        raise TimeoutError(f"timed out waiting for {what}")

    def tail(self, name: str) -> str:
        if not self.logs:
            return ""
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def metrics(self, which: str = "gateway") -> str:
        url = {
            "gateway": self.url + "/metrics",
            "verify": f"http://127.0.0.1:{self.verify_metrics}/metrics",
            "draft": f"http://127.0.0.1:{self.draft_metrics}/metrics",
        }[which]
        return http_get(url)[1]
