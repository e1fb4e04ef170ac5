"""A gateway over 2 verify and 2 draft worker processes (real sockets on 127.0.0.1, CURVE on,
API key on): concurrent greedy requests equal single-worker greedy decoding token for token;
killing one worker of each kind loses no request and hangs none; a worker that comes back
is used again.

The target is a tiny random Llama written as an HF checkpoint (fast to load in each
process) with the default model's vocabulary, so the gateway tokenizes with the real
tokenizer. The reference is `generate_local` on the same checkpoint in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from safetensors.torch import save_file

from splitflash.cli.keys_cmd import generate
from splitflash.local import generate_local
from splitflash.models.loading import load_target, load_tokenizer
from splitflash.services.gateway.textstream import TextStream
from tests.conftest import tiny_engine, tiny_model
from tests.e2e.cluster import free_port, http_get, http_post, metric

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

API_KEY = "sk-test-multiworker"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"Request {i}: the list of things to remember is" for i in range(8)]
TOKENS = 24
CALL_S = 90.0  # a bound on every request: none may hang


def write_tiny_checkpoint(path: Path, vocab: int) -> Path:
    """A tiny random Llama as an HF directory (q/k/v and gate/up unfused, HF names)."""
    model = tiny_model(vocab_size=vocab, max_position_embeddings=1024)
    cfg = model.cfg
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding
            continue
        if name.endswith("qkv_proj.weight"):
            q, k, _v = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, None
            base = name.removesuffix("qkv_proj.weight")
            parts = tensor.split([q, k, k])
            for n, part in zip("qkv", parts, strict=True):
                state[f"model.{base}{n}_proj.weight"] = part.clone().contiguous()
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.split(cfg.intermediate_size)
            state[f"model.{base}gate_proj.weight"] = gate.clone().contiguous()
            state[f"model.{base}up_proj.weight"] = up.clone().contiguous()
        else:
            state[f"model.{name}"] = tensor.clone().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    config = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


class Fleet:
    """2 verify + 2 draft + 1 gateway as processes; workers restartable at their ports."""

    def __init__(self, tmp: Path, checkpoint: Path, curve_env: dict) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.addr = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("v0", "v1", "d0", "d1")}
        self.mport = {n: free_port() for n in self.addr}
        self.procs: dict[str, subprocess.Popen] = {}
        self.base = {**os.environ, **curve_env}
        self.env = {
            "v": {
                "SPLITFLASH_VERIFY_TARGET": str(checkpoint),
                "SPLITFLASH_VERIFY_KV_PAGES": "256",
                "SPLITFLASH_VERIFY_PAGE_SIZE": "8",
                "SPLITFLASH_VERIFY_DRAFT_ADDR": "",  # data-plane links come per request
            },
            "d": {"SPLITFLASH_DRAFT_DRAFTER": "ngram"},
            "gateway": {
                "SPLITFLASH_GATEWAY_PORT": str(self.port),
                "SPLITFLASH_GATEWAY_VERIFY_ADDRS": f"{self.addr['v0']},{self.addr['v1']}",
                "SPLITFLASH_GATEWAY_DRAFT_ADDRS": f"{self.addr['d0']},{self.addr['d1']}",
                "SPLITFLASH_GATEWAY_MAX_CONTEXT": "1024",
                "SPLITFLASH_GATEWAY_HEARTBEAT_S": "0.5",
                "SPLITFLASH_GATEWAY_VERIFY_TIMEOUT_S": "30",
                "SPLITFLASH_GATEWAY_API_KEYS": API_KEY,
            },
        }

    def start(self, name: str) -> None:
        if name == "gateway":
            service, env = "gateway", self.env["gateway"]
        else:
            service = "verify" if name[0] == "v" else "draft"
            prefix = f"SPLITFLASH_{service.upper()}_"
            env = {
                **self.env[name[0]],
                prefix + "BIND": self.addr[name],
                prefix + "METRICS_PORT": str(self.mport[name]),
            }
        log = (self.tmp / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "splitflash", "serve", service],
            env={**self.base, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def ready(self) -> dict:
        status, body = http_get(self.url + "/ready", timeout=2)
        return json.loads(body) if status in (200, 503) else {}

    def wait_workers(self, verify: int, draft: int, timeout: float = 120.0) -> None:
        """Until /ready shows that many alive workers of each kind (processes checked)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.tmp / f"{name}.log").read_text()[-3000:]
                    pytest.fail(f"{name} exited {proc.returncode}:\n{log}")
            try:
                body = self.ready()
            except OSError:
                body = {}
            alive = {
                k: sum(w["alive"] for w in (body.get(k) or {}).get("workers", []))
                for k in ("verify", "draft")
            }
            if alive == {"verify": verify, "draft": draft}:
                return
            time.sleep(0.25)
        pytest.fail(f"workers not {verify} verify + {draft} draft alive: {self.ready()}")

    def worker_steps(self, name: str) -> float:
        """Calls a worker served (its step_phase_seconds count), from its own metrics."""
        text = http_get(f"http://127.0.0.1:{self.mport[name]}/metrics")[1]
        return metric(text, "splitflash_step_phase_seconds_count")


