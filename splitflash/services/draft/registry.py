"""Drafters the draft service can run, chosen by `DraftSettings.drafter`, and what it needs
to know about one.

Every drafter has the n-gram drafter's interface:
    name: str
    open(request_id, prompt_ids) / extend(request_id, new_ids, base_len)
    propose(request_id, k) -> list[int]  (a chain of at most k tokens)
    release(request_id)
Optional, looked up with getattr so a drafter implements only what it has:
    target_layer_ids: Sequence[int]      target layers whose features it consumes
    add_features(request_id, start_pos, features [n, F])   (the Features data plane)
    policy_string: str | () -> str       attention policy in force, for logs and Hello
    attention_policy() -> (in_force, checkpoint, source)   as metrics.publish_attention_policy
    pop_keys_read() -> dict[layer_kind, int]   context keys read since the last call
"""

from __future__ import annotations

import importlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.ngram import NgramDrafter, NgramSettings

log = logging.getLogger(__name__)

DFLASH_MODULE = "splitflash.services.draft.dflash_loading"
DFLASH_FACTORY = "build_dflash_drafter"


class Drafter(Protocol):
    name: str

    def open(self, request_id: str, prompt_ids: list[int]) -> None: ...
    def extend(self, request_id: str, new_ids: list[int], base_len: int) -> None: ...
    def propose(self, request_id: str, k: int) -> list[int]: ...
    def release(self, request_id: str) -> None: ...


class NoDrafter:
    """drafter = "none": requests open and release normally, drafts are always empty."""

    name = "none"

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        pass

    def extend(self, request_id: str, new_ids: list[int], base_len: int) -> None:
        pass

    def propose(self, request_id: str, k: int) -> list[int]:
        return []

    def release(self, request_id: str) -> None:
        pass


class GarbageDrafter:
    """drafter = "garbage": an EXPERIMENT for fault injection, never for serving. Proposes
    uniformly random token ids from the target's vocabulary, so nearly every draft is
    rejected (mean commit_len ~ 1.0 while drafts are proposed): the symptom that
    `splitflash doctor` and the SpecCommitLenStuckAtOne alert must catch."""

    name = "garbage"

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"garbage drafter needs a vocabulary, got size {vocab_size}")
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)  # seeded: a failing experiment can be replayed
        self._open: set[str] = set()

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self._open.add(request_id)

    def extend(self, request_id: str, new_ids: list[int], base_len: int) -> None:
        pass

    def propose(self, request_id: str, k: int) -> list[int]:
        return [self._rng.randrange(self.vocab_size) for _ in range(max(0, k))]

    def release(self, request_id: str) -> None:
        self._open.discard(request_id)


def target_vocab_size(target: str) -> int:
    """The target's vocabulary size from its config alone (no weights are read)."""
    from splitflash.models import store
    from splitflash.models.loading import checkpoint_config

    return checkpoint_config(store.resolve(target)).vocab_size


def build_drafter(settings: DraftSettings) -> Drafter:
    kind, _, path = settings.drafter.partition(":")
    if kind == "ngram":
        return NgramDrafter(NgramSettings(settings.ngram_min_n, settings.ngram_max_n))
    if kind == "none":
        return NoDrafter()
    if kind == "garbage":
        vocab = target_vocab_size(settings.target)
        # Loud on purpose: a garbage drafter left in a deployment would look like a broken
        # drafter, so its logs must say it was chosen as an experiment.
        log.warning(
            "EXPERIMENT: drafter 'garbage' proposes random tokens from a vocabulary of %d; "
            "speculation will be rejected on (almost) every step. For fault injection only.",
            vocab,
        )
        return GarbageDrafter(vocab)
    try:
        module = importlib.import_module(DFLASH_MODULE)
        factory = getattr(module, DFLASH_FACTORY)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"drafter {settings.drafter!r} needs {DFLASH_MODULE}.{DFLASH_FACTORY}: {e}"
        ) from e
    return factory(
        path=path or None,
        target=settings.target,
        device=settings.device,
        window_override=settings.window_override,
        pool_slots=settings.pool_slots,
        pool_context=settings.pool_context,
        cuda_graphs=settings.cuda_graphs,
        graph_max_held=settings.graph_max_held,
        warmup=settings.warmup,
    )


@dataclass(frozen=True)
class DrafterFacts:
    name: str
    target_layer_ids: tuple[int, ...]
    takes_features: bool
    policy: str  # "" when the drafter has no attention (ngram, none)


def drafter_facts(drafter: Any) -> DrafterFacts:
    policy = getattr(drafter, "policy_string", "")
    if callable(policy):
        policy = policy()
    layers: Sequence[int] = getattr(drafter, "target_layer_ids", ())
    return DrafterFacts(
        name=str(getattr(drafter, "name", type(drafter).__name__)),
        target_layer_ids=tuple(int(i) for i in layers),
        takes_features=callable(getattr(drafter, "add_features", None)),
        policy=str(policy),
    )
