"""One process, no sockets: the target engine and a drafter in a loop (the `generate` CLI
and the oracles in the tests). The services run the same steps over ZeroMQ."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from splitflash.models import store
from splitflash.models.dflash import DFlashDesyncError
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.loading import load_target, load_tokenizer
from splitflash.services.common.spec_stats import SpecStats
from splitflash.services.gateway.spec_gate import SpecGate
from splitflash.services.verify.engine import TargetEngine, VerifyInput
from splitflash.services.verify.sampling import Sampling


@dataclass
class Generation:
    token_ids: list[int]
    stats: SpecStats
    seconds: float
    violations: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_seconds: float = 0.0  # prompt forward + the drafter's prompt features
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens committed)
    propose_seconds: list[float] = field(default_factory=list)  # per step (0.0: no draft)
    paused_steps: int = 0  # steps the speculation gate ran without drafting

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


def open_local(
    target: str, device: str = "cpu", dtype: torch.dtype = torch.float32, kv_pages: int = 512
):
    """(TargetEngine, tokenizer) of a model name or path on one device, with a KV pool of
    kv_pages pages of 16 tokens. A DFlash caller sets engine.feature_layer_ids afterwards."""
    path = store.resolve(target)
    model = load_target(path, device=device, dtype=dtype)
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, kv_pages, 16, cfg.num_kv_heads, cfg.head_dim,
                         dtype=dtype, device=device)  # fmt: skip
    return TargetEngine(model, cache), load_tokenizer(path)


def generate_local(
    engine: TargetEngine,
    drafter,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids=(),
    block_size: int = 8,
    gate: SpecGate | None = None,
) -> Generation:
    """Generate up to max_tokens; drafter None = target-only decoding. gate: the gateway's
    speculation gate (services/gateway/spec_gate.py) decides before each step whether the
    drafter drafts, from this generation's own step times.

    A drafter with `add_features` (DFlash) is conditioned on the target: after every step the
    kept rows' hidden features go to it (the engine must export its `target_layer_ids`), and
    before every proposal its context length must equal the target's KV length."""
    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    stats = SpecStats()
    violations: list[str] = []
    steps: list[tuple[float, int]] = []
    propose_s: list[float] = []  # the drafts come back as ints: the time includes the GPU's
    paused = 0
    report = engine.prefill(rid, prompt_ids, sampling, stop_ids, max_tokens)
    out = list(report.outcome.committed)
    feeds = drafter is not None and hasattr(drafter, "add_features")
    try:
        if drafter is not None:
            drafter.open(rid, prompt_ids)
            drafter.extend(rid, out, len(prompt_ids) + len(out))
            if feeds:
                drafter.add_features(rid, report.feature_start, report.features)
        finished = report.finished
        prefill_s = time.perf_counter() - t0
        while not finished:
            t_step = time.perf_counter()
            base_len = len(prompt_ids) + len(out)
            if feeds and drafter.context_len(rid) != engine.cache.seq(rid).length:
                raise DFlashDesyncError(
                    f"drafter context {drafter.context_len(rid)} != target KV length "
                    f"{engine.cache.seq(rid).length}"
                )
            drafting = drafter is not None and (gate is None or gate.speculate())
            paused += drafter is not None and not drafting
            drafts = drafter.propose(rid, block_size - 1) if drafting else []
            propose_s.append(time.perf_counter() - t_step if drafting else 0.0)
            (report,) = engine.verify([VerifyInput(rid, base_len, drafts, max_tokens - len(out))])
            if report.error:
                raise RuntimeError(report.error)
            o = report.outcome
            stats.record(o.draft_tokens, o.draft_tokens, o.accepted_drafts, o.commit_len)
            violations.extend(report.violations)
            out.extend(o.committed)
            finished = report.finished
            if drafter is not None and not finished:
                drafter.extend(rid, o.committed, len(prompt_ids) + len(out))
                if feeds:
                    drafter.add_features(rid, report.feature_start, report.features)
            step_s = time.perf_counter() - t_step
            if gate is not None and drafter is not None:
                gate.record(drafting, o.commit_len, step_s)
            steps.append((step_s, o.commit_len))
    finally:
        engine.release(rid)
        if drafter is not None:
            drafter.release(rid)
    reason = "stop" if out and out[-1] in set(stop_ids) else "length"
    seconds = time.perf_counter() - t0
    return Generation(out, stats, seconds, violations, reason, prefill_s, steps, propose_s, paused)
