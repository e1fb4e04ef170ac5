"""The DFlash drafter: one non-causal forward pass fills a block [anchor, MASK x (B-1)].

Shapes: N requests, T block length, K target feature layers, D hidden, H / H_KV heads,
hd head dim, V vocab. Context features of committed tokens enter the draft KV cache once
(`append_context`); each `draft` reads that cache, never recomputes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from splitflash.kernels.fused_dispatch import rms_norm
from splitflash.models.dflash import fused
from splitflash.models.dflash.attend import per_request_attend, pooled_attend
from splitflash.models.dflash.cache import (
    TORCH_ATTENTION,
    TRITON_ATTENTION,
    AttentionBackend,
    DFlashState,
    LayerKV,
    auto_attention_backend,
)
from splitflash.models.dflash.checks import check_appends, check_batch
from splitflash.models.dflash.config import DFlashConfig
from splitflash.models.dflash.layers import DFlashDecoderLayer, RMSNorm, rope_cos_sin
from splitflash.models.dflash.policy import (
    LayerPolicy,
    WindowOverride,
    build_policy,
    policy_info,
    policy_string,
)
from splitflash.models.rope import RopeFrequencies


class _Shared:
    """Target modules the drafter uses but does not own (kept out of state_dict / .to())."""

    def __init__(self, embed_tokens: nn.Embedding, lm_head_weight: torch.Tensor) -> None:
        self.embed_tokens = embed_tokens
        self.lm_head_weight = lm_head_weight  # [V, D]


class DFlashDrafter(nn.Module):
    def __init__(
        self,
        config: DFlashConfig,
        embed_tokens: nn.Embedding,
        lm_head_weight: torch.Tensor,
        *,
        window_override: WindowOverride = "checkpoint",
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        """attention_backend None: chosen from the weights' device at draft time (see
        `backend`), so a drafter built on meta / CPU and moved to CUDA still gets Triton."""
        super().__init__()
        self.config = config
        self.window_override = window_override
        self._explicit_backend = attention_backend
        # Both automatic candidates bound window reads, so either one validates the policy.
        assert TORCH_ATTENTION.bounds_window_reads and TRITON_ATTENTION.bounds_window_reads
        checked = TORCH_ATTENTION if attention_backend is None else attention_backend
        self.policy: list[LayerPolicy] = build_policy(config, window_override, checked)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        d = config.hidden_size
        self.fc = nn.Linear(config.feature_dim, d, bias=False)  # [D, K*D]
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self._rope_freqs = RopeFrequencies(config.head_dim, config.rope_theta)
        self.attach_shared(embed_tokens, lm_head_weight)

    def attach_shared(self, embed_tokens: nn.Embedding, lm_head_weight: torch.Tensor) -> None:
        """Use the target's embedding [V, D] and LM head weight [V, D] (shared, frozen)."""
        v, d = self.config.vocab_size, self.config.hidden_size
        if not isinstance(embed_tokens, nn.Embedding) or tuple(embed_tokens.weight.shape) != (v, d):
            raise ValueError(
                f"embed_tokens must be the target's nn.Embedding of shape [{v}, {d}], got "
                f"{getattr(getattr(embed_tokens, 'weight', None), 'shape', embed_tokens)}"
            )
        if not torch.is_tensor(lm_head_weight) or tuple(lm_head_weight.shape) != (v, d):
            raise ValueError(f"lm_head_weight must be a [{v}, {d}] tensor (the target's head)")
        # Frozen and shared: no gradients, no copies, not part of this module's state_dict.
        embed_tokens.weight.requires_grad_(False)
        self._shared = _Shared(embed_tokens, lm_head_weight.detach())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's LM head [V, D] the drafter's logits come from."""
        return self._shared.lm_head_weight

    @property
    def shared_devices(self) -> tuple[torch.device, torch.device]:
        """(embedding, LM head) devices of the target modules the drafter shares."""
        return self._shared.embed_tokens.weight.device, self._shared.lm_head_weight.device

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend in force: the one passed in, else Triton when the weights are
        on CUDA and torch `block_attention` otherwise (the choice is logged once)."""
        if self._explicit_backend is not None:
            return self._explicit_backend
        return auto_attention_backend(self.fc.weight.device)

    # ---- policy --------------------------------------------------------------------------
    def policy_summary(self) -> list[LayerPolicy]:
        return list(self.policy)

    def policy_string(self) -> str:
        return policy_string(self.config, self.policy, self.window_override)

    def policy_info(self) -> dict[str, str]:
        return policy_info(self.config, self.policy, self.window_override, self.backend)

    def fingerprint(self) -> tuple:
        """What a state records of the drafter and policy that made it (checks.check_states)."""
        return (id(self), tuple(self.policy))

    # ---- state ---------------------------------------------------------------------------
    def new_state(self) -> DFlashState:
        w = self.fc.weight
        cfg = self.config
        layers = [
            LayerKV(p.window, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device)
            for p in self.policy
        ]
        return DFlashState(
            layers=layers,
            layer_kinds=[p.kind for p in self.policy],
            fingerprint=self.fingerprint(),
            keys_read_last=[0] * len(self.policy),
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.fc.weight.dtype,
                            self._rope_freqs.on(positions.device))  # fmt: skip

    def append_context(self, state: DFlashState, features: torch.Tensor, start_pos: int) -> None:
        """Commit target features [n, K*D] of the tokens at start_pos .. start_pos + n - 1.

        Called once per committed token: fc -> hidden_norm -> each layer's W_K / W_V
        (+ k_norm, RoPE at the absolute position) into that layer's cache.
        """
        self.append_contexts([(state, features, start_pos)])

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context rows features [n, K*D] at positions [n] (both on the weights' device) ->
        each layer's (k, v) [n, H_KV, hd]: fc -> hidden_norm -> the layer's W_K / W_V (+ k_norm,
        RoPE at the absolute position). No host sync: the draft graphs capture it."""
        w = self.fc.weight
        cos, sin = self._rope(positions)  # [n, hd]
        if fused.fused_path(w):
            return fused.context_kv(self, features, cos, sin)
        ctx = self.hidden_norm(self.fc(features.to(dtype=w.dtype)))  # [n, D]
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def append_contexts(self, items: Sequence[tuple[DFlashState, torch.Tensor, int]]) -> None:
        """append_context for several (state, features [n_i, K*D], start_pos) at once: fc,
        hidden_norm, RoPE and each layer's K/V projection run once over all their rows
        (~10 kernels per layer instead of per request), only the cache writes per item. A
        state may appear more than once, its items in position order. Every item is checked
        before any is written."""
        check_appends(self, items)
        items = [item for item in items if item[1].shape[0] > 0]
        if not items:
            return
        w = self.fc.weight
        feats = joined_rows([f for _, f, _ in items], w.device)
        positions = torch.cat([torch.arange(s, s + f.shape[0]) for _, f, s in items])
        for li, (k, v) in enumerate(self.context_kv(feats, positions.to(w.device))):
            lo = 0
            for state, f, start_pos in items:
                n = f.shape[0]
                state.layers[li].write(k[lo : lo + n], v[lo : lo + n], start_pos)
                lo += n
        for state, f, _ in items:
            state.n_ctx += f.shape[0]

    @torch.no_grad()
    def draft(
        self,
        state: DFlashState,
        anchor_token_id: int,
        anchor_pos: int,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Logits [block_size - 1, V] for block positions 1 .. B-1."""
        return self.draft_batch([state], [anchor_token_id], [anchor_pos], block_size)[0]

    def block_inputs(
        self, anchor_token_ids: Sequence[int], anchor_positions: Sequence[int], t: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [N, T] long on the host: [anchor, MASK x (T-1)] at anchor_pos + i."""
        ids = torch.full((len(anchor_token_ids), t), self.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([int(a) for a in anchor_token_ids], dtype=torch.long)
        pos = torch.tensor([int(p) for p in anchor_positions])[:, None] + torch.arange(t)
        return ids, pos

    @property
    def poolable(self) -> bool:
        """Whether pooled attention can run (the built-in backends; custom ones cannot)."""
        return self.backend in (TORCH_ATTENTION, TRITON_ATTENTION)

    def pooled_attention(self, pool, slots: torch.Tensor, n_ctx: torch.Tensor, bound: int):
        """attend(layer, policy, q, k, v) over a DraftKVPool (attend.pooled_attend)."""
        return pooled_attend(self, pool, slots, n_ctx, bound)

    def forward_block(
        self, ids: torch.Tensor, pos: torch.Tensor, attend, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [N, T-1, V] of blocks ids [N, T] at positions pos [N, T] (both on the
        weights' device), written into `out` if given; attend(layer index, policy, q, k, v)
        -> [N, T, H, hd]. No host sync inside: a CUDA graph captures this whole call
        (graphs.py)."""
        cfg = self.config
        w = self.fc.weight
        emb = self._shared.embed_tokens(ids.to(self._shared.embed_tokens.weight.device))
        h = emb.to(device=w.device, dtype=w.dtype) * cfg.input_embedding_scale  # [N, T, D]
        cos, sin = self._rope(pos)  # [N, T, hd]
        if fused.fused_path(w):  # the layers on [N * T, D] rows through the fused kernels
            n = h.shape[0]
            rows, cos, sin = (t.flatten(0, 1) for t in (h, cos, sin))
            for li, (layer, pol) in enumerate(zip(self.layers, self.policy, strict=True)):
                rows = fused.block_layer(layer, rows, cos, sin,
                                         partial(attend, li, pol), n)  # fmt: skip
            h = rms_norm(rows.unflatten(0, (n, -1))[:, 1:], self.norm.weight, self.norm.eps)
        else:
            for li, (layer, pol) in enumerate(zip(self.layers, self.policy, strict=True)):
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                q = attn.project_q(x, cos, sin)  # [N, T, H, hd]
                k, v = attn.project_kv(x, cos, sin)  # [N, T, H_KV, hd]
                h = h + attn.o_proj(attend(li, pol, q, k, v).flatten(-2))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            h = self.norm(h[:, 1:])  # the anchor's own position needs no logits
        head = self._shared.lm_head_weight
        return torch.matmul(h.to(device=head.device, dtype=head.dtype), head.T, out=out)

    @torch.no_grad()
    def draft_batch(
        self,
        states: Sequence[DFlashState],
        anchor_token_ids: Sequence[int],
        anchor_positions: Sequence[int],
        block_size: int | None = None,
        pool=None,
    ) -> torch.Tensor:
        """One forward pass for N requests -> logits [N, block_size - 1, V]. With a
        DraftKVPool holding every state, attention is one call per layer for all of them;
        otherwise one per request per layer."""
        t = check_batch(self, states, anchor_token_ids, anchor_positions, block_size)
        dev = self.fc.weight.device
        ids, pos = (x.to(dev) for x in self.block_inputs(anchor_token_ids, anchor_positions, t))
        slots = None if pool is None else pool.slots_of(states)
        attend = None
        if slots is not None:
            n_ctx = [s.n_ctx for s in states]
            attend = self.pooled_attention(
                pool, torch.tensor(slots, dtype=torch.int32, device=dev),
                torch.tensor(n_ctx, dtype=torch.int32, device=dev), max(n_ctx),
            )  # fmt: skip
            reads = [pool.keys_read(n) for n in n_ctx]
        if attend is None:
            reads = [[0] * len(self.layers) for _ in states]
            attend = per_request_attend(self, states, reads)
        logits = self.forward_block(ids, pos, attend)
        for state, r in zip(states, reads, strict=True):
            state.keys_read_last = r
        return logits


def joined_rows(feats: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Feature rows [sum n_i, K*D] on `device`, joined where they are (one host->device copy
    when they came as frames); moved one by one only when they sit on different devices."""
    if len({f.device for f in feats}) > 1:
        feats = [f.to(device) for f in feats]
    return torch.cat(list(feats)).to(device)
