"""Online-softmax steps shared by the attention kernels (base-2 exponentials, fp32 state).

attend_tile folds a tile some of whose keys are hidden (ranges' tails, ancestor masks);
attend_tile_full folds a tile whose keys are all visible, with no mask work at all. Both:
q [M, D], k/v [N, D], m_i/l_i [M] fp32 (running max in log2 units and denominator),
acc [M, D] fp32, qk_scale = softmax scale * log2(e). DOT_IEEE: the operands are fp32 and
must not be rounded to tf32 (the GPU default). m_i must start finite (e.g. -1e30), so a
fully hidden tile gives p = 0, never nan.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_nt(a, b, DOT_IEEE: tl.constexpr):
    """a [M, K] @ b[N, K].T -> [M, N] fp32; DOT_IEEE: fp32 operands without tf32 rounding.
    Attention's raw scores q k^T (not yet scaled: the scale rides on the exp2's FMA), and the
    fused linears' products x W^T."""
    if DOT_IEEE:  # noqa: SIM108 - constexpr branch, one side is compiled
        s = tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        s = tl.dot(a, tl.trans(b))
    return s


@triton.jit
def _fold(s, v, m_i, l_i, acc, qk_scale, DOT_IEEE: tl.constexpr):
    """s [M, N] raw scores, -inf where hidden. qk_scale > 0, so max(s) * c == max(s * c)
    and s * c - m is one FMA per score (no separate scaling pass over [M, N])."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])  # -inf (hidden) -> 0
    l_new = l_i * alpha + tl.sum(p, axis=1)
    # Accumulate into the rescaled acc inside the dot: no second [M, D] fp32 temporary (64
    # registers/thread for a 64 x 128 tile at 4 warps), the MMA adds in place.
    acc = acc * alpha[:, None]
    if DOT_IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_new, acc


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE: tl.constexpr):
    """Fold one K/V tile; visible: bool broadcastable to [M, N]."""
    s = tl.where(visible, dot_nt(q, k, DOT_IEEE), float("-inf"))  # [M, N]
    return _fold(s, v, m_i, l_i, acc, qk_scale, DOT_IEEE)


@triton.jit
def attend_tile_full(q, k, v, m_i, l_i, acc, qk_scale, DOT_IEEE: tl.constexpr):
    """Fold one K/V tile whose keys are all visible to all rows (full prefix tiles)."""
    return _fold(dot_nt(q, k, DOT_IEEE), v, m_i, l_i, acc, qk_scale, DOT_IEEE)
