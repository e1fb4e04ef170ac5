"""The target model: Llama / Qwen3 decoder in the gpt-fast style over a paged KV cache.

One forward runs a batch of requests of different lengths, their new tokens flattened into
one [N] row so every linear layer is one GEMM; attention goes through the paged backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitflash.kernels.fused_dispatch import (
    linear_residual,
    norm_linear,
    rms_norm,
    silu_mul,
)
from splitflash.kernels.paged_attention_ref import RopeWrite
from splitflash.models.attention import MAX_TREE_Q, AttentionMeta, PagedAttention
from splitflash.models.config import TargetConfig
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.rope import RopeFrequencies, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as HF does) so low-precision runs keep the same statistics.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None,  # rope_inv_freq's, if the caller keeps it
):
    """positions [N] -> cos, sin [N, 1, head_dim] (HF rotate-half layout)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, cache: PagedKVCache, slots, meta, backend):
        # x [N, D] -> [N, D]
        o = self.attend(self.qkv_proj(x), cos, sin, layer, cache, slots, meta, backend)
        return self.o_proj(o)

    def attend(self, qkv, cos, sin, layer: int, cache: PagedKVCache, slots, meta, backend):
        """qkv [N, q_dim + 2 kv_dim] (the projection's output) -> attention output [N, q_dim]
        (before o_proj); writes this block's K/V into the cache."""
        n = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(n, self.cfg.num_heads, self.cfg.head_dim)
        k = k.view(n, self.cfg.num_kv_heads, self.cfg.head_dim)
        v = v.view(n, self.cfg.num_kv_heads, self.cfg.head_dim)
        if self.cfg.qk_norm and getattr(backend, "batch_invariant", False):  # see TargetModel
            eps = self.cfg.rms_norm_eps
            q, k = rms_norm(q, self.q_norm.weight, eps), rms_norm(k, self.k_norm.weight, eps)
        elif self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE on q and k with the K/V write into the pages: inside the attention kernel on
        # the Triton fast path, else one kernel before it (on CPU the reference, bit-equal
        # to apply_rope + cache.write).
        rope = RopeWrite(k, v, cos, sin, slots)
        o = backend(q, cache.k[layer], cache.v[layer], meta, self.cfg.head_dim**-0.5, rope)
        return o.reshape(n, -1)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.hidden = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up in one kernel on CUDA; on CPU the reference, the same two torch ops.
        return self.down_proj(silu_mul(self.gate_up_proj(x), self.hidden))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


@dataclass
class ForwardBatch:
    """What one forward needs besides the weights (N new tokens of B requests)."""

    token_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long, flat KV slot of each new token
    meta: AttentionMeta


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V] fp32, rows chosen by logits_rows
    hidden: torch.Tensor | None  # [N, len(layer_ids) * D] or None


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._backend: PagedAttention | None = None
        # Batch-invariant steps: a row's logits are the same bits whatever the step it is in
        # (a one-token decode step or a verify block, alone or batched), so greedy
        # speculative output equals target-only output in bf16 too, not only up to rounding
        # ties. Every kernel of a paged step then fixes its reduction order by the row alone:
        # the fused linears at any M (cuBLAS picks kernels by M), the final norm inside the
        # LM head's kernel, attention cut at absolute key positions
        # (kernels/paged_attention_invariant.py). Prefill (blocks > MAX_TREE_Q) is unchanged:
        # a prompt runs once, the same way in either decoding.
        self.batch_invariant = False
        self._backend_key: tuple | None = None
        self._rope_freqs = RopeFrequencies(cfg.head_dim, cfg.rope_theta)

    @property
    def backend(self) -> PagedAttention:
        key = (self.embed_tokens.weight.device, self.batch_invariant)
        if self._backend is None or self._backend_key != key:
            self._backend = PagedAttention(key[0], batch_invariant=key[1])
            self._backend_key = key
        return self._backend

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up as this model stores them."""
        own: dict[str, torch.Tensor] = {}
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            own[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [state.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            )
            own[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")]
            )
        own.update(state)
        if self.cfg.tie_word_embeddings:
            own.pop("lm_head.weight", None)
            own["lm_head.weight"] = own["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not m.startswith("_")]
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")

    def forward(
        self,
        batch: ForwardBatch,
        cache: PagedKVCache,
        logits_rows: torch.Tensor | None = None,
        hidden_layer_ids: tuple[int, ...] = (),
        out: ForwardOutput | None = None,
    ) -> ForwardOutput:
        """hidden_layer_ids: layer i means the output of decoder layer i (0-based). out: write
        the logits (and the features, if any) into these tensors of the right shapes instead
        of new ones (CUDA graphs of one row count share them: models/graphs.py)."""
        x = self.embed_tokens(batch.token_ids)  # [N, D]
        cos, sin = rope_cos_sin(batch.positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype,
                                self._rope_freqs.on(x.device))  # fmt: skip
        captured: dict[int, torch.Tensor] = {}
        eps = self.cfg.rms_norm_eps
        inv = self.batch_invariant and max(batch.meta.q_lens) <= MAX_TREE_Q  # a paged step
        # Four kernels per layer besides attention on CUDA for a verify block (few rows): each
        # RMSNorm rides in the linear after it, SwiGLU in gate_up's, each residual add in the
        # epilogue of the projection feeding it (kernels/fused_linear.py). Same op sequence,
        # so the same roundings, as x = x + f(norm(x)); on CPU exactly those torch ops.
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = norm_linear(x, layer.input_layernorm.weight, eps, attn.qkv_proj.weight,
                              any_rows=inv)  # fmt: skip
            o = attn.attend(qkv, cos, sin, i, cache, batch.slots, batch.meta, self.backend)
            x = _add_projection(attn.o_proj, o, x, inv)
            act = norm_linear(x, layer.post_attention_layernorm.weight, eps,
                              mlp.gate_up_proj.weight, swiglu_hidden=mlp.hidden,
                              any_rows=inv)  # fmt: skip
            x = _add_projection(mlp.down_proj, act, x, inv)
            if i in hidden_layer_ids:
                captured[i] = x
        rows = x if logits_rows is None else x[logits_rows]
        if inv:  # the norm's row reduction and the LM head's K loop fixed per row
            logits = norm_linear(rows, self.norm.weight, eps, self.lm_head.weight, any_rows=True)
        else:  # one norm kernel on CUDA, not the module's eight elementwise launches
            logits = self.lm_head(rms_norm(rows, self.norm.weight, eps))
        features = [captured[i] for i in hidden_layer_ids] if captured else []
        if out is None:
            hidden = torch.cat(features, -1) if features else None
            return ForwardOutput(logits=logits.float(), hidden=hidden)
        out.logits.copy_(logits)  # the same rounding as .float()
        if features:
            torch.cat(features, -1, out=out.hidden)
        return out


def _add_projection(
    proj: nn.Module, a: torch.Tensor, x: torch.Tensor, any_rows: bool = False
) -> torch.Tensor:
    """x + proj(a); the add fused into the GEMM when proj is a plain bias-free Linear (tensor
    parallelism swaps in a row-parallel module whose all-reduce must run first)."""
    if type(proj) is nn.Linear and proj.bias is None:
        return linear_residual(a, proj.weight, x, any_rows)
    return x + proj(a)


def build_target(cfg: TargetConfig, state: dict, dtype=torch.float32, device="cpu"):
    model = TargetModel(cfg)
    model.load_hf_state(dict(state))
    return model.to(device=device, dtype=dtype).eval()
