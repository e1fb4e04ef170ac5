"""`splitflash up`: verify, draft and gateway as three supervised OS processes.

Each runs as `python -m splitflash serve NAME`, so `ps` names it and an operator can signal
it. A worker that dies is restarted with exponential backoff (the gateway degrades in the
meantime: no drafter -> plain decoding, no verify -> 503). Ctrl-C stops all three.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from splitflash.models import store


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        print(
            f"[up] started {self.name} (pid {self.proc.pid}): {' '.join(self.argv[1:])}",
            file=sys.stderr,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def register(sub) -> None:
    p = sub.add_parser("up", help="start verify, draft and gateway on this machine")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--target", default=store.DEFAULT_TARGET)
    p.add_argument("--drafter", default="ngram", help="ngram | dflash[:PATH] | none")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--base-port", type=int, default=5555, help="first of the ZeroMQ ports")
    p.add_argument("--demo", action="store_true", help="send one request, print it, stop")
    p.set_defaults(run=run)


def child_env(args) -> dict[str, str]:
    verify = f"tcp://127.0.0.1:{args.base_port}"
    draft = f"tcp://127.0.0.1:{args.base_port + 1}"
    env = dict(os.environ)
    env.update(
        {
            "SPLITFLASH_VERIFY_BIND": verify,
            "SPLITFLASH_VERIFY_TARGET": args.target,
            "SPLITFLASH_VERIFY_DEVICE": args.device,
            "SPLITFLASH_VERIFY_DRAFT_ADDR": draft if args.drafter != "none" else "",
            "SPLITFLASH_DRAFT_BIND": draft,
            "SPLITFLASH_DRAFT_DRAFTER": args.drafter,
            "SPLITFLASH_DRAFT_TARGET": args.target,
            "SPLITFLASH_DRAFT_DEVICE": args.device,
            "SPLITFLASH_GATEWAY_HOST": args.host,
            "SPLITFLASH_GATEWAY_PORT": str(args.port),
            "SPLITFLASH_GATEWAY_VERIFY_ADDR": verify,
            "SPLITFLASH_GATEWAY_DRAFT_ADDR": draft if args.drafter != "none" else "",
            "SPLITFLASH_GATEWAY_TARGET": args.target,
        }
    )
    return env


def wait_ready(url: str, children: list[Child], timeout_s: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.proc is not None and child.proc.poll() is not None and child.restarts > 3:
                return False
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        supervise(children)
        time.sleep(0.5)
    return False


def supervise(children: list[Child]) -> None:
    """Restart dead workers with backoff (1, 2, 4 ... 30 s)."""
    now = time.monotonic()
    for child in children:
        if child.proc is None or child.proc.poll() is None:
            continue
        if child.next_start == 0.0:
            delay = min(30.0, 2.0**child.restarts)
            child.next_start = now + delay
            print(
                f"[up] {child.name} exited with {child.proc.returncode}; restarting in "
                f"{delay:.0f} s",
                file=sys.stderr,
            )
        elif now >= child.next_start:
            child.restarts += 1
            child.next_start = 0.0
            child.start()


def demo(url: str) -> None:
    body = {
        "model": "smollm2-135m",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": "Write two sentences about the sea, then repeat them word for word.",
            }
        ],
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    print(out["choices"][0]["message"]["content"])
    print(
        json.dumps(
            {
                "usage": out["usage"],
                "speculative_decoding_stats": out["speculative_decoding_stats"],
            },
            indent=2,
        )
    )


def run(args) -> int:
    store.resolve(args.target)  # a clear error now rather than three failing services
    env = child_env(args)
    py = sys.executable
    children = [
        Child(name, [py, "-m", "splitflash", "serve", name], env)
        for name in ("verify", "draft", "gateway")
        if name != "draft" or args.drafter != "none"
    ]
    url = f"http://{args.host}:{args.port}"

    def interrupt(signum, _frame):
        raise KeyboardInterrupt  # one shutdown path for Ctrl-C and SIGTERM

    # explicit: a shell starting `up` in the background would leave SIGINT ignored
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    for child in children:
        child.start()
    try:
        if not wait_ready(url, children):
            print("[up] the services did not become ready", file=sys.stderr)
            return 1
        print(f"[up] splitflash ready at {url} (OpenAI API under {url}/v1)")
        if args.demo:
            demo(url)
            return 0
        while True:
            supervise(children)
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        # The gateway first, and each gone before the next: a gateway still serving while
        # its workers vanish logs their loss and fails its in-flight requests' releases.
        for child in reversed(children):
            child.stop()
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
