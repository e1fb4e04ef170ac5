"""A prefill chunk's attention as two fused calls merged by their log-sum-exp.

A chunk of c queries after p cached keys sees every cached key and, causally, its own c
keys: SDPA's bottom-right causal mask (`causal_lower_right`). On an H100 that mask runs in
the time FlashAttention-2 takes (torch's CausalBias sends it to flash), 1.65x the cuDNN
kernel torch picks for a square causal prompt (bench/RESULTS.md "Session 32": 142 against
86 ms a layer at 185k keys, the default model's heads), so a prompt prefilled in chunks took
1.76x the whole prompt's time. Split, each half is a shape the fast kernel takes: the chunk
against the cached keys (no mask) and against its own keys (square causal); their outputs
merge exactly through the two log-sum-exps.

Measured on an H100 (bench/RESULTS.md "Session 33"): one layer at 185k keys 94 ms split
against 142 masked (84 whole); a 185k prompt in chunks of 8192 3.40 s against 5.02 (2.76
whole). On the CPU (2 cores, fp32, the default model's heads) a chunk of 2048 after 8192
keys took 0.49-0.52 s split against 0.71-0.76 masked. SPLITFLASH_PREFILL_SPLIT_ATTENTION:
unset or 1 splits wherever the fused kernels take the shape (on CUDA: bf16 / fp16 heads of
<= 128 dims), 0 never (a whole prompt then goes to torch's pick too). If a fused call
raises, the process logs it once and uses SDPA as torch picks it from then on.

On CUDA each half goes to cuDNN or to FlashAttention-2. cuDNN's kernels run 1.4-1.8x
faster on chunks of 2048 tokens and more, but its first call of a new shape builds an
execution graph: 44-60 ms on an H100 (later calls of that shape reuse it), and a chunk's
cached-key count may be new every chunk (chunks sized to a time budget). FlashAttention has
no such cost. So cuDNN takes a chunk whose work (chunk x cached x heads x dim) is past
CUDNN_MIN_WORK, where it pays a build in the one chunk, or a chunk of at least
CUDNN_MIN_CHUNK tokens, aligned to SHAPE_ALIGN, whose shape was asked for before: chunks
of PREFILL_CHUNK tokens (8192) start at the same key counts in every long prompt, so their
builds are paid once (by the second prompt) and the later ones run at cuDNN's speed. Chunks
sized to a time budget are not aligned, and even a recurring one must not pay a build: it
would double that chunk's time. Measured on an H100, the default model's heads
(bench/RESULTS.md "Session 36"): a 185k prompt in chunks of 8192 took 3.85 s with the work
rule alone, 3.47 s with recurring shapes through cuDNN, 3.42 s with every chunk through
cuDNN; a chunk of 256 tokens after 185k keys takes 1.8 ms a layer through cuDNN, 0.4
through FlashAttention.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

_CUDNN_DTYPES = (torch.bfloat16, torch.float16)
_CUDNN_MAX_HEAD_DIM = 128
_split_refused = False  # set once a split call raised: every later chunk takes the mask
# chunk tokens x cached keys x q heads x head dim from which cuDNN's faster kernels pay for a
# graph build within one chunk (H100, 9 heads of 64: the gain, (FlashAttention - cuDNN) per
# layer x 30 layers, passes a ~50 ms build between 2.4e11 and 4.4e11).
CUDNN_MIN_WORK = 3.5e11
# Chunk tokens from which cuDNN's kernel is the faster one once its graph is built (H100:
# equal at 1024 tokens, 1.7-1.9x faster at 4096; FlashAttention 4x faster at 256).
CUDNN_MIN_CHUNK = 2048
# A recurring shape pays a build only if its chunk and key counts are multiples of this: the
# boundaries of fixed-size chunks, not those of chunks sized to a time budget. Measured with
# recurring budget chunks sent to cuDNN: a 185k prompt in 100 ms chunks took 9.64 s and its
# slowest chunk 195 ms, against 7.02 s and 131 ms (H100, bench/RESULTS.md "Session 36").
SHAPE_ALIGN = 256
# Shapes remembered as asked for (then forgotten all at once): far more than the key counts
# that chunks of one PREFILL_CHUNK reach, so chunks sized to a time budget cannot crowd them
# out for long.
SHAPES_HELD = 4096
_asked: set[tuple] = set()


def split_chosen(q: torch.Tensor) -> bool:
    """Whether a chunk's attention of this q [1, H, c, D] is split (see module docstring)."""
    mode = os.environ.get("SPLITFLASH_PREFILL_SPLIT_ATTENTION", "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"SPLITFLASH_PREFILL_SPLIT_ATTENTION must be 0, 1 or unset, got {mode!r}")
    return mode != "0" and not _split_refused and (not q.is_cuda or _cudnn_shape(q))


def _cudnn_shape(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.dtype in _CUDNN_DTYPES and d <= _CUDNN_MAX_HEAD_DIM and d % 8 == 0


def cudnn_chosen(q: torch.Tensor, cached: int, whole: bool = False) -> bool:
    """Whether a CUDA chunk of q [1, H, c, D] after `cached` keys (or a whole prompt, its
    work counted as c x c/2) goes to cuDNN, else to FlashAttention: see the module
    docstring; always cuDNN when FlashAttention's log-sum-exp failed `flash_lse_agrees`."""
    if not q.is_cuda:
        return False
    if not flash_lse_agrees(q.device, q.dtype, q.shape[-1]):
        return True
    _, heads, chunk, dim = q.shape
    keys = chunk // 2 if whole else cached
    return cudnn_pays((q.device, q.dtype, whole, heads, dim), chunk, keys)


def cudnn_pays(tag: tuple, chunk: int, cached: int) -> bool:
    """The rule over the shapes asked for so far; tag = (device, dtype, whole, heads, dim)."""
    heads, dim = tag[-2:]
    key = (*tag, chunk, cached)
    recurring = key in _asked
    if not recurring:
        if len(_asked) >= SHAPES_HELD:
            _asked.clear()
        _asked.add(key)
    big = chunk * cached * heads * dim >= CUDNN_MIN_WORK
    aligned = chunk % SHAPE_ALIGN == 0 and cached % SHAPE_ALIGN == 0
    return big or (recurring and aligned and chunk >= CUDNN_MIN_CHUNK)


def aligned_chunk_starts(chunk: int, max_keys: int) -> list[int]:
    """The cached-key counts at which a prompt of up to max_keys tokens in chunks of `chunk`
    meets a chunk of `chunk` tokens after others (chunk, 2 chunk, ...), where the rule sends
    recurring shapes to cuDNN; [] when such chunks never take cuDNN for recurring (too short
    or not aligned to SHAPE_ALIGN)."""
    if chunk < CUDNN_MIN_CHUNK or chunk % SHAPE_ALIGN:
        return []
    return list(range(chunk, max_keys - chunk + 1, chunk))


def prebuild(device: torch.device, dtype: torch.dtype, heads: int, dim: int, chunk: int,
             starts: list[int], scale: float) -> int:  # fmt: skip
    """Run a chunk of `chunk` queries after each of `starts` cached keys through the split
    chunk attention, its shape asked for twice so the rule takes cuDNN: cuDNN's execution
    graphs of both halves are built here, at start-up, not inside a client's prompt (44-60
    ms a shape on an H100, and the process's first cuDNN calls ~1.3 s), with the layouts of
    a real chunk (chunk_inputs). Returns the shapes run (0 off CUDA or where no split is
    taken)."""
    q, _ = chunk_inputs(device, dtype, heads, dim, chunk, 0)
    if not q.is_cuda or not split_chosen(q):
        return 0
    for cached in starts:
        q, k = chunk_inputs(device, dtype, heads, dim, chunk, cached)
        cudnn_chosen(q, cached)  # the first ask of the shape; the split's is the second
        # The split itself, not chunk_attention: an error here (out of memory beside the KV
        # pool, at a length no prompt may reach) goes to the caller instead of sending every
        # later chunk of the process to the masked path.
        chunk_attention_split(q, k, k, scale)
    return len(starts)


def chunk_inputs(device, dtype, heads: int, dim: int, chunk: int, cached: int):
    """Zero q [1, H, chunk, D] and k [1, H, cached + chunk, D] laid out as
    attention.causal_attention_torch lays out a chunk's (a cuDNN graph is built for the
    strides too): q a view of [chunk, H, D], k contiguous."""
    q = torch.zeros(chunk, heads, dim, device=device, dtype=dtype).transpose(0, 1)[None]
    return q, torch.zeros(1, heads, cached + chunk, dim, device=device, dtype=dtype)


_flash_checked: dict[tuple, bool] = {}


def flash_lse_agrees(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    """Once per (device, dtype, head dim): a small chunk split through FlashAttention and
    merged by its log-sum-exp equals masked SDPA in fp32. The merge takes the log-sum-exp as
    natural-log rows [1, H, T]; a torch whose kernel returned another convention would give
    wrong attention without an error, so then every chunk goes to cuDNN (logged)."""
    key = (device, dtype, dim)
    if key not in _flash_checked:
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, dim, generator=g, device=device) for n in (5, 12, 12))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 12))
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        try:
            got = _merge(_attend_lse(q, k[:, :, :7], v[:, :, :7], False, None, False),
                         _attend_lse(q, k[:, :, 7:], v[:, :, 7:], True, None, False))  # fmt: skip
            ok = bool((got.float() - want).abs().max() < 0.05)  # bf16 rounding: ~1e-2
        except RuntimeError:  # no FlashAttention kernel for this GPU or shape
            ok = False
        if not ok:
            log.warning("prefill chunks: FlashAttention's log-sum-exp failed its check "
                        "on %s (%s, head dim %d); cuDNN takes every chunk",
                        device, dtype, dim)  # fmt: skip
        _flash_checked[key] = ok
    return _flash_checked[key]


