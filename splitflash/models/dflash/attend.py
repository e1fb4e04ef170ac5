"""The drafter's attention over its context caches, as the `attend(layer index, policy, q, k,
v)` callables `DFlashDrafter.forward_block` takes: pooled (one kernel call per layer for the
whole batch, what the draft graphs capture) or per request (any backend, custom ones too)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitflash.models.dflash.cache import TORCH_ATTENTION, TRITON_ATTENTION, DFlashState

# (layer index, LayerPolicy, q [N, T, H, hd], k / v [N, T, H_KV, hd]) -> [N, T, H, hd]
Attend = Callable[..., torch.Tensor]


def pooled_attend(drafter, pool, slots: torch.Tensor, n_ctx: torch.Tensor,
                  bound: int) -> Attend | None:  # fmt: skip
    """Attention over a DraftKVPool. slots, n_ctx: [N] int32 on the weights' device; bound >=
    every n_ctx (sizes the kernel's split plan without a device->host sync). None when the
    backend is a custom one, which only the per-request path can call."""
    from splitflash.kernels.draft_attention_ref import draft_attention_ref

    backend = drafter.backend
    if backend is TRITON_ATTENTION:
        from splitflash.kernels.draft_attention import draft_attention_triton as kernel
    elif backend is TORCH_ATTENTION:
        kernel = draft_attention_ref
    else:
        return None
    scale, causal = drafter.config.head_dim**-0.5, drafter.config.is_causal
    extra = {} if kernel is draft_attention_ref else {"max_ctx_len": bound}

    def attend(li, pol, q, k, v):
        return kernel(q, k, v, pool.k[li], pool.v[li], n_ctx, pol.window, scale,
                      causal=causal, cache_slots=slots, **extra)  # fmt: skip

    return attend


def per_request_attend(drafter, states: Sequence[DFlashState],
                       reads: list[list[int]]) -> Attend:  # fmt: skip
    """Attention request by request over each state's own cache with the drafter's backend;
    records the keys each reads per layer in reads[request][layer]."""
    per_request = drafter.backend.fn
    causal = drafter.config.is_causal

    def attend(li, pol, q, k, v):
        outs = []
        for r, state in enumerate(states):
            kv = state.layers[li]
            o, reads[r][li] = per_request(
                q[r], kv.k, kv.v, state.n_ctx, pol.window, k[r], v[r], causal
            )
            outs.append(o)  # [T, H, hd]
        return torch.stack(outs)

    return attend
