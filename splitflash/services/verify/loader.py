"""Build the verify service's TargetEngine from its settings (the CLI path; tests inject one)."""

from __future__ import annotations

import logging

import torch

from splitflash.models import store
from splitflash.models.attention import MAX_TREE_Q
from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.loading import load_target
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.tp_engine import load_tp_engine
from splitflash.services.verify.warmup import warm_up

log = logging.getLogger(__name__)


def load_engine(settings: VerifySettings) -> TargetEngine:
    path = store.resolve(settings.target)
    dtype = getattr(torch, settings.torch_dtype_name)
    log.info(
        "loading target %s (%s) on %s as %s",
        settings.target,
        path,
        settings.device,
        settings.torch_dtype_name,
    )
    if settings.tp_size > 1:  # ranks 1.. run in processes of their own; close() ends them
        return load_tp_engine(settings, path)
    model = load_target(path, device=settings.device, dtype=dtype)
    model.batch_invariant = settings.batch_invariant
    if settings.batch_invariant:
        log.info("batch-invariant verify steps%s", "" if settings.device.startswith("cuda")
                 else " (no effect off CUDA: the CPU path runs the torch references)")  # fmt: skip
    cfg = model.cfg
    graphs_on = settings.cuda_graphs and torch.device(settings.device).type == "cuda"
    cache = PagedKVCache(
        cfg.num_layers,
        settings.kv_pages,
        settings.page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype=dtype,
        device=settings.device,
        scratch_pages=-(-MAX_TREE_Q // settings.page_size) if graphs_on else 0,
    )
    graphs = (
        VerifyGraphs(model, cache, settings.graph_batch_sizes, settings.graph_max_held)
        if graphs_on
        else None
    )
    log.info(
        "verify steps: %s",
        f"CUDA graphs at batch sizes {settings.graph_batch_sizes}" if graphs else "eager",
    )
    engine = TargetEngine(model, cache, max_context=settings.max_context or None, graphs=graphs,
                          prefill_chunk=settings.prefill_chunk)  # fmt: skip
    if settings.warmup and torch.device(settings.device).type == "cuda":
        log.info("warming up the verify kernels (settings.warmup) ...")
        log.info("verify warm-up done in %.1f s", warm_up(engine))
    return engine
