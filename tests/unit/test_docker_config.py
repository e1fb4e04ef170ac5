"""The container stack's configuration agrees with itself and with the code.

compose.yaml against the compose spec, Prometheus config and alerts through promtool (rules
unit-tested on synthetic series), and every metric and label that a dashboard or an alert
queries checked against the metric catalogue the services register
(splitflash/services/common/metric_math.METRICS): a renamed metric fails here, not on a
blank dashboard in production.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from splitflash.services.common.metric_math import METRICS, PREFIX, series_labels

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", target.get("expr", "")))
    return out


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs() + [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


# -- compose -------------------------------------------------------------------------------


def test_compose_validates_against_compose_spec() -> None:
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema not installed (pip install check-jsonschema)")
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    proc = subprocess.run([*cmd, str(ROOT / "compose.yaml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services_ports_gpu_and_cpu_profiles() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert {"gateway", "draft", "verify", "prometheus", "grafana"} <= set(services)
    assert "8000:8000" in services["gateway"]["ports"]
    assert "9090:9090" in services["prometheus"]["ports"]
    assert "3000:3000" in services["grafana"]["ports"]
    workers = (("verify", {"5555"}, "9102"), ("draft", {"5556"}, "9101"))
    for name, zmq_ports, metrics_port in workers:
        gpu, cpu = services[name], services[f"{name}-cpu"]
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert "deploy" not in cpu and cpu["profiles"] == ["cpu"]
        # the CPU variant answers to the same DNS name, so addresses and scrapes do not change
        assert cpu["networks"]["default"]["aliases"] == [name]
        for svc, device in ((gpu, "cuda"), (cpu, "cpu")):
            env = svc["environment"]
            prefix = f"SPLITFLASH_{name.upper()}_"
            assert env["SPLITFLASH_SERVICE"] == name and env[prefix + "DEVICE"] == device
            assert env[prefix + "METRICS_PORT"] == metrics_port
            assert env[prefix + "METRICS_HOST"] == "0.0.0.0"
            assert env[prefix + "BIND"].startswith("tcp://0.0.0.0:")
            assert env["SPLITFLASH_CACHE"] == "/models" and "models:/models" in svc["volumes"]
            assert zmq_ports | {metrics_port} <= set(svc["expose"])
            assert "ports" not in svc  # published ports would stop `--scale`
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    for mount in (*services["prometheus"]["volumes"], *services["grafana"]["volumes"]):
        host = mount.split(":")[0]
        if host.startswith("./"):
            assert (ROOT / host).exists(), f"compose mounts missing {host}"


def test_dockerfiles_run_as_non_root_with_healthchecks() -> None:
    gateway = (DOCKER / "gateway.Dockerfile").read_text()
    worker = (DOCKER / "worker.Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", gateway, re.M)
    assert "exec splitflash serve gateway" in gateway
    assert "/health" in gateway and "HEALTHCHECK" in gateway
    assert re.search(r"^ARG VARIANT=cuda", worker, re.M) and "FROM base-${VARIANT}" in worker
    assert 'splitflash health "$SPLITFLASH_SERVICE"' in worker  # --addr: its own bind
    assert 'exec splitflash serve \\"$SPLITFLASH_SERVICE\\"' in worker
    for text in (gateway, worker):
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0")
        assert "SPLITFLASH_CACHE=/models" in text


def test_gateway_requirements_match_pyproject() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ ]", d)[0]: d for d in project["dependencies"]}
    lines = (DOCKER / "requirements-gateway.txt").read_text().splitlines()
    for req in (ln.split("#")[0].strip() for ln in lines):
        if req:
            name = re.split(r"[<>=!~ ]", req)[0]
            assert declared.get(name) == req, f"{req} differs from pyproject's {declared.get(name)}"


# -- prometheus ----------------------------------------------------------------------------


@needs_promtool
@pytest.mark.parametrize(
    "args",
    [("check", "rules", "docker/alerts.yml"), ("check", "config", "docker/prometheus.yml")],
)
def test_promtool_check(args: tuple[str, ...]) -> None:
    proc = subprocess.run([PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_alert_rules_fire_on_their_failures() -> None:
    """docker/alerts.test.yml: labels of every alert, on failing and healthy series."""
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", "docker/alerts.test.yml"], cwd=ROOT, capture_output=True
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_every_alert_is_explained_and_tested_firing() -> None:
    """Each alert has a plain summary and a likely cause, and a promtool case where it fires
    whose expected text (rendered templates included) is spelled out in alerts.test.yml."""
    rules = {r["alert"]: r for r in alert_rules()}
    for name, rule in rules.items():
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "Likely cause" in rule["annotations"]["description"], name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
    cases = yaml.safe_load((DOCKER / "alerts.test.yml").read_text())["tests"]
    firing = {}
    for case in cases:
        for check in case.get("alert_rule_test", []):
            for alert in check["exp_alerts"]:
                firing[check["alertname"]] = alert["exp_annotations"]["summary"]
    assert set(firing) == set(rules), "every alert needs a firing case in alerts.test.yml"
    for name, summary in firing.items():
        assert not re.search(r"\{\{|<no value>|%!|NaN|\+Inf", summary), f"{name}: {summary}"


def test_prometheus_scrapes_every_service() -> None:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    targets = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets[sd["names"][0]] = (sd["port"], job.get("metrics_path", "/metrics"))
    assert targets == {
        "gateway": (8000, "/metrics"),
        "draft": (9101, "/metrics"),
        "verify": (9102, "/metrics"),
    }


# -- grafana -------------------------------------------------------------------------------


def test_dashboards_are_generated_from_build_script() -> None:
    spec = importlib.util.spec_from_file_location(
        "build_dashboards", DOCKER / "grafana" / "build_dashboards.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert sorted(rendered) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert path.read_text() == rendered[path.name], (
            f"{path.name} is stale: run python3 docker/grafana/build_dashboards.py"
        )


def test_every_panel_has_a_query_on_the_provisioned_datasource() -> None:
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    providers = DOCKER / "grafana/provisioning/dashboards/splitflash.yml"
    provider = yaml.safe_load(providers.read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    assert len(DASHBOARDS) == 3
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == uid
            exprs = [t.get("expr", "").strip() for t in panel.get("targets", [])]
            assert exprs and all(exprs), f"{path.name}: {panel['title']} has no PromQL"
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24
    assert len(uids) == len(DASHBOARDS)


# -- dashboards and alerts agree with the code ---------------------------------------------

NAME = re.compile(r"\b" + PREFIX + r"[A-Za-z0-9_]+")
SELECTOR = re.compile(r"\b([a-zA-Z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series


def closed_values() -> dict[str, set[str]]:
    """Label -> the values the services create up front (labels with a closed set)."""
    out: dict[str, set[str]] = {}
    for d in METRICS.values():
        for label, values in d.labels:
            if values:
                out.setdefault(label, set()).update(values)
    return out


def test_every_queried_metric_and_label_exists() -> None:
    series = series_labels()
    series["up"] = frozenset()
    closed = closed_values()
    exprs = all_exprs()
    assert len(exprs) > 30
    used = set()
    for where, expr in exprs:
        names = set(NAME.findall(expr))
        missing = names - set(series)
        assert not missing, f"{where}: unknown metrics {sorted(missing)}"
        used |= names
        allowed = set(TARGET_LABELS).union(*(series[n] for n in names | {"up"} if n in series))
        for metric, body in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(body):
                if metric in series:
                    assert label in series[metric] | TARGET_LABELS, f"{where}: {metric} {label}"
                if label in closed:  # a value the services never produce matches nothing
                    for v in value.split("|") if "~" in op else [value]:
                        assert v in closed[label], f"{where}: {label}={v!r} never exported"
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in allowed, f"{where}: groups by {label!r}, which none has"
    # every metric is shown or alerted on somewhere (the catalogue has no dead entries)
    suffixes = ("_total", "_sum", "_count", "_bucket", "_info")
    shown = used | {n.removesuffix(s) for n in used for s in suffixes if n.endswith(s)}
    unshown = {PREFIX + m for m in METRICS} - shown
    assert not unshown, f"metrics on no dashboard or alert: {sorted(unshown)}"


def test_every_service_variable_in_compose_is_a_settings_field() -> None:
    """SPLITFLASH_<SERVICE>_<FIELD> must name a real field, or the setting is silently lost."""
    import dataclasses

    from splitflash.services.draft.config import DraftSettings
    from splitflash.services.gateway.config import GatewaySettings
    from splitflash.services.verify.config import VerifySettings

    fields = {
        prefix: {f.name.upper() for f in dataclasses.fields(cls)}
        for prefix, cls in (
            ("SPLITFLASH_GATEWAY_", GatewaySettings),
            ("SPLITFLASH_VERIFY_", VerifySettings),
            ("SPLITFLASH_DRAFT_", DraftSettings),
        )
    }
    general = {"SPLITFLASH_CACHE", "SPLITFLASH_SERVICE", "SPLITFLASH_TARGET"}
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    seen = 0
    for svc in services.values():
        for var in svc.get("environment", {}):
            if not var.startswith("SPLITFLASH_") or var in general:
                continue
            prefix = next((p for p in fields if var.startswith(p)), None)
            assert prefix is not None, f"{var} belongs to no service"
            field = var.removeprefix(prefix).removesuffix("_FILE")
            assert field in fields[prefix] or var.removeprefix(prefix) in fields[prefix], var
            seen += 1
    assert seen >= 10
