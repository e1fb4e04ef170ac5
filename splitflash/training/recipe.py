"""The default drafter for a target: shape, feature layers, mask token (DFLASH.md)."""

from __future__ import annotations

from splitflash.models.config import TargetConfig
from splitflash.models.dflash.config import FULL, SLIDING, DFlashConfig


def default_target_layer_ids(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` ids spread evenly from layer 2 to the third-to-last layer (DFLASH.md)."""
    if num_layers < 1 or count < 1:
        raise ValueError(f"need >= 1 target layer and >= 1 feature layer ({num_layers}, {count})")
    lo, hi = 2, num_layers - 3
    if hi <= lo:  # toy targets: spread over every layer instead
        lo, hi = 0, num_layers - 1
    if count == 1:
        return (hi,)
    ids = sorted({round(lo + (hi - lo) * j / (count - 1)) for j in range(count)})
    return tuple(ids)


def parse_layer_ids(spec: str, num_layers: int) -> tuple[int, ...]:
    """'auto' or a comma list such as '2,8,14,21,27'."""
    if spec == "auto":
        return default_target_layer_ids(num_layers)
    try:
        ids = tuple(int(s) for s in spec.split(","))
    except ValueError:
        raise ValueError(
            f"--target-layers must be 'auto' or comma-separated ints: {spec!r}"
        ) from None
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(f"--target-layers {spec!r}: ids must be unique in [0, {num_layers})")
    return ids


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A special token ordinary text never holds, and not bos/eos/pad (they occur in data)."""
    busy = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if i not in busy]
    specials = [i for i in specials if 0 <= i < vocab_size]
    return max(specials) if specials else vocab_size - 1


def drafter_config(
    target: TargetConfig,
    *,
    layers: int = 3,
    window: int | None = 512,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] | None = None,
    mask_token_id: int = 0,
    intermediate_size: int = 1024,
    causal: bool = False,
) -> DFlashConfig:
    """Qwen3-style drafter with the target's width (embedding and head are shared).

    Every layer but the last slides over `window` context keys (None: all full); the last
    is full so the draft still sees the whole context once.
    """
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    types = [SLIDING if window else FULL] * (layers - 1) + [FULL]
    ids = target_layer_ids or default_target_layer_ids(target.num_layers)
    return DFlashConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=target.num_heads,
        num_key_value_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        intermediate_size=intermediate_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        vocab_size=target.vocab_size,
        layer_types=tuple(types),
        sliding_window=window if window else None,
        target_layer_ids=tuple(ids),
        mask_token_id=mask_token_id,
        block_size=block_size,
        causal=causal,
        num_target_layers=target.num_layers,
    )
