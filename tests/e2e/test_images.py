"""Each image's own command, run outside Docker, starts the service it should (issue 7).

The CMD lines are read from the Dockerfiles and run with `sh -c` exactly as Docker would,
with the environment compose gives them (ports made free, the model given as a path so no
pull is needed)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitflash.cli.serve_cmd import probe
from tests.e2e.cluster import free_port, http_get

pytestmark = pytest.mark.real_model
DOCKER = Path(__file__).resolve().parents[2] / "docker"


def image_cmd(dockerfile: str) -> list[str]:
    text = (DOCKER / dockerfile).read_text()
    return json.loads(re.findall(r"^CMD (\[.*\])$", text, re.M)[-1])


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    # The image has `splitflash` on its PATH; here it is the running interpreter's script
    # directory (the venv's bin), which need not be on the PATH pytest was started with.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.Popen(
        cmd,
        env={**os.environ, "PATH": path, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=20)


def wait(check, what: str, timeout: float = 120.0):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not come up: {last}")


def test_image_commands_start_their_services(real_model_path):
    target = str(real_model_path)  # a path: the command skips the pull
    verify_port, draft_port, http_port = free_port(), free_port(), free_port()
    worker = image_cmd("worker.Dockerfile")
    common = {
        "SPLITFLASH_TARGET": target,
        "SPLITFLASH_VERIFY_TARGET": target,
        "SPLITFLASH_DRAFT_TARGET": target,
        "SPLITFLASH_VERIFY_METRICS_PORT": "0",
        "SPLITFLASH_DRAFT_METRICS_PORT": "0",
        "SPLITFLASH_VERIFY_BIND": f"tcp://127.0.0.1:{verify_port}",
        "SPLITFLASH_DRAFT_BIND": f"tcp://127.0.0.1:{draft_port}",
        "SPLITFLASH_VERIFY_DRAFT_ADDR": "",
    }
    procs = []
    try:
        for service, port in (("draft", draft_port), ("verify", verify_port)):
            procs.append(start(worker, {**common, "SPLITFLASH_SERVICE": service}))
            line = wait(
                lambda s=service, p=port: probe(s, f"tcp://127.0.0.1:{p}", 1.0),
                f"{service} from the worker image command",
            )
            assert line.startswith(f"{service} at")  # the right service answers
        gateway = image_cmd("gateway.Dockerfile")
        procs.append(
            start(
                gateway,
                {
                    **common,
                    "SPLITFLASH_GATEWAY_PORT": str(http_port),
                    "SPLITFLASH_GATEWAY_TARGET": target,
                    "SPLITFLASH_GATEWAY_VERIFY_ADDR": f"tcp://127.0.0.1:{verify_port}",
                    "SPLITFLASH_GATEWAY_DRAFT_ADDR": f"tcp://127.0.0.1:{draft_port}",
                },
            )
        )
        status = wait(
            lambda: http_get(f"http://127.0.0.1:{http_port}/ready", 2)[0] == 200,
            "gateway from the gateway image command",
        )
        assert status
    finally:
        codes = [stop(p) for p in procs]
    # SIGTERM reaches each service itself (exec): the workers exit 0; uvicorn shuts down
    # gracefully, then re-raises the signal, as it does by design
    assert codes[:2] == [0, 0] and codes[2] in (0, -signal.SIGTERM), codes
