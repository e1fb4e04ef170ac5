"""The drafter's layers through the fused kernels (CUDA, or SPLITFLASH_FORCE_TRITON=1).

Why: written as modules, a draft layer is ~60 launches (each RMSNorm 8 elementwise ops, each
RoPE 5, q / k / v / gate / up apart), and the context rows' K/V ~16 more per layer: a 3-layer
draft step ran ~250 kernels, 0.43-0.47 ms of graph replay on the H200 at batch 1 for ~5 MB
of weights (bench/RESULTS.md). Here a layer is the target's four fused linears
(kernels/fused_linear.py: norm + q/k/v, o_proj + residual, norm + gate/up + SwiGLU, down +
residual) and one per-head norm + RoPE launch each for q and k (kernels/head_norm_rope.py);
the context rows take one norm + linear for every layer's K and V at once. Measured on an H100
(bench.draft_graphs, session 29): graph replay at batch 1 0.59-0.63 -> 0.20-0.24 ms, at
batch 8 0.65-0.91 -> 0.22-0.48 ms.

Same op sequence as the modules, so the same roundings, except where the fused linears
differ (the norm weight folded into the linear weight and rounded once; another fp32
summation order): the drafter's proposals move by rounding, and verification keeps the
output exact whatever they are. On CPU the modules run as before (bit for bit).

q/k/v and gate/up weights are joined into one matrix per layer, cached on the module until a
weight changes (`joined`), as the folded norm weights are: a second copy of those weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from splitflash.kernels.dispatch import _announce, use_triton
from splitflash.kernels.fused_dispatch import head_norm_rope, linear_residual, norm_linear


def fused_path(t: torch.Tensor) -> bool:
    """Run the drafter through the fused kernels (t: its weights)? Where the kernels dispatch
    to Triton, unless SPLITFLASH_FUSED_DRAFTER=0 (to measure with and without, or to rule it
    out) or autograd is recording for these weights. The choice is logged once per distinct
    outcome (kernels/dispatch.py)."""
    triton_ok, reason = use_triton(t)
    if triton_ok and os.environ.get("SPLITFLASH_FUSED_DRAFTER", "1") == "0":
        triton_ok, reason = False, "SPLITFLASH_FUSED_DRAFTER=0"
    elif triton_ok and torch.is_grad_enabled() and t.requires_grad:
        # No backward in the kernels, and a cached join would hold one step's autograd graph.
        triton_ok, reason = False, "weights need gradients (the kernels have no backward)"
    _announce("dflash_layers", "fused kernels" if triton_ok else "torch modules", reason)
    return triton_ok


def joined(owner: nn.Module, name: str, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(weights) [sum N_i, K], cached on owner under `name` until any weight is
    modified or replaced (`.to()` swaps a parameter's data: the pointer is in the key)."""
    try:
        key = tuple((w.data_ptr(), w._version) for w in weights)
    except RuntimeError:  # inference tensors keep no version counter: join every call
        return torch.cat(list(weights))
    hit = owner.__dict__.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    cat = torch.cat(list(weights)).contiguous()
    owner.__dict__[name] = (key, cat)
    return cat


def block_layer(
    layer: nn.Module,  # DFlashDecoderLayer
    h: torch.Tensor,  # [M, D] hidden rows of N blocks of T tokens (M = N * T)
    cos: torch.Tensor,  # [M, hd]
    sin: torch.Tensor,  # [M, hd]
    attend: Callable,  # (q [N, T, H, hd], k, v [N, T, H_KV, hd]) -> [N, T, H, hd]
    n: int,  # N blocks
) -> torch.Tensor:  # [M, D]: h after the layer
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w_qkv = joined(attn, "_qkv_joined",
                   [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # fmt: skip
    qkv = norm_linear(h, layer.input_layernorm.weight, layer.input_layernorm.eps, w_qkv)
    q_end, k_end = heads * hd, (heads + kv_heads) * hd  # [M, (H + 2 H_KV) hd] column ranges
    q = head_norm_rope(qkv[:, :q_end].unflatten(-1, (heads, hd)), attn.q_norm.weight,
                       attn.q_norm.eps, cos, sin)  # fmt: skip
    k = head_norm_rope(qkv[:, q_end:k_end].unflatten(-1, (kv_heads, hd)), attn.k_norm.weight,
                       attn.k_norm.eps, cos, sin)  # fmt: skip
    v = qkv[:, k_end:].unflatten(-1, (kv_heads, hd))
    o = attend(q.unflatten(0, (n, -1)), k.unflatten(0, (n, -1)), v.unflatten(0, (n, -1)))
    h = linear_residual(o.reshape(h.shape[0], heads * hd), attn.o_proj.weight, h)
    w_gate_up = joined(mlp, "_gate_up_joined", [mlp.gate_proj.weight, mlp.up_proj.weight])
    norm = layer.post_attention_layernorm
    act = norm_linear(h, norm.weight, norm.eps, w_gate_up,
                      swiglu_hidden=mlp.gate_proj.weight.shape[0])  # fmt: skip
    return linear_residual(act, mlp.down_proj.weight, h)


def context_kv(
    drafter: nn.Module,  # DFlashDrafter
    features: torch.Tensor,  # [n, K*D] on the weights' device
    cos: torch.Tensor,  # [n, hd] at the rows' positions
    sin: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer (k, v) [n, H_KV, hd]
    """fc, then hidden_norm and every layer's W_K / W_V in one fused linear, then each layer's
    k_norm + RoPE (v is a view of the joined output)."""
    w = drafter.fc.weight
    ctx = F.linear(features.to(dtype=w.dtype), w)  # [n, D]
    attns = [layer.self_attn for layer in drafter.layers]
    w_kv = joined(drafter, "_context_kv_joined",
                  [p.weight for a in attns for p in (a.k_proj, a.v_proj)])  # fmt: skip
    norm = drafter.hidden_norm
    kv = norm_linear(ctx, norm.weight, norm.eps, w_kv)  # [n, L * 2 * H_KV * hd]
    heads, hd = attns[0].n_kv_heads, attns[0].head_dim  # the config's, every layer's
    kv = kv.unflatten(-1, (len(attns), 2, heads, hd))  # [n, L, 2, H_KV, hd]
    return [(head_norm_rope(kv[:, i, 0], a.k_norm.weight, a.k_norm.eps, cos, sin), kv[:, i, 1])
            for i, a in enumerate(attns)]  # fmt: skip
