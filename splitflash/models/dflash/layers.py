"""Qwen3-style building blocks of the drafter (module names match the public checkpoint)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitflash.kernels.head_norm_rope import rotate_half_rope_ref as apply_rope
from splitflash.models.dflash.config import DFlashConfig
from splitflash.models.rope import rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Qwen3 does) so bf16 drafting matches the trained numerics.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None,  # [hd/2] fp32, if the caller keeps it
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, hd] for absolute positions (computed in fp32)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Projections of one draft layer; the attention itself is `block_attention`."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., n, D] -> q [..., n, H, hd] (q_norm, then RoPE)."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)))
        return apply_rope(q, cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., n, D] -> k, v [..., n, H_KV, hd] (k_norm + RoPE on k only).

        Used for both the block tokens and the context features: DFlash injects the
        context through this layer's own W_K / W_V (KV injection).
        """
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
