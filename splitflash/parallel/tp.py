"""Megatron-style tensor parallelism for a built TargetModel, applied in place.

Per decoder layer (t = world size, H / H_KV / I = heads, kv heads, MLP width):
- qkv_proj, column-parallel by HEADS: rank r keeps q heads [r*H/t, (r+1)*H/t) and kv heads
  [r*H_KV/t, (r+1)*H_KV/t). Contiguous head blocks keep GQA intact: local q head j belongs
  to local kv head j // (H/H_KV), exactly as global head r*H/t + j does globally.
- o_proj, row-parallel: the input columns of the local heads, then all_reduce(SUM).
- gate_up_proj, column-parallel on gate AND up (rows [gate | up]): the same I/t slice of
  both, so the local SiLU(gate) * up is a slice of the full one.
- down_proj, row-parallel + all_reduce(SUM).
After each all_reduce every rank holds the full residual stream, so norms, RoPE, the
embedding (replicated, whole table) and the captured hidden features need no communication.
The LM head is vocab-parallel (rows of the weight) with an all_gather, so every rank returns
the full [R, V] logits. Only the split of the GEMMs changes: outputs equal TP=1 up to the
fp32 summation order of the all_reduce (in bf16 each rank's partial sum is also rounded to
bf16 before the reduction, as in every Megatron-style TP).

KV cache: a rank stores only its kv heads. Each rank builds its PagedKVCache with
`local_kv_heads(cfg, world)` heads and the SAME num_pages / page_size / scratch_pages as
rank 0, so the slots and page tables rank 0 allocates are valid in every rank's cache
(see follower.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from splitflash.models.config import TargetConfig
from splitflash.models.target import Attention, TargetModel


def check_world(cfg: TargetConfig, world: int) -> None:
    """Refuse a TP size that does not split the heads and the MLP evenly."""
    if world < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world}")
    bad = [
        f"{name} {value}"
        for name, value in (
            ("num_heads", cfg.num_heads),
            ("num_kv_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
        )
        if value % world
    ]
    if bad:
        raise ValueError(
            f"tensor parallel size {world} must divide num_heads, num_kv_heads and "
            f"intermediate_size; not divisible: {', '.join(bad)}"
        )


def local_kv_heads(cfg: TargetConfig, world: int) -> int:
    """KV heads one rank stores: build each rank's PagedKVCache with this many heads."""
    check_world(cfg, world)
    return cfg.num_kv_heads // world


