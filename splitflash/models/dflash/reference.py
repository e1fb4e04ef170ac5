"""Dense-mask reference drafter: the test oracle, never a serving path.

Recomputes everything from the full list of context features and the block, with one dense
[T, n_ctx + T] mask per layer (window applied as a mask). It shares only the weights with
`DFlashDrafter`; the math (norms, RoPE, masks, attention) is written out again here.
"""

from __future__ import annotations

import torch

from splitflash.models.dflash.config import SLIDING
from splitflash.models.dflash.model import DFlashDrafter


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, hd] rotated by the absolute positions [n] (half-split convention)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    ang = positions.double()[:, None] * inv[None, :]  # [n, hd/2]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def checkpoint_windows(drafter: DFlashDrafter) -> list[int | None]:
    """Per-layer windows exactly as the checkpoint config declares them."""
    cfg = drafter.config
    return [cfg.sliding_window if t == SLIDING else None for t in cfg.layer_types]


def dense_mask(n_ctx: int, t: int, window: int | None, causal: bool) -> torch.Tensor:
    """Bool [T, n_ctx + T]: may block query i (position n_ctx + i) see key j (position j)."""
    qpos = torch.arange(n_ctx, n_ctx + t)[:, None]
    kpos = torch.arange(n_ctx + t)[None, :]
    mask = torch.ones(t, n_ctx + t, dtype=torch.bool)
    if causal:
        mask &= kpos <= qpos
    if window is not None:
        mask &= (qpos - kpos) < window
        if not causal:
            mask &= (kpos - qpos) < window
    return mask


@torch.no_grad()
def reference_draft(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    anchor_token_id: int,
    block_size: int,
    windows: list[int | None] | None = None,
    causal: bool | None = None,
) -> torch.Tensor:
    """Logits [block_size - 1, V] from features [n_ctx, K*D] of positions 0 .. n_ctx - 1.

    windows: per-layer window (None = full); defaults to the checkpoint's declared policy.
    """
    cfg = drafter.config
    windows = checkpoint_windows(drafter) if windows is None else windows
    causal = cfg.is_causal if causal is None else causal
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    n, t = features.shape[0], block_size
    w_fc = drafter.fc.weight
    ctx = _rms(features.to(w_fc.dtype) @ w_fc.T, drafter.hidden_norm.weight, eps)  # [n, D]
    ids = torch.tensor([anchor_token_id] + [cfg.mask_token_id] * (t - 1))
    h = drafter._shared.embed_tokens.weight[ids].to(w_fc.dtype) * cfg.input_embedding_scale
    pos_all = torch.arange(n + t)
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    for layer, window in zip(drafter.layers, windows, strict=True):
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)  # [T, D]
        q = _rms((x @ a.q_proj.weight.T).view(t, nh, hd), a.q_norm.weight, eps)
        q = _rope(q, pos_all[n:], theta)
        src = torch.cat([ctx, x])  # [n + T, D]: KV injection of the context, then the block
        k = _rms((src @ a.k_proj.weight.T).view(n + t, nkv, hd), a.k_norm.weight, eps)
        k = _rope(k, pos_all, theta)
        v = (src @ a.v_proj.weight.T).view(n + t, nkv, hd)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, H, hd]
        scores = torch.einsum("thd,shd->hts", q, k) / hd**0.5  # [H, T, S]
        mask = dense_mask(n, t, window, causal)
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * hd)
        h = h + o @ a.o_proj.weight.T
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        gate = torch.nn.functional.silu(y @ m.gate_proj.weight.T)
        h = h + (gate * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    h = _rms(h[1:], drafter.norm.weight, eps)
    head = drafter.lm_head_weight
    return h.to(head.dtype) @ head.T
