"""The dense (no paged cache) target path used for training vs the serving target."""

from __future__ import annotations

import torch

from splitflash.local import generate_local
from splitflash.models.kv_cache import PagedKVCache
from splitflash.training.dense import generate_batch, target_features
from tests.conftest import tiny_engine, tiny_model


def _paged_hidden(model, ids: list[int], layer_ids):
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim)
    eng = tiny_engine(model)
    eng.cache = cache
    cache.add("r")
    cache.reserve("r", len(ids))
    batch = eng._batch([("r", ids, 0)])
    return model(batch, cache, None, layer_ids).hidden


def test_features_match_paged_forward_with_right_padding():
    model = tiny_model(num_layers=4)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (11, 6)]
    ids = torch.zeros(2, 11, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    layer_ids = (0, 2)
    got = target_features(model, ids, layer_ids)
    assert got.shape == (2, 11, 2 * model.cfg.hidden_size)
    for r, row in enumerate(rows):
        want = _paged_hidden(model, row, layer_ids)
        torch.testing.assert_close(got[r, : len(row)], want, atol=1e-5, rtol=1e-5)


def test_batched_greedy_generation_equals_engine_greedy():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 2)]
    stop = {2}
    got = generate_batch(model, prompts, 12, stop)
    for prompt, out in zip(prompts, got, strict=True):
        want = generate_local(tiny_engine(model), None, prompt, 12, stop_ids=stop).token_ids
        assert out == want
