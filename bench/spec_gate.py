"""The gateway's speculation gate end to end (services/gateway/spec_gate.py): `splitflash up`
with the gate on and off, alternated `--rounds` times, the same greedy requests through HTTP.
Per setting and chat prompt: tokens/s of a speculative request (wall time of the whole
non-streaming request) and of a target-only one
(`speculative.enabled` false, the yardstick, measured in the same server), its mean
commit_len, and the request-steps the gate paused (fallback reason "unprofitable").

    python -m bench.spec_gate --device cpu --drafter dflash --rounds 2 --json-out gate.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

PROMPTS = {  # chat messages: free prose, and text a drafter can predict
    "hash_table": "Explain in a few sentences how a hash table works and why lookups are fast.",
    "counting": "Count from 1 to 60, separated by commas.",
}


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _unprofitable(metrics: str) -> float:
    name = 'splitflash_spec_fallback_steps_total{reason="unprofitable"}'
    return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name))


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"`splitflash up` exited with {proc.returncode} before /ready")
        try:
            if json.loads(_get(url + "/ready")).get("ready"):
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/ready not ready after {timeout:.0f} s")


def _request(url: str, prompt: str, max_tokens: int, spec: bool) -> dict:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0,
            "speculative": {"enabled": spec}}  # fmt: skip
    start = time.perf_counter()
    reply = _post(url + "/v1/chat/completions", body)
    seconds = time.perf_counter() - start
    stats = reply.get("speculative_decoding_stats", {})
    tokens = reply["usage"]["completion_tokens"]
    return dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds,
                mean_commit_len=stats.get("mean_commit_len"),
                text=reply["choices"][0]["message"]["content"])  # fmt: skip


def run_setting(args, gate: bool) -> list[dict]:
    """One `splitflash up` with the gate on or off: every prompt, speculative and not."""
    env = dict(os.environ, SPLITFLASH_GATEWAY_SPEC_GATE="1" if gate else "0")
    argv = [sys.executable, "-m", "splitflash", "up", "--device", args.device,
            "--drafter", args.drafter, "--port", str(args.port)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    try:
        _wait_ready(url, proc, args.ready_timeout)
        _request(url, "Hello.", 8, True)  # warm-up: first-call costs out of the timings
        for name, prompt in PROMPTS.items():
            for spec in (True, False):
                before = _unprofitable(_get(url + "/metrics"))
                row = _request(url, prompt, args.max_tokens, spec)
                row.update(gate=gate, prompt=name, speculative=spec,
                           paused_steps=_unprofitable(_get(url + "/metrics")) - before)  # fmt: skip
                rows.append(row)
                print(f"gate {'on ' if gate else 'off'} {name:10s} "
                      f"{'speculative' if spec else 'target-only':11s} {row['tok_s']:7.2f} tok/s "
                      f"commit_len {row['mean_commit_len'] or 0:.2f} "
                      f"paused steps {row['paused_steps']:.0f}", flush=True)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec_gate", description=__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--drafter", default="dflash", help="ngram | dflash[:PATH]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    rows = []
    for _ in range(args.rounds):
        for gate in (True, False):
            rows += run_setting(args, gate)
    texts = {(r["prompt"]) for r in rows}
    same = all(len({r["text"] for r in rows if r["prompt"] == t}) == 1 for t in texts)
    print(f"every setting gave the same text per prompt: {same}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "same_text": same, "rows": rows}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
