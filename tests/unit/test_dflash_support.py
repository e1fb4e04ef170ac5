"""Shared helpers for the DFlash unit tests (tiny random drafters, a hand-written checkpoint)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from torch import nn

from splitflash.models.dflash import DFlashConfig, DFlashDrafter

V, D, N_TARGET = 97, 64, 6
TOL = {"atol": 3e-5, "rtol": 1e-5}


def cfg_dict(
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    window=8,
    block=6,
    causal=None,
    **over,
) -> dict:
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": D,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": V,
        "layer_types": list(layer_types),
        "sliding_window": window,
        "num_target_layers": N_TARGET,
        "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": V - 1, "block_size": block},
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
        drafter.append_context(state, f[pos : pos + c], pos)
        pos += c
    return state, f


def public_checkpoint(tmp_path, prefix="model."):
    """A tiny checkpoint written by hand in the public format (not through save_dflash)."""
    cfg = cfg_dict()
    g = torch.Generator().manual_seed(42)
    hd, h, hkv, i_sz = 16, 4, 2, 128
    tensors = {
        "fc.weight": torch.randn(D, 2 * D, generator=g) * 0.1,
        "hidden_norm.weight": torch.rand(D, generator=g) + 0.5,
        "norm.weight": torch.rand(D, generator=g) + 0.5,
    }
    shapes = {
        "self_attn.q_proj.weight": (h * hd, D),
        "self_attn.k_proj.weight": (hkv * hd, D),
        "self_attn.v_proj.weight": (hkv * hd, D),
        "self_attn.o_proj.weight": (D, h * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (i_sz, D),
        "mlp.up_proj.weight": (i_sz, D),
        "mlp.down_proj.weight": (D, i_sz),
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
    }
    for layer in range(3):
        for name, shape in shapes.items():
            tensors[f"layers.{layer}.{name}"] = torch.randn(*shape, generator=g) * 0.1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({prefix + k: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tensors
