"""Draft KV cache: per-layer context K/V, written once per committed token.

Layout (per request, per draft layer): K and V tensors `[cap, H_KV, hd]`.
- Sliding layer (window W): a RING BUFFER, slot = pos % W. Capacity grows lazily by doubling
  up to W and never beyond, so memory is bounded by W rows at any context length. Growth
  only happens before the first wrap (context <= W), where slot == pos, so copying the old
  rows into the bigger buffer keeps every slot right. A drafting call reads only the rows a
  block query can see (positions > n_ctx - W): at most W - 1 rows.
- Full layer: every context row, slot == pos; capacity grows by doubling (amortised O(1)
  appends, one contiguous buffer a kernel can stream).
This is the layout the Triton kernel in `splitflash/kernels/draft_attention*.py` expects
(`[W_cap, H_KV, D]`, slot = p % W_cap: the same slots, since a ring smaller than W has not
wrapped yet), with `block_attention`'s semantics: TRITON_ATTENTION runs it per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from splitflash.kernels.draft_attention_ref import draft_visibility

logger = logging.getLogger("splitflash.dflash")

_MIN_CAP = 16


class DFlashDesyncError(ValueError):
    """Drafter context and the target's committed tokens are out of step."""


class LayerKV:
    """Context K/V of one draft layer for one request (see module docstring)."""

    def __init__(
        self,
        window: int | None,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.window = window  # None: full layer
        self.k = torch.empty(0, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.pool_slot: int | None = None  # rows live in a DraftKVPool slot (see pool.py)

    def attach_pool(self, k_rows: torch.Tensor, v_rows: torch.Tensor, slot: int) -> None:
        """Hold the rows in a pool slot's fixed [cap, H_KV, hd] views (before any write)."""
        if self.capacity:
            raise ValueError("attach_pool needs an empty LayerKV")
        self.k, self.v, self.pool_slot = k_rows, v_rows, slot

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def _reserve(self, n_total: int) -> None:
        want = n_total if self.window is None else min(n_total, self.window)
        cap = self.capacity
        if want <= cap:
            return
        new_cap = max(want, 2 * cap, _MIN_CAP)
        if self.window is not None:
            new_cap = min(new_cap, self.window)  # the ring never outgrows its window
        # A pooled full layer whose context outgrows the pool's rows moves to its own
        # buffer (its slot stays reserved until release); such a request drafts eagerly.
        self.pool_slot = None
        k = self.k.new_empty(new_cap, *self.k.shape[1:])
        v = self.v.new_empty(new_cap, *self.v.shape[1:])
        k[:cap], v[:cap] = self.k, self.v
        self.k, self.v = k, v

    def write(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        """Store rows for positions start_pos .. start_pos + n - 1. k, v: [n, H_KV, hd]."""
        n = k.shape[0]
        end = start_pos + n
        self._reserve(end)
        if self.window is None:
            self.k[start_pos:end], self.v[start_pos:end] = k, v
            return
        w = self.window
        if n > w:  # earlier rows of this append would be overwritten within it anyway
            k, v, start_pos = k[n - w :], v[n - w :], end - w
        slots = torch.arange(start_pos, end, device=k.device) % w
        self.k.index_copy_(0, slots, k)
        self.v.index_copy_(0, slots, v)


@dataclass
class DFlashState:
    """Per-request drafter state: the context K/V of every layer and counters."""

    layers: list[LayerKV]
    layer_kinds: list[str]  # "sliding" | "full" | "full_override" (see policy.py)
    fingerprint: tuple  # the drafter policy this state was made for
    n_ctx: int = 0  # committed context tokens held (next append must start here)
    pool_slot: int | None = None  # DraftKVPool slot reserved for this state, if any
    # Context keys each layer read in the last draft call: proof that reads are bounded.
    keys_read_last: list[int] = field(default_factory=list)

    def keys_read_by_kind(self) -> dict[str, int]:
        """Largest per-layer context read of the last draft call, by layer kind."""
        out: dict[str, int] = {}
        for kind, n in zip(self.layer_kinds, self.keys_read_last, strict=True):
            out[kind] = max(out.get(kind, 0), n)
        return out

    def pooled_slot(self) -> int | None:
        """The pool slot when every layer's rows are in it (graphable), else None."""
        if self.pool_slot is None or any(kv.pool_slot is None for kv in self.layers):
            return None
        return self.pool_slot

    def cache_rows(self) -> list[int]:
        """Allocated context rows per layer (memory: bounded by W for sliding layers)."""
        return [layer.capacity for layer in self.layers]


def _context_rows(ctx_k: torch.Tensor, ctx_v: torch.Tensor, n_ctx: int, window: int | None):
    """The context rows any block query may see, oldest first: [n_read, H_KV, hd] each."""
    if window is None:
        return ctx_k[:n_ctx], ctx_v[:n_ctx]
    slots = torch.arange(max(0, n_ctx - (window - 1)), n_ctx, device=ctx_k.device) % window
    # index_select touches only these <= W - 1 rows: the read is bounded before any QK.
    return ctx_k.index_select(0, slots), ctx_v.index_select(0, slots)


def block_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    n_ctx: int,
    window: int | None,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, int]:
    """Attention of one request's block over [context | block] K/V.

    q [T, H, hd] at positions n_ctx .. n_ctx + T - 1 (the anchor sits at n_ctx);
    ctx_k, ctx_v [cap, H_KV, hd] in the cache layout (ring of W slots when window is set);
    blk_k, blk_v [T, H_KV, hd]. A key at position p is visible to a query at position s iff
    s - p < W (window), p <= s (causal), and for non-causal windowed layers p - s < W too.
    Returns (out [T, H, hd], number of context rows read).
    """
    t, h, hd = q.shape
    ck, cv = _context_rows(ctx_k, ctx_v, n_ctx, window)
    k = torch.cat([ck, blk_k]).transpose(0, 1)  # [H_KV, S, hd]
    v = torch.cat([cv, blk_v]).transpose(0, 1)
    group = h // k.shape[0]
    if group > 1:  # GQA: each KV head serves `group` query heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    # [T, S]: the context rows read are the newest ck.shape[0] positions before n_ctx.
    visible = draft_visibility(n_ctx, ck.shape[0], t, window, causal, q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible)
    return out.transpose(0, 1), int(ck.shape[0])


AttentionFn = Callable[..., tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class AttentionBackend:
    """An implementation of `block_attention`'s contract.

    bounds_window_reads: True only if the backend reads no more than W context rows for a
    windowed layer (the window applied before loading K, not as a mask after QK). A sliding
    layer is refused on a backend that cannot promise this.
    """

    name: str
    fn: AttentionFn
    bounds_window_reads: bool


TORCH_ATTENTION = AttentionBackend("torch", block_attention, bounds_window_reads=True)


def triton_block_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    n_ctx: int,
    window: int | None,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    causal: bool,
    *,
    keys_read: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """`block_attention`'s contract on the drafter kernel (`kernels.dispatch.draft_attention`:
    Triton on CUDA or with SPLITFLASH_FORCE_TRITON=1, else its torch reference).

    The request's cache goes in as a batch of one ([1, cap, H_KV, hd] views, no copy). Every
    size travels as a host int (max_ctx_len) and the rows read are counted on the host, so
    no device->host sync happens. keys_read: optional [1] int32 device counter the kernel
    adds the context keys it actually loads to (tests).
    """
    from splitflash.kernels.dispatch import draft_attention

    n_read = n_ctx if window is None else min(n_ctx, window - 1)
    if n_read > ctx_k.shape[0]:
        raise ValueError(f"cache holds {ctx_k.shape[0]} rows, the layer reads {n_read}")
    lens = torch.full((1,), n_ctx, dtype=torch.int32, device=q.device)  # a fill, no H2D copy
    out = draft_attention(
        q[None], blk_k[None], blk_v[None], ctx_k[None], ctx_v[None], lens, window,
        q.shape[-1] ** -0.5, causal=causal, cache_slots=_slot_zero(q.device),
        max_ctx_len=n_ctx, keys_read=keys_read,
    )  # fmt: skip
    return out[0], n_read


@cache
def _slot_zero(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


TRITON_ATTENTION = AttentionBackend("triton", triton_block_attention, bounds_window_reads=True)


@cache
def _announce(backend: str, reason: str) -> None:
    logger.info("DFlash drafter attention backend: %s (%s)", backend, reason)


def auto_attention_backend(device: torch.device | str) -> AttentionBackend:
    """TRITON_ATTENTION for weights on CUDA, TORCH_ATTENTION elsewhere (logged once)."""
    device = torch.device(device)
    backend = TRITON_ATTENTION if device.type == "cuda" else TORCH_ATTENTION
    _announce(backend.name, f"auto: drafter weights on {device.type}")
    return backend
