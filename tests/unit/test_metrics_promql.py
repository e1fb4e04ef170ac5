"""Dashboards' and alerts' PromQL run by a real Prometheus (skipped without the binary).

1. Every expression parses (Prometheus answers 400 to a parse error).
2. The dashboards' pooled formulas, evaluated by Prometheus on what metrics.py exports after
   record_spec_step, equal spec_totals' numbers: the dashboard and the code do the same math.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from splitflash.services.common import metrics as m
from splitflash.services.common.spec_totals import (
    SpecTotals,
    acceptance_rate,
    mean_commit_len,
    per_position_acceptance,
)
from tests.e2e.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed"),
    pytest.mark.slow,
]

# (K, max_depth, a, c, context_bucket) per request-step: two requests, short and long context
STEPS = [(15, 15, 6, 7, "<=2k")] + [(15, 15, 0, 1, ">128k")] * 9 + [(3, 2, 2, 3, "<=2k")]


def serve_registry(registry: CollectorRegistry) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def query(base: str, expr: str) -> tuple[int, dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus on a free loopback port scraping the fake gateway every second."""
    registry = CollectorRegistry()  # what the fake gateway serves, filled before the scrape
    g = m.gateway_metrics(registry)
    for k, depth, a, c, bucket in STEPS:
        m.record_spec_step(g.spec, bucket, k, depth, a, c)
        g.generated_tokens.labels(context_bucket=bucket).inc(c)
    exporter = serve_registry(registry)
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "splitflash-gateway",
                "static_configs": [{"targets": [f"127.0.0.1:{exporter.server_port}"]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready, and the first scrape has landed
            try:
                status, body = query(base, "splitflash_spec_commit_len_count")
                if status == 200 and body["data"]["result"]:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prometheus did not start or scrape within 60 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        exporter.shutdown()


GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s"}


def with_ranges(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def all_exprs() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "docker/grafana/dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            out += [(f"{path.name}: {panel['title']}", t["expr"]) for t in panel["targets"]]
    for group in yaml.safe_load((ROOT / "docker/alerts.yml").read_text())["groups"]:
        out += [(f"alert {r['alert']}", r["expr"]) for r in group["rules"]]
    return out


def test_every_expression_parses(prom: str) -> None:
    exprs = all_exprs()
    assert len(exprs) > 30
    for where, expr in exprs:
        status, body = query(prom, with_ranges(expr))
        assert status == 200, f"{where}: {body.get('error')}\n{expr}"


def panel_expr(title: str) -> str:
    for path in (ROOT / "docker/grafana/dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            if panel["title"] == title:
                return panel["targets"][0]["expr"]
    raise KeyError(title)


def lifetime(expr: str) -> str:
    """rate(x[$__rate_interval]) / increase(x[$__range]) -> x: the same formula over the
    counters' whole life, which is what spec_totals pools (ratios of rates over one window
    equal ratios of increases, so the structure under test is unchanged)."""
    return re.sub(r"\b(?:rate|increase)\(([^()\[]+)\[\$__\w+\]\)", r"\1", expr)


def values(prom: str, expr: str, label: str | None = None) -> dict[str | None, float]:
    status, body = query(prom, lifetime(expr))
    assert status == 200, body
    return {
        (r["metric"].get(label) if label else None): float(r["value"][1])
        for r in body["data"]["result"]
    }


def test_dashboard_formulas_equal_the_pooled_math(prom: str) -> None:
    t, by_bucket = SpecTotals(), {}
    for k, depth, a, c, bucket in STEPS:
        t = t.add(k, depth, a, c)
        by_bucket[bucket] = by_bucket.get(bucket, SpecTotals()).add(k, depth, a, c)

    got = values(prom, panel_expr("Mean commit length"))[None]
    assert got == pytest.approx(mean_commit_len(t))  # 19 / 11, not the mean of means
    got = values(prom, panel_expr("Acceptance rate"))[None]
    assert got == pytest.approx(acceptance_rate(t))
    got = values(prom, panel_expr("Acceptance by position (time range)"), "position")
    want = per_position_acceptance(t)
    assert {int(p): v for p, v in got.items() if int(p) < len(want)} == pytest.approx(
        dict(enumerate(want))
    )
    got = values(prom, panel_expr("Acceptance rate by context bucket"), "context_bucket")
    for bucket, bt in by_bucket.items():
        assert got[bucket] == pytest.approx(acceptance_rate(bt))
    got = values(prom, panel_expr("Mean commit length by context bucket"), "context_bucket")
    for bucket, bt in by_bucket.items():
        assert got[bucket] == pytest.approx(mean_commit_len(bt))
