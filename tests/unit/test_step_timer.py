"""The gateway's split of a decode step's time (step_record.StepTimer): what the workers
report as compute and as queueing, the rest of each round trip as transport, the
gateway's own time as schedule; the phases add up to the step."""

from __future__ import annotations

import pytest

from splitflash.services.common.metric_math import PHASES
from splitflash.services.gateway import step_record


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_record.time, "perf_counter", lambda: now[0])
    return now


def test_a_step_that_waited_behind_a_prefill_chunk_reads_as_queue_not_transport(clock):
    timer = step_record.StepTimer()
    clock[0] += 0.002
    timer.mark("draft", 0.001, 0.0)
    clock[0] += 0.300  # the verify worker ran a 0.25 s prompt chunk before this step
    timer.mark("verify", 0.020, 0.250)
    clock[0] += 0.001
    p = timer.phases()
    assert set(PHASES) <= set(p)
    assert p["verify"] == pytest.approx(0.020) and p["queue"] == pytest.approx(0.250)
    assert p["transport"] == pytest.approx(0.001 + 0.030)  # draft's 1 ms, verify's 30 ms
    assert sum(p[k] for k in PHASES) == pytest.approx(p["total"])


def test_queueing_is_bounded_by_what_the_round_trip_leaves(clock):
    timer = step_record.StepTimer()
    clock[0] += 0.100
    timer.mark("verify", 0.060, 0.500)  # an upper bound larger than the round trip allows
    p = timer.phases()
    assert p["queue"] == pytest.approx(0.040) and p["transport"] == pytest.approx(0.0)
    assert sum(p[k] for k in PHASES) == pytest.approx(p["total"])


def test_a_worker_that_reports_no_queueing_leaves_it_all_to_transport(clock):
    timer = step_record.StepTimer()
    clock[0] += 0.010
    timer.worker_time["draft"] = 0.004  # drafting.py records its workers' figures so
    timer.mark("draft")
    clock[0] += 0.100
    timer.mark("verify", 0.060)  # a worker from before "queued" was in its replies
    clock[0] += 0.005
    p = timer.phases()
    assert p["queue"] == 0.0
    assert p["transport"] == pytest.approx(0.006 + 0.040)
    assert p["schedule"] == pytest.approx(0.005)
    assert sum(p[k] for k in PHASES) == pytest.approx(p["total"])
