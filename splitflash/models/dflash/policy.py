"""Per-layer attention policy actually in force, and its human / metric forms.

The service logs `policy_string` at start-up and exports `policy_info` as an info metric,
so a window that is configured but not applied can never go unnoticed.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from splitflash.models.dflash.cache import AttentionBackend
from splitflash.models.dflash.config import SLIDING, DFlashConfig

WindowOverride = Literal["checkpoint", "off"]
WINDOW_OVERRIDES = ("checkpoint", "off")


class LayerPolicy(NamedTuple):
    layer: int
    kind: str  # "sliding" | "full" | "full_override" (a checkpoint sliding layer forced full)
    window: int | None  # window in force (None: all context)


def build_policy(
    config: DFlashConfig, window_override: str, backend: AttentionBackend
) -> list[LayerPolicy]:
    if window_override not in WINDOW_OVERRIDES:
        raise ValueError(
            f"window_override must be one of {WINDOW_OVERRIDES}, got {window_override!r}"
        )
    policy = []
    for i, layer_type in enumerate(config.layer_types):
        if layer_type != SLIDING:
            policy.append(LayerPolicy(i, "full", None))
        elif window_override == "off":
            policy.append(LayerPolicy(i, "full_override", None))
        else:
            if not backend.bounds_window_reads:
                raise ValueError(
                    f"layer {i} is a sliding layer (window {config.sliding_window}) but "
                    f"attention backend {backend.name!r} cannot bound its reads to the "
                    f"window; refusing to run it with reads linear in context"
                )
            policy.append(LayerPolicy(i, "sliding", config.sliding_window))
    return policy


def policy_string(config: DFlashConfig, policy: list[LayerPolicy], window_override: str) -> str:
    n = len(policy)
    sliding = [p for p in policy if p.kind == "sliding"]
    n_full = n - len(sliding)
    if sliding:
        w = config.sliding_window
        head = f"{len(sliding)} of {n} layers sliding (window {w}), {n_full} full"
    else:
        head = f"0 of {n} layers sliding, {n_full} full"
    forced = sum(p.kind == "full_override" for p in policy)
    if forced:
        head += (
            f" [window_override=off: {forced} checkpoint sliding layer(s) of window "
            f"{config.sliding_window} run FULL attention]"
        )
    causal = "causal" if config.is_causal else "non-causal"
    source = "" if config.causal is not None else " (checkpoint sets no flag)"
    return f"{head}; block {causal}{source}; block_size {config.block_size}"


def policy_info(
    config: DFlashConfig, policy: list[LayerPolicy], window_override: str, backend: AttentionBackend
) -> dict[str, str]:
    """Labels for an info metric (all strings, as Prometheus Info wants)."""
    sliding = sum(p.kind == "sliding" for p in policy)
    return {
        "layers": str(len(policy)),
        "sliding_layers": str(sliding),
        "full_layers": str(len(policy) - sliding),
        "window": str(config.sliding_window if sliding else 0),
        "window_override": window_override,
        "causal": str(config.is_causal).lower(),
        "block_size": str(config.block_size),
        "attention_backend": backend.name,
        "summary": policy_string(config, policy, window_override),
    }
