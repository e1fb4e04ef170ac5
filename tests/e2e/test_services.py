"""The product end to end: three real processes (verify, draft, gateway) on the real model,
spoken to over HTTP, by hand and through the official `openai` client."""

import json
import socket
import time

import pytest

from tests.e2e.cluster import Cluster, http_get, http_post, metric

pytestmark = pytest.mark.real_model

REPEAT = "Repeat exactly, three times: the cat sat on the mat and the dog sat on the log."


@pytest.fixture(scope="module")
def cluster(real_model_path, tmp_path_factory):
    c = Cluster(logs=tmp_path_factory.mktemp("logs"))
    try:
        for name in ("verify", "draft", "gateway"):
            c.start(name)
        c.wait_ready()
        c.wait_for(
            lambda: json.loads(http_get(c.url + "/ready")[1])["draft"]["alive"],
            what="drafter connected",
        )
        yield c
    finally:
        c.stop()


def chat(c, content, **kw):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 40,
        **kw,
    }
    return http_post(c.url + "/v1/chat/completions", body)


def check_stats(body):
    stats = body["speculative_decoding_stats"]
    n_out = body["usage"]["completion_tokens"]
    # every token after the first (prefill) was committed by a verify step
    assert round(stats["mean_commit_len"] * stats["steps"]) == n_out - 1
    assert stats["accepted_drafts"] <= stats["draft_tokens"]
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["steps"] + stats["accepted_drafts"] >= n_out - 1
    return stats


def test_greedy_speculative_equals_target_only_over_http(cluster):
    status, spec = chat(cluster, REPEAT)
    assert status == 200, spec
    status, plain = chat(cluster, REPEAT, speculative={"enabled": False})
    assert status == 200, plain
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert spec["usage"] == plain["usage"]
    stats = check_stats(spec)
    assert stats["accepted_drafts"] > 0, "n-gram drafts were never accepted"
    assert check_stats(plain)["draft_tokens"] == 0
    text = cluster.metrics("gateway")
    assert metric(text, "splitflash_spec_invariant_violations_total") == 0
    assert metric(text, "splitflash_spec_fallback_steps_total", reason="disabled") >= 1


def test_openai_client_completions_and_chat(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    comp = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert comp.choices[0].text.strip() and comp.usage.completion_tokens <= 8
    stream = client.completions.create(
        model="smollm2-135m",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens
    msgs = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0
    )
    parts = client.chat.completions.create(
        model="smollm2-135m",
        messages=msgs,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(parts)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert chunks[-1].model_extra["speculative_decoding_stats"]["steps"] >= 0


def test_sse_ends_with_done_and_stats_in_last_chunk(cluster):
    body = {
        "model": "smollm2-135m",
        "prompt": REPEAT,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    events = sse_events(cluster, body)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "speculative_decoding_stats" in last
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def sse_events(c, body, limit=None):
    with socket.create_connection(("127.0.0.1", c.port), timeout=60) as s:
        payload = json.dumps(body).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )
        buf, events = b"", []
        while limit is None or len(events) < limit:
            data = s.recv(65536)
            if not data:
                break
            buf += data
            events = [
                line[6:]
                for line in buf.decode(errors="replace").split("\n")
                if line.startswith("data: ")
            ]
            if events and events[-1] == "[DONE]":
                break
    return events


BAD_BODIES = [
    (b"{oops", 400, None),
    (b"[1]", 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 7}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "no"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    (
        {"messages": [{"role": "user", "content": "x"}], "speculative": {"block_size": 1}},
        400,
        "block_size",
    ),
]


def test_bad_inputs_and_a_disconnect_leave_nothing_behind(cluster):
    for body, status, param in BAD_BODIES:
        code, reply = http_post(cluster.url + "/v1/chat/completions", body)
        assert code == status, (body, reply)
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if param:
            assert param in err["message"], (param, err)
    # a client that goes away mid-stream
    body = {
        "model": "smollm2-135m",
        "prompt": REPEAT,
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    events = sse_events(cluster, body, limit=3)
    assert len(events) >= 3
    cluster.wait_for(
        lambda: metric(cluster.metrics("verify"), "splitflash_kv_pages_used") == 0,
        timeout=60,
        what="KV pages freed after the disconnect",
    )
    assert http_get(cluster.url + "/health")[0] == 200


def test_drafter_killed_mid_stream_then_back(cluster):
    before = metric(cluster.metrics("gateway"), "splitflash_spec_fallback_steps_total")
    body = {
        "model": "smollm2-135m",
        "prompt": REPEAT,
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "speculative": {"block_size": 4},
    }
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=120) as s:
        payload = json.dumps(body).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )
        buf = b""
        while buf.count(b"data: ") < 3:  # the stream is flowing, drafts included
            data = s.recv(65536)
            assert data, "stream closed early"
            buf += data
        cluster.kill("draft")
        while b"data: [DONE]" not in buf:
            data = s.recv(65536)
            assert data, "stream closed before [DONE]"
            buf += data
    last = [ln for ln in buf.decode().split("\n") if ln.startswith("data: {")][-1]
    assert "speculative_decoding_stats" in last
    after = metric(cluster.metrics("gateway"), "splitflash_spec_fallback_steps_total")
    assert after > before, "no fallback step was counted with the drafter gone"
    # plain requests keep working without a drafter, then speculation resumes
    assert chat(cluster, "Say hi.", max_tokens=5)[0] == 200
    cluster.start("draft")
    cluster.wait_for(
        lambda: json.loads(http_get(cluster.url + "/ready")[1])["draft"]["alive"],
        timeout=120,
        what="drafter back",
    )
    status, body = chat(cluster, REPEAT)
    assert status == 200 and body["speculative_decoding_stats"]["draft_tokens"] > 0


def test_concurrent_requests_batch_together_and_match_solo_outputs(cluster):
    """Continuous batching: 6 requests at once (joining and leaving between steps) give the
    same greedy text as each alone, and the per-request stats stay sound."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Count from {i} to {i + 9}, separated by commas." for i in range(3)] + [
        REPEAT,
        "Name three colours.",
        "What is the capital of Italy?",
    ]
    lengths = [24, 40, 16, 32, 8, 20]
    solo = [chat(cluster, p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    before = metric(cluster.metrics("gateway"), "splitflash_step_seconds_count")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda pn: chat(cluster, pn[0], max_tokens=pn[1]),
                zip(prompts, lengths, strict=True),
            )
        )
    for (s_status, s_body), (t_status, t_body) in zip(solo, together, strict=True):
        assert s_status == t_status == 200
        assert (
            t_body["choices"][0]["message"]["content"] == s_body["choices"][0]["message"]["content"]
        )
        check_stats(t_body)
    batch_steps = metric(cluster.metrics("gateway"), "splitflash_step_seconds_count") - before
    request_steps = sum(b["speculative_decoding_stats"]["steps"] for _, b in together)
    # one batched step serves several requests: far fewer steps than request-steps
    assert 0 < batch_steps < request_steps


def test_verify_down_means_503_not_a_hang(cluster):
    cluster.kill("verify")
    cluster.wait_for(
        lambda: http_get(cluster.url + "/ready")[0] == 503,
        timeout=30,
        what="/ready to report verify down",
    )
    t0 = time.monotonic()
    status, body = chat(cluster, "hi", max_tokens=4)
    assert status == 503 and body["error"]["code"] == "verify_unavailable"
    assert time.monotonic() - t0 < 10