def _attend_lse(q, k, v, causal: bool, scale, cudnn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, H, T, D], natural log-sum-exp of each row's scores [1, H, T] fp32)."""
    if q.is_cuda and cudnn:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    elif q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    return out, lse.reshape(q.shape[:3]).float()


def _merge(old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]):
    """Two (out [1, H, T, D], lse [1, H, T]) over disjoint keys -> out over all of them."""
    (o_old, lse_old), (o_new, lse_new) = old, new
    top = torch.maximum(lse_old, lse_new)
    w_old, w_new = torch.exp(lse_old - top), torch.exp(lse_new - top)  # [1, H, T]
    total = (w_old + w_new)[..., None]
    merged = (o_old.float() * w_old[..., None] + o_new.float() * w_new[..., None]) / total
    return merged.to(o_old.dtype)


def chunk_attention_split(q, k, v, scale) -> torch.Tensor:
    """q [1, H, c, D] at the last c of k/v's L positions [1, H, L, D] -> [1, H, c, D]:
    what SDPA with causal_lower_right(c, L) gives."""
    p = k.shape[2] - q.shape[2]  # cached keys before the chunk
    cudnn = cudnn_chosen(q, p)
    return _merge(_attend_lse(q, k[:, :, :p], v[:, :, :p], False, scale, cudnn),
                  _attend_lse(q, k[:, :, p:], v[:, :, p:], True, scale, cudnn))  # fmt: skip


def chunk_attention(q, k, v, scale) -> torch.Tensor:
    """The chunk's attention: split (when chosen and there are cached keys) or masked; a
    whole prompt (square causal) through FlashAttention when cuDNN would not pay for its
    graph build (a new one for each prompt length), else through torch's pick."""
    global _split_refused
    c, length = q.shape[2], k.shape[2]
    whole = c == length
    flash_whole = whole and q.is_cuda and split_chosen(q) and not cudnn_chosen(q, 0, whole=True)
    # (the whole prompt needs no log-sum-exp, but one failed check keeps torch's pick)
    if flash_whole or (not whole and split_chosen(q)):
        try:
            if whole:
                return _attend_lse(q, k, v, True, scale, cudnn=False)[0]
            return chunk_attention_split(q, k, v, scale)
        except RuntimeError as err:  # e.g. a cuDNN build or GPU without this kernel
            _split_refused = True
            log.warning("prefill: the fused attention call raised (%s); SDPA as torch "
                        "picks it from now on", err)  # fmt: skip
    if whole:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, length),
                                          scale=scale)  # fmt: skip
