"""DFlash config parsing / refusals and public-format checkpoints (load, save, round trip)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from splitflash.models.dflash import DFlashConfig, load_dflash, save_dflash
from splitflash.models.dflash.reference import reference_draft
from tests.unit.test_dflash_support import (
    N_TARGET,
    TOL,
    D,
    V,
    cfg_dict,
    fill,
    make,
    public_checkpoint,
    shared,
)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "unknown"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": None}, "sliding_window"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ],
)
def test_config_refusals(over, match):
    d = cfg_dict()
    d.update(over)  # raw keys: num_hidden_layers stays 3
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(d)


@pytest.mark.parametrize(
    "dflash, match",
    [
        ({"mask_token_id": V}, "outside the vocab"),
        ({"mask_token_id": -1}, "outside the vocab"),
        ({"target_layer_ids": [1, 6]}, "out of range"),
        ({"target_layer_ids": []}, "non-empty"),
        ({"block_size": 1}, "block_size"),
    ],
)
def test_dflash_config_refusals(dflash, match):
    d = cfg_dict()
    d["dflash_config"].update(dflash)
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(d)


def test_target_layer_count_mismatch_refused():
    with pytest.raises(ValueError, match="num_target_layers"):
        DFlashConfig.from_dict(cfg_dict(), target_num_layers=8)
    d = cfg_dict()
    del d["num_target_layers"]
    with pytest.raises(ValueError, match="out of range"):
        DFlashConfig.from_dict(d, target_num_layers=3)


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_hand_written_public_checkpoint_loads(tmp_path, prefix):
    tensors = public_checkpoint(tmp_path, prefix)
    emb, head = shared()
    drafter = load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    sd = drafter.state_dict()
    assert set(sd) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(sd[k], v), k
    assert drafter._shared.embed_tokens is emb and not emb.weight.requires_grad
    state, f = fill(drafter, 20)
    torch.testing.assert_close(
        drafter.draft(state, 2, 20), reference_draft(drafter, f, 2, 6), **TOL
    )


def test_checkpoint_with_wrong_tensors_refused(tmp_path):
    tensors = public_checkpoint(tmp_path, "")
    emb, head = shared()
    tensors["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, D)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    del tensors["layers.0.attention_conv.base_kernel"]
    tensors["fc.weight"] = torch.zeros(D, 3 * D)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_target_layers"):
        load_dflash(tmp_path, emb, head, N_TARGET + 1, dtype=torch.float32)


def test_save_load_round_trip(tmp_path):
    drafter = make(cfg_dict(causal=False))
    save_dflash(drafter, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"]["mask_token_id"] == V - 1 and saved["is_causal"] is False
    emb, head = drafter._shared.embed_tokens, drafter._shared.lm_head_weight
    loaded = load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    assert loaded.config == drafter.config
    for (k, a), (k2, b) in zip(
        drafter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b)
    s1, _ = fill(drafter, 15)
    s2, _ = fill(loaded, 15)
    torch.testing.assert_close(drafter.draft(s1, 9, 15), loaded.draft(s2, 9, 15), atol=0, rtol=0)
