"""Load / save DFlash drafters in the public format (config.json + model.safetensors).

Tensor names and config keys: see `splitflash.models.dflash.config`. Loading is strict:
a missing, unexpected or mis-shaped tensor raises, so a checkpoint for another variant or
target can never load half-way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from splitflash.models.dflash.cache import AttentionBackend
from splitflash.models.dflash.config import DFlashConfig
from splitflash.models.dflash.model import DFlashDrafter
from splitflash.models.dflash.policy import WindowOverride

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights (recomputed from rope_theta here).
_IGNORED = {"rotary_emb.inv_freq"}


def _weight_files(root: Path) -> list[Path]:
    if (root / WEIGHTS_FILE).is_file():
        return [root / WEIGHTS_FILE]
    if (root / INDEX_FILE).is_file():
        index = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))
        return [root / f for f in sorted(set(index["weight_map"].values()))]
    raise ValueError(f"no {WEIGHTS_FILE} (or {INDEX_FILE}) in DFlash checkpoint {root}")


def read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, names without the optional `model.` prefix."""
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(root):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                key = name[len("model.") :] if name.startswith("model.") else name
                if key in out:
                    raise ValueError(f"DFlash checkpoint names tensor {key!r} twice")
                out[key] = f.get_tensor(name)
    return out


def load_dflash(
    path_dir: str | Path,
    embed_tokens: nn.Embedding,
    lm_head_weight: torch.Tensor,
    target_num_layers: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    window_override: WindowOverride = "checkpoint",
    attention_backend: AttentionBackend | None = None,
) -> DFlashDrafter:
    """Build a drafter from a public-format checkpoint, sharing the target's embed/head.
    attention_backend None: Triton on CUDA, torch on CPU (see `DFlashDrafter.backend`)."""
    root = Path(path_dir)
    if not (root / CONFIG_FILE).is_file():
        raise ValueError(f"no {CONFIG_FILE} in DFlash checkpoint {root}")
    config = DFlashConfig.from_json(root / CONFIG_FILE, target_num_layers=target_num_layers)
    config.check_target(
        embed_tokens.weight.shape[0], embed_tokens.weight.shape[1], target_num_layers
    )
    with torch.device("meta"):  # no throw-away random init of the real-size weights
        drafter = DFlashDrafter(
            config,
            _meta_embed(embed_tokens),
            _meta_like(lm_head_weight),
            window_override=window_override,
            attention_backend=attention_backend,
        )
    drafter.attach_shared(embed_tokens, lm_head_weight)
    tensors = {k: v for k, v in read_tensors(root).items() if k not in _IGNORED}
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"DFlash checkpoint {root} does not match its config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"DFlash tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
    drafter.load_state_dict(
        {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}, assign=True
    )
    return drafter.eval().requires_grad_(False)


def save_dflash(drafter: DFlashDrafter, path_dir: str | Path) -> None:
    """Write config.json + model.safetensors in the public format (no embedding, no head)."""
    root = Path(path_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(
        json.dumps(drafter.config.to_dict(), indent=2) + "\n", encoding="utf-8"
    )
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})


def _meta_embed(embed: nn.Embedding) -> nn.Embedding:
    return nn.Embedding(*embed.weight.shape, device="meta")


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, device="meta")
