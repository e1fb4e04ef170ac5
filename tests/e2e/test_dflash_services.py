"""The shipped DFlash drafter behind the draft service, on the real target: greedy output
over HTTP equals target-only output, the drafter's features arrive through the data plane
(drafts are accepted), and its attention policy is exported."""

import json

import pytest

from tests.e2e.cluster import Cluster, http_get, http_post, metric

pytestmark = pytest.mark.real_model

PROMPT = "Explain in two sentences what a Python list comprehension is."


@pytest.fixture(scope="module")
def cluster(real_model_path, tmp_path_factory):
    c = Cluster(drafter="dflash", logs=tmp_path_factory.mktemp("dflash-logs"))
    try:
        for name in ("verify", "draft", "gateway"):
            c.start(name)
        c.wait_ready()
        c.wait_for(
            lambda: json.loads(http_get(c.url + "/ready")[1])["draft"]["alive"],
            timeout=120,
            what="DFlash drafter connected",
        )
        yield c
    finally:
        c.stop()


def test_dflash_greedy_is_lossless_and_drafts_are_accepted(cluster):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": 48,
    }
    status, spec = http_post(cluster.url + "/v1/chat/completions", body)
    assert status == 200, spec
    status, plain = http_post(
        cluster.url + "/v1/chat/completions", {**body, "speculative": {"enabled": False}}
    )
    assert status == 200, plain
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    stats = spec["speculative_decoding_stats"]
    assert stats["draft_tokens"] > 0
    assert stats["accepted_drafts"] > 0, "no DFlash draft accepted: features out of step?"
    assert (
        round(stats["mean_commit_len"] * stats["steps"]) == spec["usage"]["completion_tokens"] - 1
    )
    draft_info = json.loads(http_get(cluster.url + "/ready")[1])["draft"]["info"]
    assert "sliding" in draft_info.get("policy", "")
    text = cluster.metrics("draft")
    assert metric(text, "splitflash_draft_attention_policy_mismatch") == 0
    assert metric(text, "splitflash_draft_attention_policy_info", kind="sliding") == 2
    assert metric(cluster.metrics("gateway"), "splitflash_spec_invariant_violations_total") == 0
