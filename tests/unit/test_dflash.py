"""DFlash drafter: cached block drafting vs the dense-mask oracle, bounded reads, checkpoints."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from splitflash.models.dflash import (
    AttentionBackend,
    DFlashConfig,
    DFlashDesyncError,
    DFlashDrafter,
    block_attention,
    load_dflash,
    save_dflash,
)
from splitflash.models.dflash.reference import reference_draft

V, D, N_TARGET = 97, 64, 6
TOL = {"atol": 3e-5, "rtol": 1e-5}


def cfg_dict(layer_types=("sliding_attention", "sliding_attention", "full_attention"),
             window=8, block=6, causal=None, **over) -> dict:
    d = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": D, "num_hidden_layers": len(layer_types), "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": V,
        "layer_types": list(layer_types), "sliding_window": window,
        "num_target_layers": N_TARGET,
        "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": V - 1,
                          "block_size": block},
    }
    if causal is not None:
        d["dflash_config"]["is_causal"] = causal
    d.update(over)
    return d


def shared(seed=0) -> tuple[nn.Embedding, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(V, D)
    emb.weight.data = torch.randn(V, D, generator=g)
    return emb, torch.randn(V, D, generator=g) * 0.3


def make(cfg: dict | None = None, seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    emb, head = shared(seed)
    drafter = DFlashDrafter(DFlashConfig.from_dict(cfg or cfg_dict()), emb, head, **kw)
    for name, p in drafter.named_parameters():  # norms at 1.0 would hide weight mix-ups
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
    return drafter.eval()


def feats(n: int, seed=1) -> torch.Tensor:
    return torch.randn(n, 2 * D, generator=torch.Generator().manual_seed(seed))


def fill(drafter, n, chunks=None, seed=1):
    state, f = drafter.new_state(), feats(n, seed)
    pos = 0
    for c in chunks or [n]:
        drafter.append_context(state, f[pos:pos + c], pos)
        pos += c
    return state, f


@pytest.mark.parametrize("causal", [None, True])
@pytest.mark.parametrize("n_ctx", [0, 1, 5, 7, 8, 9, 26, 70])
def test_block_draft_matches_dense_reference(n_ctx, causal):
    drafter = make(cfg_dict(causal=causal))
    state, f = fill(drafter, n_ctx)
    out = drafter.draft(state, 7, n_ctx, 6)
    assert out.shape == (5, V)
    torch.testing.assert_close(out, reference_draft(drafter, f, 7, 6), **TOL)


def test_block_longer_than_window_and_smaller_block():
    drafter = make(cfg_dict(window=3, block=8))
    state, f = fill(drafter, 20)
    for b in (8, 4, 2):
        torch.testing.assert_close(drafter.draft(state, 3, 20, b),
                                   reference_draft(drafter, f, 3, b), **TOL)
    with pytest.raises(ValueError, match="block_size"):
        drafter.draft(state, 3, 20, 9)  # trained at B=8: never run larger


@pytest.mark.parametrize("mult", [1, 4, 16])
def test_sliding_reads_and_memory_bounded_by_window(mult):
    w = 8
    drafter = make(cfg_dict(window=w))
    state, f = fill(drafter, mult * w, chunks=[3] * (mult * w // 3) + [mult * w % 3])
    out = drafter.draft(state, 5, mult * w, 6)
    assert state.keys_read_last[:2] == [min(mult * w, w - 1)] * 2  # sliding layers
    assert state.keys_read_last[2] == mult * w  # the full layer reads everything
    assert state.keys_read_by_kind() == {"sliding": min(mult * w, w - 1), "full": mult * w}
    assert all(rows <= w for rows in state.cache_rows()[:2])
    torch.testing.assert_close(out, reference_draft(drafter, f, 5, 6), **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_ring_wraparound_uneven_appends(seed):
    g = torch.Generator().manual_seed(seed)
    drafter = make(cfg_dict(window=5), seed=seed)
    state, f = drafter.new_state(), feats(300, seed)
    pos = 0
    while pos < 250:
        c = int(torch.randint(1, 13, (1,), generator=g))  # uneven, sometimes > window
        drafter.append_context(state, f[pos:pos + c], pos)
        pos += c
        tok = int(torch.randint(0, V, (1,), generator=g))
        torch.testing.assert_close(drafter.draft(state, tok, pos),
                                   reference_draft(drafter, f[:pos], tok, 6), **TOL)
    assert state.cache_rows()[:2] == [5, 5]


def test_full_attention_layers_match_reference():
    drafter = make(cfg_dict(layer_types=("full_attention",) * 2))
    assert [p.kind for p in drafter.policy_summary()] == ["full", "full"]
    state, f = fill(drafter, 40, chunks=[17, 1, 22])
    torch.testing.assert_close(drafter.draft(state, 11, 40),
                               reference_draft(drafter, f, 11, 6), **TOL)
    assert state.keys_read_last == [40, 40]


def test_batched_draft_equals_single():
    drafter = make()
    states = [fill(drafter, n, seed=n)[0] for n in (3, 12, 30)]
    batch = drafter.draft_batch(states, [1, 2, 3], [3, 12, 30], 5)
    for i, (s, n) in enumerate(zip(states, (3, 12, 30), strict=True)):
        torch.testing.assert_close(batch[i], drafter.draft(s, i + 1, n, 5), **TOL)


def test_policy_summary_and_string():
    cfg = cfg_dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], window=2048)
    cfg["dflash_config"]["target_layer_ids"] = [1, 2]
    drafter = make(cfg)
    assert [tuple(p) for p in drafter.policy_summary()] == (
        [(i, "sliding", 2048) for i in range(5)] + [(5, "full", None)])
    assert drafter.policy_string().startswith("5 of 6 layers sliding (window 2048), 1 full")
    assert "non-causal" in drafter.policy_string()
    info = drafter.policy_info()
    assert info["sliding_layers"] == "5" and info["window"] == "2048"
    assert info["window_override"] == "checkpoint"


def test_window_override_off_is_loud_and_matches_unwindowed_reference():
    base = make()
    off = make(window_override="off")
    assert [p.kind for p in off.policy_summary()] == ["full_override", "full_override", "full"]
    assert "window_override=off" in off.policy_string()
    assert off.policy_string() != base.policy_string()
    assert off.policy_info()["sliding_layers"] == "0"
    state, f = fill(off, 30)
    out = off.draft(state, 4, 30)
    torch.testing.assert_close(out, reference_draft(off, f, 4, 6, windows=[None] * 3), **TOL)
    assert state.keys_read_last == [30, 30, 30]
    assert not torch.allclose(out, reference_draft(off, f, 4, 6), atol=1e-3)


def test_backend_that_cannot_bound_reads_is_refused_for_sliding_layers():
    unbounded = AttentionBackend("mask_after_qk", block_attention, bounds_window_reads=False)
    with pytest.raises(ValueError, match="cannot bound its reads"):
        make(attention_backend=unbounded)
    make(cfg_dict(layer_types=("full_attention",)), attention_backend=unbounded)
    make(attention_backend=unbounded, window_override="off")  # explicit experiment: allowed
    with pytest.raises(ValueError, match="window_override"):
        make(window_override="on")


@pytest.mark.parametrize("over, match", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "unknown"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": None}, "sliding_window"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
])
def test_config_refusals(over, match):
    d = cfg_dict()
    d.update(over)  # raw keys: num_hidden_layers stays 3
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(d)


@pytest.mark.parametrize("dflash, match", [
    ({"mask_token_id": V}, "outside the vocab"),
    ({"mask_token_id": -1}, "outside the vocab"),
    ({"target_layer_ids": [1, 6]}, "out of range"),
    ({"target_layer_ids": []}, "non-empty"),
    ({"block_size": 1}, "block_size"),
])
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


def test_desync_is_loud():
    drafter = make()
    state, _ = fill(drafter, 10)
    with pytest.raises(DFlashDesyncError, match="expected start_pos == 10"):
        drafter.append_context(state, feats(2), 9)
    with pytest.raises(DFlashDesyncError, match="expected start_pos == 10"):
        drafter.append_context(state, feats(2), 12)
    with pytest.raises(DFlashDesyncError, match="anchor"):
        drafter.draft(state, 1, 11)
    with pytest.raises(DFlashDesyncError, match="another drafter"):
        make().draft(state, 1, 10)
    with pytest.raises(ValueError, match="features"):
        drafter.append_context(state, torch.zeros(2, D), 10)
    assert state.n_ctx == 10  # refused appends changed nothing


def _public_checkpoint(tmp_path, prefix="model."):
    """A tiny checkpoint written by hand in the public format (not through save_dflash)."""
    cfg = cfg_dict()
    g = torch.Generator().manual_seed(42)
    hd, h, hkv, i_sz = 16, 4, 2, 128
    tensors = {"fc.weight": torch.randn(D, 2 * D, generator=g) * 0.1,
               "hidden_norm.weight": torch.rand(D, generator=g) + 0.5,
               "norm.weight": torch.rand(D, generator=g) + 0.5}
    shapes = {"self_attn.q_proj.weight": (h * hd, D), "self_attn.k_proj.weight": (hkv * hd, D),
              "self_attn.v_proj.weight": (hkv * hd, D), "self_attn.o_proj.weight": (D, h * hd),
              "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
              "mlp.gate_proj.weight": (i_sz, D), "mlp.up_proj.weight": (i_sz, D),
              "mlp.down_proj.weight": (D, i_sz), "input_layernorm.weight": (D,),
              "post_attention_layernorm.weight": (D,)}
    for layer in range(3):
        for name, shape in shapes.items():
            tensors[f"layers.{layer}.{name}"] = torch.randn(*shape, generator=g) * 0.1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({prefix + k: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_hand_written_public_checkpoint_loads(tmp_path, prefix):
    tensors = _public_checkpoint(tmp_path, prefix)
    emb, head = shared()
    drafter = load_dflash(tmp_path, emb, head, N_TARGET, dtype=torch.float32)
    sd = drafter.state_dict()
    assert set(sd) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(sd[k], v), k
    assert drafter._shared.embed_tokens is emb and not emb.weight.requires_grad
    state, f = fill(drafter, 20)
    torch.testing.assert_close(drafter.draft(state, 2, 20), reference_draft(drafter, f, 2, 6),
                               **TOL)


def test_checkpoint_with_wrong_tensors_refused(tmp_path):
    tensors = _public_checkpoint(tmp_path, "")
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
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(),
                               strict=True):
        assert k == k2 and torch.equal(a, b)
    s1, _ = fill(drafter, 15)
    s2, _ = fill(loaded, 15)
    torch.testing.assert_close(drafter.draft(s1, 9, 15), loaded.draft(s2, 9, 15), atol=0, rtol=0)


def test_bf16_runs_close_to_fp32():
    drafter = make()
    low = copy.deepcopy(drafter).to(torch.bfloat16)
    s32, f = fill(drafter, 12)
    s16 = low.new_state()
    low.append_context(s16, f, 0)
    out16 = low.draft(s16, 3, 12)
    assert out16.dtype == torch.float32  # logits in the shared head's dtype
    assert torch.isfinite(out16).all()
    torch.testing.assert_close(out16, drafter.draft(s32, 3, 12), atol=0.3, rtol=0.1)
