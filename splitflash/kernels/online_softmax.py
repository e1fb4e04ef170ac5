"""Online-softmax step shared by the attention kernels (base-2 exponentials, fp32 state)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE: tl.constexpr):
    """Fold one K/V tile into the running softmax state.

    q [M, D], k/v [N, D], visible: bool broadcastable to [M, N], m_i/l_i [M] fp32 (running
    max in log2 units and denominator), acc [M, D] fp32. qk_scale = softmax scale * log2(e).
    DOT_IEEE: the operands are fp32 and must not be rounded to tf32 (the GPU default).
    m_i must start finite (e.g. -1e30), so a fully hidden tile gives p = 0, never nan.
    """
    if DOT_IEEE:  # noqa: SIM108 - constexpr branch, one side is compiled
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))  # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if DOT_IEEE:  # noqa: SIM108
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv
