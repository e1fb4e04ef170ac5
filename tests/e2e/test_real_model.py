"""Oracles on the real default model (SmolLM2-135M-Instruct GGUF), fp32 on CPU."""

import json
import subprocess
import sys

import pytest
import torch

from splitflash.cli.generate import encode_prompt
from splitflash.local import generate_local
from splitflash.models.kv_cache import PagedKVCache
from splitflash.services.draft.ngram import NgramDrafter
from splitflash.services.verify.engine import TargetEngine

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List the days of the week: Monday, Tuesday,",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def hf_model(real_model_path):
    from transformers import AutoModelForCausalLM

    path = real_model_path
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@torch.no_grad()
def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Plain argmax loop (HF generate would stop at, or suppress, the EOS token)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def make_engine(model) -> TargetEngine:
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 256, 16, cfg.num_kv_heads, cfg.head_dim)
    return TargetEngine(model, cache)


def test_greedy_tokens_and_logits_match_hf(real_target, hf_model):
    model, tok = real_target
    engine = make_engine(model)
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        ours = generate_local(engine, None, ids, 32).token_ids
        ref = hf_greedy(hf_model, ids, 32)
        assert ours == ref, prompt
        # logits of the whole sequence in one prefill, against HF's
        seq = ids + ours
        engine.cache.add("logits")
        engine.cache.reserve("logits", len(seq))
        with torch.no_grad():
            got = model(engine._batch([("logits", seq, 0)]), engine.cache).logits
            want = hf_model(torch.tensor([seq])).logits[0]
        engine.cache.free("logits")
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-4, (prompt, rel)


def test_a_prompt_prefilled_in_chunks_decodes_as_hf(real_target, hf_model):
    """150 tokens in chunks of 70: the second through SDPA's bottom-right causal mask over
    the cached first, the last 10 through the paged path; greedy tokens equal HF's."""
    model, tok = real_target
    ids = (tok(" ".join(PROMPTS)).input_ids * 5)[:150]
    assert len(ids) == 150
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 256, 16, cfg.num_kv_heads, cfg.head_dim)
    engine = TargetEngine(model, cache, prefill_chunk=70)
    assert generate_local(engine, None, ids, 8).token_ids == hf_greedy(hf_model, ids, 8)


def test_ngram_speculation_is_lossless_with_accepts_and_rejects(real_target):
    model, tok = real_target
    engine = make_engine(model)
    prompts = [
        "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
        "Write a Python function that adds two numbers, then write it again.",
    ]
    total = None
    for prompt in prompts:
        ids = encode_prompt(tok, prompt, chat=True)
        plain = generate_local(engine, None, ids, 48)
        spec = generate_local(engine, NgramDrafter(), ids, 48, block_size=8)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.violations == []
        if total is None:
            total = spec.stats
        else:
            total.merge(spec.stats)
    assert total.accepted_drafts > 0, "no draft was ever accepted: the test proves nothing"
    assert total.accepted_drafts < total.draft_tokens, "no draft was ever rejected"
    assert engine.cache.free_pages == engine.cache.num_pages


def test_generate_cli_json(real_model_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitflash",
            "generate",
            "Name three colours.",
            "--max-tokens",
            "24",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    stats = result["speculative_decoding_stats"]
    assert 1 <= len(result["token_ids"]) <= 24
    assert result["text"].strip()
    assert result["tokens_per_second"] > 0
    assert stats["steps"] >= 1
    assert stats["mean_commit_len"] >= 1.0
    assert set(stats) == {
        "steps",
        "draft_tokens",
        "accepted_drafts",
        "mean_commit_len",
        "acceptance_rate",
        "accepted_per_position",
    }


def test_missing_model_names_the_pull_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "splitflash", "generate", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "SPLITFLASH_CACHE": str(tmp_path)},
    )
    assert out.returncode == 2
    assert "splitflash models pull smollm2-135m" in out.stderr


def _generate_json(*flags: str) -> dict:
    cmd = [sys.executable, "-m", "splitflash", "generate", "Explain how a hash table works."]
    out = subprocess.run(
        [*cmd, "--max-tokens", "48", "--json", *flags],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_generate_cli_dflash_is_lossless_and_drafts_are_accepted(real_model_path):
    """The shipped DFlash drafter through the one-process CLI: the same greedy tokens as
    target-only decoding, with drafts accepted (commits of more than one token a step)."""
    plain = _generate_json("--no-spec")
    spec = _generate_json("--drafter", "dflash", "--block-size", "8")
    assert spec["token_ids"] == plain["token_ids"]
    stats = spec["speculative_decoding_stats"]
    assert stats["draft_tokens"] > 0 and stats["accepted_drafts"] > 0, stats
    assert stats["steps"] < len(spec["token_ids"]) - 1  # fewer steps than tokens decoded
