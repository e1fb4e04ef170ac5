"""Talking to a running gateway: the only module of this package that does I/O.

Prompts are built without a tokenizer: a natural paragraph repeated, sized from the token
counts the server itself reports (`usage.prompt_tokens`), so doctor needs nothing but a URL.
Each measured request is a greedy stream, so the decode time (first token to last) is
separated from prefill, followed by its per-step trace from `/v1/requests/{id}/trace`.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import httpx

from splitflash.diagnosis.rows import Samples, parse_metrics

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "can of oil and a cloth for the lens. From the gallery he could see the fishing boats "
    "returning to the harbour, their lamps swaying with the swell, and the long line of "
    "the coast fading into the grey of the sea. He wrote the weather in his logbook, wound "
    "the clockwork that turned the light, and waited for the first beam to sweep the water. "
)


class DoctorError(RuntimeError):
    """Doctor could not run (gateway unreachable, not ready, refused every request)."""


class Gateway:
    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str) -> httpx.Response:
        try:
            return self.client.get(self.url + path, timeout=10.0)
        except httpx.HTTPError as e:
            raise DoctorError(f"gateway unreachable at {self.url}: {e}") from e

    def ready(self) -> dict:
        """The /ready body; DoctorError when the gateway is down or not ready."""
        resp = self._get("/ready")
        try:
            body = resp.json()
        except json.JSONDecodeError:
            body = {}
        if resp.status_code != 200:
            raise DoctorError(
                f"gateway at {self.url} is not ready ({resp.status_code}): {resp.text[:300]}"
            )
        return body

    def model(self) -> str:
        data = self._get("/v1/models").json().get("data") or [{}]
        return str(data[0].get("id", ""))

    def metrics(self) -> Samples:
        resp = self._get("/metrics")
        return parse_metrics(resp.text) if resp.status_code == 200 else {}

    def prompt_tokens(self, model: str, prompt: str) -> int:
        """Server-side token count of `prompt` (a 1-token request)."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        resp = self.client.post(self.url + "/v1/completions", json=body)
        if resp.status_code != 200:
            raise DoctorError(f"calibration request refused ({resp.status_code}): {resp.text}")
        return int(resp.json()["usage"]["prompt_tokens"])

    def calibrate(self, model: str) -> tuple[float, int]:
        """(tokens per paragraph, fixed tokens) from two server-side counts."""
        one, five = (self.prompt_tokens(model, PARAGRAPH * n) for n in (1, 5))
        per = (five - one) / 4
        return per, round(one - per)

    def stream(self, model: str, prompt: str, max_tokens: int) -> dict:
        """One greedy streamed completion -> {context, trace, decode_s, tokens, reported}.
        Raises DoctorError with the server's message when the request is refused."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        rid, first, last, final = "", None, None, {}
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise DoctorError(f"{resp.status_code}: {resp.read().decode()[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise DoctorError(f"stream failed: {chunk['error'].get('message')}")
                rid = chunk.get("id", rid)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                if "usage" in chunk or "speculative_decoding_stats" in chunk:
                    final.update(chunk)
        trace = self.client.get(f"{self.url}/v1/requests/{rid}/trace", timeout=10.0)
        if trace.status_code != 200:
            raise DoctorError(f"trace of {rid} unavailable ({trace.status_code}): {trace.text}")
        usage = final.get("usage") or {}
        t = trace.json()
        return {
            "request_id": rid,
            "context": int(usage.get("prompt_tokens", t.get("prompt_tokens", 0))),
            "tokens": int(usage.get("completion_tokens", t.get("completion_tokens", 0))),
            "decode_s": (last - first) if first is not None and last is not None else 0.0,
            "trace": t.get("steps", []),
            "reported": final.get("speculative_decoding_stats") or {},
        }


def metrics_url(ready: dict, role: str) -> tuple[str | None, str]:
    """The /metrics URL of the deployment's one `role` ("verify" | "draft") worker from the
    gateway's /ready (the address the gateway reaches it at, the metrics port its Hello
    announced), or (None, why not). Several workers: doctor's deltas would mix them."""
    workers = (ready.get(role) or {}).get("workers") or []
    if len(workers) != 1:
        return None, f"{len(workers)} {role} workers behind the gateway"
    port = str((workers[0].get("info") or {}).get("metrics_port", ""))
    if port in ("", "0"):
        return None, f"the {role} worker announces no metrics port"
    host = urlsplit(str(workers[0].get("addr", ""))).hostname
    if not host:
        return None, f"no host in the {role} address {workers[0].get('addr')!r}"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics", ""


def scrape(url: str) -> Samples | None:
    """A worker's /metrics (None when it cannot be read: doctor then goes without)."""
    try:
        resp = httpx.get(url, timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


def prompt_for(context: int, per_paragraph: float, fixed: int) -> str:
    """About `context` prompt tokens: whole paragraphs, then the next one trimmed by words
    (tokens per word from the calibration). The server's usage says how many it really was."""
    words = PARAGRAPH.split()
    per_word = max(per_paragraph, 1.0) / len(words)
    n = max(1, round((context - fixed) / per_word))
    return " ".join(words[i % len(words)] for i in range(n))
