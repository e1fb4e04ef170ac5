"""The speculation gate in the running gateway (GatewayRuntime over real verify and draft
servers on loopback): a drafter whose drafts are always rejected and slow is paused (steps
counted as fallback "unprofitable", drafting retried every probe_every steps), one whose
drafts are right keeps drafting, and either way the text equals target-only decoding."""

from __future__ import annotations

import asyncio
import time

from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.ngram import NgramDrafter
from splitflash.services.draft.server import DraftServer
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.jobs import Failed, Finished, Job, Tokens
from splitflash.services.gateway.runtime import GatewayRuntime
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.server import VerifyServer
from tests.conftest import tiny_engine, tiny_model
from tests.integration.workers_harness import running

ANY_PORT = "tcp://127.0.0.1:*"
PROMPT = [5, 17, 3, 9, 42, 7, 6, 21]
NEW_TOKENS = 56
PROBE_EVERY = 4


class ScriptedDrafter(NgramDrafter):
    """Drafts from a script: the right continuation (`reference`), or one token that is never
    right, after `delay_s` (a drafter that costs more than it saves)."""

    name = "scripted"

    def __init__(self, reference: list[int] | None, wrong: int = 0, delay_s: float = 0.0):
        super().__init__()
        self.reference, self.wrong, self.delay_s = reference, wrong, delay_s

    def propose(self, request_id: str, k: int) -> list[int]:
        time.sleep(self.delay_s)
        seen = len(self.tokens[request_id])
        if self.reference is None:
            return [self.wrong] * k
        return self.reference[seen : seen + k]


def make_job(rid: str, spec: bool) -> Job:
    return Job(request_id=rid, prompt_ids=list(PROMPT), max_tokens=NEW_TOKENS, temperature=0.0,
               top_p=1.0, top_k=0, seed=None, spec_enabled=spec, block_size=4)  # fmt: skip


async def generate(runtime: GatewayRuntime, job: Job) -> list[int]:
    runtime.orchestrator.submit(job)
    ids: list[int] = []
    while True:
        event = await asyncio.wait_for(job.events.get(), timeout=60)
        if isinstance(event, Tokens):
            ids += event.ids
        elif isinstance(event, Finished):
            return ids
        elif isinstance(event, Failed):
            raise AssertionError(f"{job.request_id} failed: {event}")


def serve_and_generate(drafter: ScriptedDrafter, jobs: list[Job], probe_every=PROBE_EVERY):
    """Each job's ids (in order, one at a time), the gateway's metrics text, the jobs."""
    from prometheus_client import generate_latest

    model = tiny_model()
    with (
        running(DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0), drafter)) as d,
        running(
            VerifyServer(
                VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr=""),
                engine=tiny_engine(model, pages=128),
            )
        ) as v,  # fmt: skip
    ):
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr=d.endpoint,
                                   spec_probe_every=probe_every)  # fmt: skip

        async def go():
            runtime = GatewayRuntime(settings, tokenizer=None)
            await runtime.start()
            try:
                outs = [await generate(runtime, job) for job in jobs]
                return outs, generate_latest(runtime.registry).decode()
            finally:
                await runtime.stop()

        return asyncio.run(go())


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels are exactly `labels`."""
    for head, value in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#"):
        got_name, _, rest = head.partition("{")
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if got_name == name and got == {k: f'"{v}"' for k, v in labels.items()}:
            return float(value)
    raise AssertionError(f"{name} {labels} not exported")


def drafted_steps(job: Job) -> list[bool]:
    return [step["drafted"] > 0 for step in job.trace]


def test_a_drafter_that_only_slows_decoding_is_paused_and_probed():
    reference_job, spec_job = make_job("plain", spec=False), make_job("spec", spec=True)
    # 0.2 s a proposal: ~100x a tiny model's step, so a loaded CI machine's slow steps
    # cannot turn the comparison the gate makes
    drafter = ScriptedDrafter(None, wrong=1, delay_s=0.2)
    (reference, got), metrics = serve_and_generate(drafter, [reference_job, spec_job])
    assert got == reference  # lossless whatever the gate decides
    assert 1 not in reference  # so every draft is rejected
    paused = sample(metrics, "splitflash_spec_fallback_steps_total", reason="unprofitable")
    drafted = drafted_steps(spec_job)
    # min_steps (16) speculative steps to judge, then plain
    assert drafted[:16] == [True] * 16
    # every undrafted step was the gate's, but the last (one token left: nothing to draft)
    assert paused == drafted[:-1].count(False) and paused >= 20
    # two-step tries, after PROBE_EVERY plain steps, then waits doubling per lost try
    assert drafted[16:].count(True) <= 2 * (len(drafted[16:]) // PROBE_EVERY + 1)
    assert drafted[16:].count(True) >= 4  # and it keeps trying
    gate = "splitflash_spec_gate_tokens_per_second"
    plain = sample(metrics, gate, mode="plain", context_bucket="<=2k")
    spec = sample(metrics, gate, mode="speculative", context_bucket="<=2k")
    assert plain > spec > 0
    assert sample(metrics, gate, mode="plain", context_bucket=">128k") == 0  # not measured


def test_a_drafter_that_is_right_keeps_drafting():
    reference_job = make_job("plain", spec=False)
    (reference,), _ = serve_and_generate(ScriptedDrafter(None), [reference_job])
    spec_job = make_job("spec", spec=True)
    drafter = ScriptedDrafter(PROMPT + reference)
    (got,), metrics = serve_and_generate(drafter, [spec_job], probe_every=32)
    assert got == reference
    assert spec_job.stats.mean_commit_len > 3.0  # block 4: nearly every draft accepted
    paused = sample(metrics, "splitflash_spec_fallback_steps_total", reason="unprofitable")
    assert paused <= 2  # at most the plain steps taken to measure plain speed
