"""DFlash block-diffusion drafter: config, model, draft KV cache, checkpoints, reference."""

from splitflash.models.dflash.cache import (
    TORCH_ATTENTION,
    AttentionBackend,
    DFlashDesyncError,
    DFlashState,
    LayerKV,
    block_attention,
)
from splitflash.models.dflash.checkpoint import load_dflash, save_dflash
from splitflash.models.dflash.config import DFlashConfig
from splitflash.models.dflash.model import DFlashDrafter
from splitflash.models.dflash.policy import LayerPolicy, WindowOverride

__all__ = [
    "TORCH_ATTENTION",
    "AttentionBackend",
    "DFlashConfig",
    "DFlashDesyncError",
    "DFlashDrafter",
    "DFlashState",
    "LayerKV",
    "LayerPolicy",
    "WindowOverride",
    "block_attention",
    "load_dflash",
    "save_dflash",
]
