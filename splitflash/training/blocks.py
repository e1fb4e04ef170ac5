"""The training forward: A blocks per sequence in one pass, with one dense mask.

Per sequence, every block [anchor, MASK x (B-1)] sits at its anchor's position a and
sees, exactly as `DFlashDrafter.draft` at serving time:
- the target context features of positions p < a, through each layer's W_K / W_V
  (KV injection), within the layer's window (query pos - p < W);
- its own block non-causally (causal if the checkpoint says so), never another block.
Keys = [context (T) | all blocks (A * B)]; queries = all blocks. Shapes: N sequences,
T tokens, A anchors, B block size, Q = A * B, S = T + Q, D hidden, V vocab, K*D features.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from splitflash.models.dflash.model import DFlashDrafter


def block_masks(
    anchors: torch.Tensor, t: int, block: int, window: int | None, causal: bool
) -> torch.Tensor:
    """anchors [N, A] -> visibility [N, Q, S] bool (see the module docstring)."""
    n, a = anchors.shape
    dev = anchors.device
    j = torch.arange(block, device=dev)
    qpos = (anchors[:, :, None] + j).reshape(n, a * block)  # [N, Q]
    qanchor = anchors.repeat_interleave(block, dim=1)  # [N, Q]
    kpos = torch.arange(t, device=dev)
    ctx = kpos[None, None, :] < qanchor[:, :, None]  # [N, Q, T] the context before the anchor
    qblk = torch.arange(a * block, device=dev) // block
    own = (qblk[:, None] == qblk[None, :]).expand(n, -1, -1)  # [N, Q, Q] same block only
    rel_ctx = qpos[:, :, None] - kpos[None, None, :]
    rel_blk = qpos[:, :, None] - qpos[:, None, :]
    if causal:
        own = own & (rel_blk >= 0)
    if window is not None:
        ctx = ctx & (rel_ctx < window)
        own = own & (rel_blk.abs() < window if not causal else rel_blk < window)
    return torch.cat([ctx, own], dim=2)


def block_hidden(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Final-norm hidden states of block positions 1..B-1: [N, A, B - 1, D].

    features [N, T, K*D] of the target at positions 0..T-1; ids [N, T]; anchors [N, A]
    with a <= T - 1 (rows whose anchor slot is unused may repeat an anchor).
    """
    cfg = drafter.config
    n, t = ids.shape
    a = anchors.shape[1]
    dev = ids.device
    ctx = drafter.hidden_norm(drafter.fc(features))  # [N, T, D]
    blk_ids = torch.full((n, a, block), cfg.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[:, :, 0] = ids.gather(1, anchors)
    embed = drafter._shared.embed_tokens
    h = embed(blk_ids.view(n, a * block)).to(ctx.dtype) * cfg.input_embedding_scale  # [N, Q, D]
    qpos = (anchors[:, :, None] + torch.arange(block, device=dev)).view(n, a * block)
    cos_q, sin_q = drafter._rope(qpos)  # [N, Q, hd]
    cos_c, sin_c = drafter._rope(torch.arange(t, device=dev).expand(n, t))
    masks: dict[int | None, torch.Tensor] = {}
    for layer, pol in zip(drafter.layers, drafter.policy, strict=True):
        if pol.window not in masks:
            m = block_masks(anchors, t, block, pol.window, cfg.is_causal)
            masks[pol.window] = m[:, None]  # [N, 1, Q, S]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.project_q(x, cos_q, sin_q)  # [N, Q, H, hd]
        kb, vb = attn.project_kv(x, cos_q, sin_q)  # [N, Q, H_KV, hd]
        kc, vc = attn.project_kv(ctx, cos_c, sin_c)  # [N, T, H_KV, hd]
        k = torch.cat([kc, kb], 1).transpose(1, 2)  # [N, H_KV, S, hd]
        v = torch.cat([vc, vb], 1).transpose(1, 2)
        group = attn.n_heads // attn.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q, k, v = q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[pol.window])
        h = h + attn.o_proj(o.transpose(1, 2).flatten(2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h.view(n, a, block, -1)[:, :, 1:])


def block_logits(drafter: DFlashDrafter, features, ids, anchors, block: int) -> torch.Tensor:
    """Logits [N, A, B - 1, V] (the same rows `DFlashDrafter.draft` returns per block)."""
    h = block_hidden(drafter, features, ids, anchors, block)
    head = drafter.lm_head_weight
    return h @ head.to(h.dtype).T


def sample_anchors(
    lengths: list[int], starts: list[int], count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row in [start, length - 2] (each has >= 1 label).

    Returns anchors [N, A] long and valid [N, A] bool; unused slots repeat the first anchor.
    """
    rows, valid = [], []
    for length, start in zip(lengths, starts, strict=True):
        lo, hi = max(1, start), length - 2  # anchor 0 would have no context at all
        span = max(0, hi - lo + 1)
        pick = (torch.randperm(span, generator=generator)[:count] + lo).tolist() if span else []
        keep = [True] * len(pick) + [False] * (count - len(pick))
        pick = pick + [pick[0] if pick else max(0, length - 1)] * (count - len(pick))
        rows.append(pick)
        valid.append(keep)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(valid, dtype=torch.bool)


def block_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """Cross-entropy over block positions k = 1..B-1 weighted by exp(-(k-1)/gamma).

    logits [N, A, B-1, V]; ids [N, T]; lengths [N]; anchors, valid [N, A]. Labels past a
    row's end carry no weight.
    """
    n, a, bm1, v = logits.shape
    k = torch.arange(1, bm1 + 1, device=ids.device)
    pos = anchors[:, :, None] + k  # [N, A, B-1]
    inside = (pos < lengths[:, None, None]) & valid[:, :, None]
    labels = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).view(n, -1)).view(n, a, bm1)
    weight = torch.exp(-(k.float() - 1) / gamma) * inside  # [N, A, B-1]
    ce = F.cross_entropy(logits.reshape(-1, v).float(), labels.reshape(-1), reduction="none")
    return (ce * weight.reshape(-1)).sum() / weight.sum().clamp(min=1e-6)


def lr_at(step: int, total: int, peak: float, warmup_frac: float = 0.04) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine to zero."""
    warm = max(1, round(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * 0.5 * (1 + math.cos(math.pi * progress))
