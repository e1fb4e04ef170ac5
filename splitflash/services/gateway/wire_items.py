"""The items of a Prefill or Verify call for a group of requests (pure: no sockets)."""

from __future__ import annotations

from collections.abc import Callable

from splitflash.protocol import PrefillItem, SamplingParams, VerifyItem
from splitflash.services.gateway.jobs import Job


def prefill_items(
    jobs: list[Job], deadline: float, draft_peer: Callable[[Job], str | None]
) -> list[PrefillItem]:
    return [
        PrefillItem(
            request_id=j.request_id,
            deadline=deadline,
            # a resumed request (recovery.py) continues after what it streamed
            prompt_ids=j.prompt_ids + j.generated,
            sampling=SamplingParams(
                temperature=j.temperature, top_p=j.top_p, top_k=j.top_k, seed=j.seed
            ),
            draft_peer=draft_peer(j),
        )
        for j in jobs
    ]


def verify_items(
    jobs: list[Job], deadline: float, drafts: dict[str, list[int]]
) -> list[VerifyItem]:
    return [
        VerifyItem(
            request_id=j.request_id,
            deadline=deadline,
            base_len=j.base_len,
            draft_ids=drafts.get(j.request_id, []),
            max_commit=j.remaining,
        )
        for j in jobs
    ]
