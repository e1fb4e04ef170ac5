"""The target without a paged cache, for training: full-sequence features and batched greedy
generation over a dense KV cache. It reuses the target's own modules (weights, norms, RoPE)
and writes out only the attention, so the serving model stays untouched.

Shapes: B rows, T tokens, D hidden, H / H_KV heads, hd head dim, L layers, K feature layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitflash.models.target import TargetModel, apply_rope, rope_cos_sin


def _qkv(model: TargetModel, layer, x: torch.Tensor, positions: torch.Tensor):
    """x [B, T, D], positions [B, T] -> q [B, H, T, hd], k, v [B, H_KV, T, hd]."""
    cfg = model.cfg
    b, t, _ = x.shape
    attn = layer.self_attn
    q, k, v = attn.qkv_proj(x).split(attn.split, dim=-1)
    q = q.view(b, t, cfg.num_heads, cfg.head_dim)
    k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope_cos_sin(positions.reshape(-1), cfg.head_dim, cfg.rope_theta, x.dtype)
    cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _attend(model: TargetModel, q, k, v, mask) -> torch.Tensor:
    """q [B, H, T, hd] over k, v [B, H_KV, S, hd]; mask [B, 1, T, S] bool or None (causal)."""
    group = model.cfg.num_heads // model.cfg.num_kv_heads
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o.transpose(1, 2).flatten(2)  # [B, T, H * hd]


@torch.no_grad()
def target_features(
    model: TargetModel, ids: torch.Tensor, layer_ids: tuple[int, ...]
) -> torch.Tensor:
    """Hidden features of right-padded rows: ids [B, T] -> [B, T, K * D].

    Layer id i = output of decoder layer i, as `TargetModel.forward(hidden_layer_ids=...)`.
    Causal attention, so padding after a row's end never changes its real positions; the
    layers after the deepest feature layer are skipped (their output is never used).
    """
    if not layer_ids:
        raise ValueError("target_features needs at least one layer id")
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    x = model.embed_tokens(ids)  # [B, T, D]
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers[: max(layer_ids) + 1]):
        q, k, v = _qkv(model, layer, layer.input_layernorm(x), positions)
        x = x + layer.self_attn.o_proj(_attend(model, q, k, v, None))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in layer_ids:
            captured[i] = x
    return torch.cat([captured[i] for i in layer_ids], -1)


def _step(model: TargetModel, ids, positions, kv, valid, start: int) -> torch.Tensor:
    """Run ids [B, t] at cache columns start .. start + t - 1; returns last logits [B, V]."""
    t = ids.shape[1]
    end = start + t
    # Query i (column start + i) sees valid keys up to its own column, and always itself:
    # a left-pad row that saw nothing would give NaN, and NaN times a zero weight stays NaN.
    cols = torch.arange(end, device=ids.device)
    qcol = torch.arange(start, end, device=ids.device)[:, None]
    mask = (cols[None, :] <= qcol) & valid[:, None, :end]  # [B, t, end]
    mask |= cols[None, None, :] == qcol[None]
    mask = mask[:, None]  # [B, 1, t, end]
    x = model.embed_tokens(ids)
    for li, layer in enumerate(model.layers):
        q, k, v = _qkv(model, layer, layer.input_layernorm(x), positions)
        kv[0][li][:, :, start:end], kv[1][li][:, :, start:end] = k, v
        o = _attend(model, q, kv[0][li][:, :, :end], kv[1][li][:, :, :end], mask)
        x = x + layer.self_attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x[:, -1])).float()


@torch.no_grad()
def generate_batch(
    model: TargetModel,
    prompts: list[list[int]],
    max_new: int,
    stop_ids,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Decode every prompt (left-padded into one batch); returns each response's ids,
    ending with its stop token when one came before max_new."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate_batch needs non-empty prompts")
    cfg, dev = model.cfg, model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    b, plen = len(prompts), max(len(p) for p in prompts)
    total = plen + max_new
    ids = torch.zeros(b, plen, dtype=torch.long, device=dev)
    valid = torch.zeros(b, total, dtype=torch.bool, device=dev)
    for r, p in enumerate(prompts):
        ids[r, plen - len(p) :] = torch.as_tensor(p, device=dev)
        valid[r, plen - len(p) :] = True
    valid[:, plen:] = True  # generated columns are real tokens in every row
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, total] per-row positions
    shape = (b, cfg.num_kv_heads, total, cfg.head_dim)
    kv = (
        [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.layers],
        [torch.zeros(shape, dtype=dtype, device=dev) for _ in model.layers],
    )
    stop = torch.as_tensor(sorted(set(stop_ids)) or [-1], device=dev)
    out = torch.zeros(b, max_new, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    logits = _step(model, ids, pos[:, :plen], kv, valid, 0)
    n = 0
    for n in range(max_new):
        if temperature > 0:
            probs = torch.softmax(logits / temperature, -1)
            tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            tok = logits.argmax(-1)
        out[:, n] = tok
        done |= torch.isin(tok, stop)
        if n + 1 == max_new or bool(done.all()):
            break
        col = plen + n
        logits = _step(model, tok[:, None], pos[:, col : col + 1], kv, valid, col)
    rows = out[:, : n + 1].tolist()
    stops = set(stop_ids)
    result = []
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        result.append(row[:cut])
    return result