def _linear_from(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear owning a copy of `weight` [out, in] (no default init pass)."""
    out_f, in_f = weight.shape
    linear = nn.Linear(in_f, out_f, bias=False, device="meta")
    # clone(): the shard must own its storage, so the full tensor is freed once replaced.
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return linear


def _no_bias(linear: nn.Linear, name: str) -> None:
    # The target families here have none; a bias would need sharding (column) or adding
    # once after the reduction (row), which is not implemented rather than silently wrong.
    if linear.bias is not None:
        raise ValueError(f"{name} has a bias: tensor parallelism supports bias-free layers")


class RowParallelLinear(nn.Module):
    """Input-sharded linear: x [N, in/t] -> partial [N, out], summed over ranks in place."""

    def __init__(self, linear: nn.Linear, group=None) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight  # [out, in/t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [N, out] partial sum of this rank's input columns
        # c10d collectives are not autograd-aware: this layer is for inference only.
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y


class VocabParallelLMHead(nn.Module):
    """Rows [start, start + V_s) of the LM head; all_gather returns the full [R, V] logits.

    V_s = ceil(V / t); the last shard is padded with zero rows so every rank gathers
    the same shape (all_gather needs it), and the padding columns are cut after the gather.
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, world: int, group=None) -> None:
        super().__init__()
        self.weight = weight  # nn.Parameter [V_s, D]
        self.vocab_size = vocab_size  # V, the unpadded size
        self.world = world
        self.group = group

    @classmethod
    def from_full(
        cls, full: torch.Tensor, rank: int, world: int, group=None
    ) -> VocabParallelLMHead:
        vocab, dim = full.shape  # [V, D]
        per = -(-vocab // world)  # V_s
        start, stop = min(rank * per, vocab), min((rank + 1) * per, vocab)
        shard = full.new_zeros(per, dim)  # [V_s, D]
        shard[: stop - start] = full[start:stop].detach()
        # A fresh parameter: the tie to embed_tokens is broken, the embedding stays whole.
        param = nn.Parameter(shard, requires_grad=full.requires_grad)
        return cls(param, vocab, world, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [R, V_s]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # [R, V]


def _shard_attention(
    attn: Attention, local_cfg: TargetConfig, rank: int, world: int, group
) -> None:
    cfg, hd = attn.cfg, attn.cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
    q_loc, kv_loc = q_dim // world, kv_dim // world  # (H/t) * hd, (H_KV/t) * hd
    _no_bias(attn.qkv_proj, "qkv_proj")
    _no_bias(attn.o_proj, "o_proj")
    w = attn.qkv_proj.weight  # [(H + 2 H_KV) hd, D] rows [q | k | v]
    q_rows = slice(rank * q_loc, (rank + 1) * q_loc)
    k_rows = slice(q_dim + rank * kv_loc, q_dim + (rank + 1) * kv_loc)
    v_rows = slice(q_dim + kv_dim + rank * kv_loc, q_dim + kv_dim + (rank + 1) * kv_loc)
    attn.qkv_proj = _linear_from(torch.cat([w[q_rows], w[k_rows], w[v_rows]]))
    # o_proj [D, H hd]: the input columns of the local q heads, same order as q_rows.
    attn.o_proj = RowParallelLinear(_linear_from(attn.o_proj.weight[:, q_rows]), group)
    # Attention.forward views q/k/v through cfg and split: give it the local head counts.
    # head_dim (hence the softmax scale and RoPE) and the per-head_dim q/k norms are
    # unchanged, so q_norm / k_norm stay replicated.
    attn.cfg = local_cfg
    attn.split = (q_loc, kv_loc, kv_loc)


def _shard_mlp(mlp: nn.Module, rank: int, world: int, group) -> None:
    width = mlp.hidden  # I
    per = width // world
    _no_bias(mlp.gate_up_proj, "gate_up_proj")
    _no_bias(mlp.down_proj, "down_proj")
    w = mlp.gate_up_proj.weight  # [2 I, D] rows [gate | up]
    cols = slice(rank * per, (rank + 1) * per)
    up = slice(width + rank * per, width + (rank + 1) * per)
    mlp.gate_up_proj = _linear_from(torch.cat([w[cols], w[up]]))  # [2 I/t, D]
    mlp.down_proj = RowParallelLinear(_linear_from(mlp.down_proj.weight[:, cols]), group)
    mlp.hidden = per  # MLP.forward splits gate_up at this width


def _check_group(rank: int, world: int, group) -> None:
    # Without an initialised process group the transform still runs (the shards can be
    # inspected); the forward then needs one. With one, the numbers must agree with it.
    if not dist.is_available() or not dist.is_initialized():
        return
    got_world, got_rank = dist.get_world_size(group), dist.get_rank(group)
    if (got_world, got_rank) != (world, rank):
        raise ValueError(
            f"shard_target(rank={rank}, world={world}) but the process group has "
            f"rank {got_rank} of {got_world}"
        )


def shard_target(model: TargetModel, rank: int, world: int, group=None) -> TargetModel:
    """Replace `model`'s layers by rank `rank`'s shards of a `world`-way split, in place.

    model.cfg stays the global config (the engine reads vocab size, context and layer
    count from it); each Attention gets a local config with H/t and H_KV/t heads.
    """
    cfg = model.cfg
    check_world(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a tensor parallel group of {world}")
    _check_group(rank, world, group)
    if world == 1:
        return model  # nothing to split, and no collective to pay for
    local_cfg = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world
    )
    for layer in model.layers:
        _shard_attention(layer.self_attn, local_cfg, rank, world, group)
        _shard_mlp(layer.mlp, rank, world, group)
    _no_bias(model.lm_head, "lm_head")
    model.lm_head = VocabParallelLMHead.from_full(model.lm_head.weight, rank, world, group)
    model.tp_rank, model.tp_world = rank, world
    return model
