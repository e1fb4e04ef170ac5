"""Building a DFlash proposer: the shipped drafter per target, the checkpoint loaded next to
the target's embedding and LM head, and on CUDA its KV pool and draft graphs (the draft
service's factory, registry.DFLASH_FACTORY)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from splitflash.models.dflash import load_dflash
from splitflash.models.dflash.graphs import DEFAULT_MAX_GRAPHS, DraftGraphs
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.draft.dflash_drafter import DFlashProposer
from splitflash.services.draft.warmup import warm_up

logger = logging.getLogger("splitflash.draft")

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "drafters"
DEFAULT_DRAFTERS = {"smollm2-135m": "smollm2-135m-dflash"}


def default_drafter_path(target: str = "smollm2-135m") -> Path:
    """The drafter shipped for a named target (splitflash/assets/drafters/...)."""
    if target not in DEFAULT_DRAFTERS:
        raise ValueError(
            f"no shipped DFlash drafter for target {target!r}; "
            f"give one as dflash:PATH (shipped: {sorted(DEFAULT_DRAFTERS)})"
        )
    path = ASSET_DIR / DEFAULT_DRAFTERS[target]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"shipped drafter missing at {path} (train one with "
            f"`splitflash train-drafter --out {path}`)"
        )
    return path


def load_proposer(
    path: str | Path,
    embed_tokens: nn.Embedding,
    lm_head_weight: torch.Tensor,
    target_num_layers: int,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    window_override: str = "checkpoint",
    pool_slots: int = 0,
    pool_context: int = 0,
    cuda_graphs: bool = False,
    graph_max_held: int = DEFAULT_MAX_GRAPHS,
) -> DFlashProposer:
    """pool_slots > 0: a DraftKVPool of that many requests x pool_context rows per full layer;
    cuda_graphs: capture the draft step over it (CUDA only)."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    drafter = load_dflash(
        path,
        embed_tokens,
        lm_head_weight,
        target_num_layers,
        dtype,
        device,
        window_override=window_override,
    )
    pool = graphs = None
    if pool_slots > 0:
        pool = DraftKVPool(drafter, pool_slots, pool_context)
        logger.info("draft KV pool: %d requests x %d context rows (%.1f MB)", pool_slots,
                    pool_context, pool.nbytes() / 1e6)  # fmt: skip
    if cuda_graphs and pool is not None and torch.device(device).type == "cuda":
        graphs = DraftGraphs(drafter, pool, max_graphs=graph_max_held)
        logger.info("draft step CUDA graphs: on (batch sizes %s)", graphs.batch_sizes)
    return DFlashProposer(drafter, pool, graphs)


def build_dflash_drafter(
    path: str | None = None,
    target: str = "smollm2-135m",
    device: str = "cpu",
    window_override: str = "checkpoint",
    pool_slots: int = 0,
    pool_context: int = 0,
    cuda_graphs: bool = False,
    graph_max_held: int = DEFAULT_MAX_GRAPHS,
    warmup: bool = False,
):
    """The draft service's factory: loads only the target's embedding and LM head. On CUDA
    the requests' context lives in a pool (pool_slots requests; pool_context rows per full
    layer, 0 = the target's context length), the draft step is CUDA-graphed and, with
    warmup, its kernels compile here (warmup.py) rather than in the first request."""
    from splitflash.models import store
    from splitflash.models.loading import load_checkpoint

    tcfg, state = load_checkpoint(store.resolve(target))
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    weight = state["embed_tokens.weight"].to(device=device, dtype=dtype)
    embed = nn.Embedding.from_pretrained(weight, freeze=True)
    head = (
        state["lm_head.weight"].to(device=device, dtype=dtype)
        if ("lm_head.weight" in state and not tcfg.tie_word_embeddings)
        else weight
    )
    ckpt = path or default_drafter_path(target if target in DEFAULT_DRAFTERS else "smollm2-135m")
    on_cuda = torch.device(device).type == "cuda"
    proposer = load_proposer(
        ckpt, embed, head, tcfg.num_layers, device, dtype, window_override,
        pool_slots=pool_slots if on_cuda else 0,
        pool_context=pool_context or tcfg.max_position_embeddings,
        cuda_graphs=cuda_graphs, graph_max_held=graph_max_held,
    )  # fmt: skip
    if warmup and on_cuda:
        logger.info("warming up the draft kernels (settings.warmup) ...")
        logger.info("draft warm-up done in %.1f s", warm_up(proposer))
    return proposer
