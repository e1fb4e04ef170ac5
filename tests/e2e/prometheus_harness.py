"""A real Prometheus on loopback scraping a live `Cluster`, for end-to-end tests.

Job names are those of docker/prometheus.yml (splitflash-gateway/-draft/-verify), so the
dashboards' and alerts' `up{job=~"splitflash-.*"}` selectors mean the same here. Scrape
interval 1 s: rate() windows of a minute see tens of samples within a short test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, free_port

CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: splitflash-gateway
    static_configs: [{{targets: ["127.0.0.1:{gateway}"]}}]
  - job_name: splitflash-draft
    static_configs: [{{targets: ["127.0.0.1:{draft}"]}}]
  - job_name: splitflash-verify
    static_configs: [{{targets: ["127.0.0.1:{verify}"]}}]
"""


def prometheus_binary() -> str:
    """The binary's path; a skip with the reason when missing (a failure when CI is set:
    there the observability tests must run, not vanish)."""
    path = shutil.which("prometheus")
    if path is None:
        reason = "prometheus binary not found (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    def _api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query -> the result vector ([{metric, value}]); errors raise (a 400 for
        a PromQL parse error surfaces as HTTPError with Prometheus' message)."""
        try:
            data = self._api("/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"query failed ({e.code}): {e.read().decode()}\n{expr}") from e
        result = data["result"]
        if data["resultType"] == "scalar":  # scalar(): one value, no labels
            return [{"metric": {}, "value": result}]
        return result

    def value(self, expr: str) -> float:
        result = self.query(expr)
        if len(result) != 1:
            raise AssertionError(f"{expr!r} gave {len(result)} series, wanted one: {result}")
        return float(result[0]["value"][1])

    def targets_up(self) -> dict[str, float]:
        return {r["metric"]["job"]: float(r["value"][1]) for r in self.query("up")}

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except AssertionError as e:  # not there yet (e.g. no sample scraped)
                last = e
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: timed out waiting for {what} ({last})")

    def wait_scraped(self, timeout: float = 15.0) -> None:
        """Until a scrape newer than now has landed for every target."""
        since = time.time()

        def fresh() -> bool:
            res = self.query("timestamp(up)")
            return len(res) == 3 and all(float(r["value"][1]) > since for r in res)

        self.wait_for(fresh, timeout, "a fresh scrape of all three targets")


@contextmanager
def running_prometheus(cluster: Cluster, timeout: float = 30.0) -> Iterator[Prometheus]:
    """Prometheus scraping the cluster's three /metrics; stopped (and its files removed)
    in a finally, whatever the test did."""
    binary = prometheus_binary()
    workdir = Path(tempfile.mkdtemp(prefix="splitflash-prom-"))
    port = free_port()
    (workdir / "prometheus.yml").write_text(
        CONFIG.format(
            gateway=cluster.port, draft=cluster.draft_metrics, verify=cluster.verify_metrics
        )  # fmt: skip
    )
    log = workdir / "prometheus.log"
    proc = None
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(prom.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout} s: {log.read_text()}")
            time.sleep(0.25)
        yield prom
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
