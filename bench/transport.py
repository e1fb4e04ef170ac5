"""Share of step time spent in transport, from the per-request traces of a running gateway.

    python -m bench.transport --url http://127.0.0.1:8000 [--requests 8] [--concurrency 4]

Transport = round trips measured by the gateway minus the compute the workers report
(serialisation, sockets, queueing). Prints p50/p90 of transport / (draft + verify +
transport) over all steps, and the same for the absolute milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    prompts = [f"Write the numbers from {i} to {i + 20} in words." for i in range(args.requests)]

    def one(prompt: str) -> list[dict]:
        body = {
            "model": "smollm2-135m",
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
        rid = _post(args.url + "/v1/chat/completions", body)["id"]
        return _get(f"{args.url}/v1/requests/{rid}/trace")["steps"]

    with ThreadPoolExecutor(args.concurrency) as pool:
        steps = [s for trace in pool.map(one, prompts) for s in trace]
    share = [
        s["transport_ms"] / max(1e-9, s["draft_ms"] + s["verify_ms"] + s["transport_ms"])
        for s in steps
    ]
    q = statistics.quantiles
    print(
        json.dumps(
            {
                "steps": len(steps),
                "concurrency": args.concurrency,
                "transport_share_p50": round(statistics.median(share), 4),
                "transport_share_p90": round(q(share, n=10)[-1], 4),
                "transport_ms_p50": round(statistics.median(s["transport_ms"] for s in steps), 3),
                "verify_ms_p50": round(statistics.median(s["verify_ms"] for s in steps), 3),
                "draft_ms_p50": round(statistics.median(s["draft_ms"] for s in steps), 3),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