@pytest.fixture(scope="module")
def setup(real_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiworker")
    tokenizer = load_tokenizer(real_model_path)
    checkpoint = write_tiny_checkpoint(tmp / "tiny", len(tokenizer))
    env_file = generate(tmp / "keys")
    curve_env = dict(ln.split("=", 1) for ln in env_file.read_text().splitlines() if "=" in ln)
    fleet = Fleet(tmp, checkpoint, curve_env)
    try:
        for name in ("v0", "v1", "d0", "d1", "gateway"):
            fleet.start(name)
        fleet.wait_workers(2, 2)
        model = load_target(checkpoint)
        yield fleet, reference_texts(model, tokenizer)
    finally:
        fleet.stop()


def reference_texts(model, tokenizer) -> dict[str, tuple[str, int]]:
    """Prompt -> (text, tokens) of target-only greedy decoding in this process."""
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        engine = tiny_engine(model, pages=64, page_size=8)
        got = generate_local(engine, None, ids, TOKENS, stop_ids=(0,)).token_ids
        stream = TextStream(lambda x: tokenizer.decode(x, skip_special_tokens=True), ())
        out[prompt] = (stream.push(got) + stream.flush(), len(got))
    return out


def complete(fleet: Fleet, prompt: str, **kw) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, **kw}
    return http_post(fleet.url + "/v1/completions", body, timeout=CALL_S, headers=AUTH)


def run_all(fleet: Fleet, prompts: list[str], during=None) -> list[tuple[int, dict]]:
    """All prompts at once; `during()` runs while they are in flight. Bounded in time."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, fleet, p) for p in prompts]
        if during is not None:
            during()
        done, pending = wait(futures, timeout=CALL_S + 10)
        assert not pending, f"{len(pending)} request(s) hung"
    return [f.result() for f in futures]


def test_api_key_401_without_200_with(setup):
    fleet, _ = setup
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    status, err = http_post(fleet.url + "/v1/completions", body, timeout=CALL_S)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    bad = {"Authorization": "Bearer wrong"}
    assert http_post(fleet.url + "/v1/completions", body, headers=bad)[0] == 401
    assert http_post(fleet.url + "/v1/completions", body, headers=AUTH)[0] == 200


def test_concurrent_requests_spread_and_equal_single_worker_greedy(setup):
    fleet, want = setup
    before = {n: fleet.worker_steps(n) for n in fleet.addr}
    results = run_all(fleet, PROMPTS)
    for prompt, (status, body) in zip(PROMPTS, results, strict=True):
        assert status == 200, body
        text, n = want[prompt]
        assert body["choices"][0]["text"] == text, prompt
        assert body["usage"]["completion_tokens"] == n
    used = [n for n in fleet.addr if fleet.worker_steps(n) > before[n]]
    assert sorted(used) == ["d0", "d1", "v0", "v1"], "every worker takes a share"
    text = http_get(fleet.url + "/metrics")[1]
    assert metric(text, "splitflash_spec_invariant_violations_total") == 0


def test_killing_one_worker_of_each_kind_loses_nothing_then_it_is_used_again(setup):
    fleet, want = setup
    prompts = PROMPTS * 2  # 16 requests: both verify workers hold some when one dies

    def kill_mid_flight() -> None:
        start = metric(http_get(fleet.url + "/metrics")[1], "splitflash_generated_tokens_total")
        end = time.monotonic() + 30
        while time.monotonic() < end:  # until tokens are flowing, so some were streamed
            text = http_get(fleet.url + "/metrics")[1]
            if metric(text, "splitflash_generated_tokens_total") >= start + 20:
                break
            time.sleep(0.05)
        fleet.kill("v0")
        fleet.kill("d0")

    t0 = time.monotonic()
    results = run_all(fleet, prompts, during=kill_mid_flight)
    assert time.monotonic() - t0 < CALL_S
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503}, results
    for prompt, (status, body) in zip(prompts, results, strict=True):
        if status == 200:  # retried or resumed greedy requests are still exact
            assert body["choices"][0]["text"] == want[prompt][0], prompt
        else:
            assert body["error"]["code"] in ("worker_lost", "verify_unavailable"), body
    assert statuses.count(200) >= len(prompts) // 2, statuses
    # the survivors serve alone
    fleet.wait_workers(1, 1, timeout=30)
    assert complete(fleet, PROMPTS[0])[1]["choices"][0]["text"] == want[PROMPTS[0]][0]
    # both come back at the same address and take requests again
    fleet.start("v0")
    fleet.start("d0")
    fleet.wait_workers(2, 2)
    before = {n: fleet.worker_steps(n) for n in ("v0", "d0")}
    for prompt, (status, body) in zip(PROMPTS, run_all(fleet, PROMPTS), strict=True):
        assert status == 200 and body["choices"][0]["text"] == want[prompt][0]
    assert fleet.worker_steps("v0") > before["v0"] and fleet.worker_steps("d0") > before["d0"]
