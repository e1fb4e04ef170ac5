"""Which worker serves which request (pure: no sockets, no awaits).

Rules (DESIGN.md §1, several workers):
- A request is pinned at admission to ONE verify worker (it holds the request's KV cache)
  and, when it drafts, ONE draft worker (it holds the draft state, and verify sends that
  request's target features to exactly that drafter: `PrefillItem.draft_peer` carries the
  draft worker's endpoint). Pins change only when a worker is lost (see recovery.py).
- New requests go to the alive worker with the fewest pinned requests (ties: the first in
  a stable order), counting the ones placed earlier in the same admission batch.
- A step sends ONE call per worker, for all of that worker's requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar

from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.links import WorkerLink

K = TypeVar("K")


def loads(jobs: Iterable[Job], role: str) -> Counter:
    """Pinned requests per worker link (`role`: "verify" or "draft")."""
    return Counter(id(getattr(j, role)) for j in jobs if getattr(j, role) is not None)


def least_loaded(alive: list[WorkerLink], load: Counter) -> WorkerLink | None:
    """The alive link with the fewest pinned requests, or None if none is alive."""
    if not alive:
        return None
    return min(alive, key=lambda link: (load[id(link)], link.addr))


def place(jobs: list[Job], alive: list[WorkerLink], running: list[Job], role: str) -> None:
    """Pin each of `jobs` to the least-loaded of `alive` (None when there is none)."""
    load = loads(running, role)
    for job in jobs:
        link = least_loaded(alive, load)
        setattr(job, role, link)
        if link is not None:
            load[id(link)] += 1


def group_by(jobs: Iterable[Job], key: Callable[[Job], K]) -> dict[K, list[Job]]:
    """Jobs per key, each list in the order given (results map back by position)."""
    groups: dict[K, list[Job]] = {}
    for job in jobs:
        groups.setdefault(key(job), []).append(job)
    return groups
