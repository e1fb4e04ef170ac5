"""Checks a DFlash call runs before it writes anything: state ownership (desync), positions,
feature shapes, the block length and the anchors. Pure: they read the drafter's config and
policy, never its tensors, so the eager path and the draft graphs share them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from splitflash.models.dflash.cache import DFlashDesyncError, DFlashState

if TYPE_CHECKING:
    from splitflash.models.dflash.model import DFlashDrafter


def check_states(drafter: DFlashDrafter, states: Iterable[DFlashState]) -> None:
    """DFlashDesyncError unless every state was made by this drafter under its policy."""
    fingerprint = drafter.fingerprint()  # built once: per state it was most of a check
    if any(state.fingerprint != fingerprint for state in states):
        raise DFlashDesyncError("DFlash state was created by another drafter or policy")


def check_features(drafter: DFlashDrafter, features: torch.Tensor) -> None:
    """ValueError unless features are [n, K*D] rows of this drafter's target layers."""
    width = drafter.config.feature_dim
    if features.dim() != 2 or features.shape[1] != width:
        raise ValueError(f"features must be [n, K*D] = [n, {width}], got {tuple(features.shape)}")


def check_appends(
    drafter: DFlashDrafter, items: Sequence[tuple[DFlashState, torch.Tensor, int]]
) -> None:
    """Validate appends (state, features [n, K*D], start_pos) without writing: each must
    start where its state's context (plus its earlier items) ends."""
    check_states(drafter, (state for state, _, _ in items))
    held: dict[int, int] = {}  # id(state) -> context held after the items so far
    for state, features, start_pos in items:
        expected = held.get(id(state), state.n_ctx)
        if start_pos != expected:
            raise DFlashDesyncError(
                f"append_context desync: features start at position {start_pos} but the "
                f"drafter holds {expected} context tokens (expected start_pos == {expected})"
            )
        check_features(drafter, features)
        held[id(state)] = start_pos + features.shape[0]


def check_batch(
    drafter: DFlashDrafter,
    states: Sequence[DFlashState],
    anchor_token_ids: Sequence[int],
    anchor_positions: Sequence[int],
    block_size: int | None = None,
    held: Sequence[int] | None = None,
) -> int:
    """Validate one draft call (desync, vocab, duplicates); returns the block length T.
    held: the context each state will hold when the block runs (default its n_ctx; the
    draft graphs write a step's context rows first)."""
    cfg = drafter.config
    t = cfg.block_size if block_size is None else block_size
    if not 2 <= t <= cfg.block_size:
        # A drafter trained at B can run at a smaller block, never a larger one.
        raise ValueError(f"block_size must be in [2, {cfg.block_size}], got {t}")
    if not (len(states) == len(anchor_token_ids) == len(anchor_positions)) or not states:
        raise ValueError("draft_batch needs one anchor token and position per state (N >= 1)")
    if held is None:
        held = [s.n_ctx for s in states]
    check_states(drafter, states)
    for tok, pos, n in zip(anchor_token_ids, anchor_positions, held, strict=True):
        if pos != n:
            raise DFlashDesyncError(
                f"draft desync: anchor at position {pos} but the drafter holds "
                f"{n} context tokens (the anchor must follow the context)"
            )
        if not 0 <= int(tok) < cfg.vocab_size:
            raise ValueError(f"anchor token {tok} outside the vocab [0, {cfg.vocab_size})")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("draft_batch got the same state twice")
    return t
