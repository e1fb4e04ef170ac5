"""Paged verify-attention bandwidth benchmark (CUDA only; importable anywhere).

For each (batch, kv_len, q_len) it times, side by side in one process:
- the Triton paged kernel (split-KV, page table, ancestor mask),
- torch SDPA on contiguous K/V with the equivalent mask (dense bool attn_mask for q_len > 1),
- a device-to-device copy, as the attainable-bandwidth yardstick.
Effective bandwidth = K/V bytes the attention must read / time. Times are GPU time inside a
CUDA graph (*_ms); *_eager_ms adds the Python launch overhead. L2 "cold" (default): a point
whose K/V is under L2_MULTIPLE x the L2 cache gets several copies of its inputs, run one
after another in the timed graph and the time divided by their number, so each call reads
its K/V from HBM as a verify step does (every layer has its own; at 8k keys, batch 1 the
issue's shape holds 34 MB, under the 50 MB L2 of an H100 / H200). "warm": one copy,
called again and again. Usage:
    python -m bench.kernels --out bench/kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _time_graph_ms(fn) -> float:
    """GPU time inside a CUDA graph: no Python launch overhead, as in the serving path
    (DESIGN.md 6: draft and verify steps are CUDA-graph captured)."""
    import triton.testing

    fn()  # compile and autotune outside the capture
    return float(triton.testing.do_bench_cudagraph(fn, rep=100))


L2_MULTIPLE = 4  # rotated bytes per timed call, in L2 sizes (METHOD: data several times L2)
MAX_COPIES = 16


def l2_bytes() -> int:
    import torch

    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def copies_for(kv_bytes: int, l2: str) -> int:
    """Input copies a timed call rotates through: enough to stream L2_MULTIPLE x L2 (cold)."""
    if l2 == "warm":
        return 1
    return max(1, min(MAX_COPIES, -(-L2_MULTIPLE * l2_bytes() // max(1, kv_bytes))))


def _rotated(fns):
    """One callable running each of fns in turn (each on its own inputs)."""

    def run_all():
        for fn in fns:
            fn()

    return run_all


def measure_copy_gbps(n_bytes: int = 1 << 31) -> float:
    """Device copy bandwidth (read + write bytes / time) on a buffer far beyond L2."""
    import torch

    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def _paged_inputs(batch, kv_len, q_len, heads, kv_heads, head_dim, page, dtype, gen,
                  layout="head"):  # fmt: skip
    """Random paged batch; pages are handed out in shuffled order (a fragmented pool).
    layout "head": pages stored [P, H_KV, S, D] (PagedKVCache's storage), passed as
    [P, S, H_KV, D] views; "token": stored [P, S, H_KV, D]."""
    import torch

    pages_per_req = -(-kv_len // page)
    n_pages = batch * pages_per_req
    if layout not in ("head", "token"):
        raise ValueError(f"layout must be 'head' or 'token', got {layout!r}")
    shape = (n_pages, page, kv_heads, head_dim)
    if layout == "head":
        shape = (n_pages, kv_heads, page, head_dim)
    k_pages = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_pages = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    if layout == "head":
        k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
    order = torch.randperm(n_pages, device="cuda", generator=gen).to(torch.int32)
    page_table = order.view(batch, pages_per_req)
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(batch * q_len, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    chain = [(1 << (i + 1)) - 1 for i in range(q_len)]
    chain = [c - (1 << 64) if c >= 1 << 63 else c for c in chain]  # int64 two's complement
    anc = torch.tensor(chain * batch, dtype=torch.int64, device="cuda")
    return q, k_pages, v_pages, page_table, kv_lens, cu_q, anc


def _sdpa_case(q, k_pages, v_pages, page_table, batch, kv_len, q_len):
    """Contiguous [B, H, L, D] copies and the dense mask SDPA needs for the same attention."""
    import torch

    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pages.shape[2]
    idx = page_table.long().flatten()

    def gather(pages):  # [P, S, H_KV, D] -> [B, H_KV, L, D]
        flat = pages.index_select(0, idx).reshape(batch, -1, kv_heads, head_dim)[:, :kv_len]
        return flat.transpose(1, 2).contiguous()

    k, v = gather(k_pages), gather(v_pages)
    qs = q.view(batch, q_len, heads, head_dim).transpose(1, 2)
    mask = None
    if q_len > 1:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device="cuda")
        mask[:, kv_len - q_len :] = torch.tril(mask[:, kv_len - q_len :])
        mask = mask.expand(batch, 1, q_len, kv_len)
    return qs, k, v, mask


def _bench_one(batch, kv_len, q_len, heads, kv_heads, head_dim, page, dtype, with_sdpa,
               layout="head", l2="cold"):  # fmt: skip
    import torch
    import torch.nn.functional as F

    from splitflash.kernels.paged_attention import paged_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * kv_len * kv_heads * head_dim * elem
    copies = copies_for(kv_bytes, l2)
    cases = [_paged_inputs(batch, kv_len, q_len, heads, kv_heads, head_dim, page, dtype, gen,
                           layout) for _ in range(copies)]  # fmt: skip
    scale = head_dim**-0.5
    row = dict(batch=batch, kv_len=kv_len, q_len=q_len, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim, page_size=page, kv_bytes=kv_bytes, layout=layout, l2=l2,
               input_copies=copies)  # fmt: skip
    known = dict(max_kv_len=kv_len, max_q_len=q_len)  # what a scheduler passes: no host sync

    def triton_call(args):
        return lambda: paged_attention_triton(*args, scale, **known)

    triton_fn = _rotated([triton_call(args) for args in cases])
    ms = _time_graph_ms(triton_fn) / copies
    row["triton_ms"], row["triton_gbps"] = ms, kv_bytes / (ms * 1e-3) / 1e9
    row["triton_eager_ms"] = _time_ms(triton_fn) / copies  # includes host launch overhead
    row["sdpa_ms"] = row["sdpa_gbps"] = None
    if with_sdpa:
        dense = [_sdpa_case(a[0], a[1], a[2], a[3], batch, kv_len, q_len) for a in cases]

        def sdpa_call(qs, k, v, mask):
            return lambda: F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

        sdpa_fn = _rotated([sdpa_call(*d) for d in dense])
        try:
            ms = _time_graph_ms(sdpa_fn) / copies
            row["sdpa_ms"], row["sdpa_gbps"] = ms, kv_bytes / (ms * 1e-3) / 1e9
            row["sdpa_eager_ms"] = _time_ms(sdpa_fn) / copies
        except (RuntimeError, TypeError) as exc:  # no GQA/mask backend in this torch
            row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def run_kernel_bench(
    batch_sizes=(1, 8),
    kv_lens=(8192, 32768, 131072, 262144),
    q_lens=(1, 16, 64),
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    dtype: str = "bfloat16",
    with_sdpa: bool = True,
    print_table: bool = True,
    layout: str = "head",
    l2: str = "cold",
) -> list[dict]:
    """Rows of {batch, kv_len, q_len, kv_bytes, triton_ms/gbps, sdpa_ms/gbps, copy_gbps,
    triton_vs_copy, triton_vs_sdpa}. Raises RuntimeError without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    torch_dtype = getattr(torch, dtype)
    copy_gbps = measure_copy_gbps()
    device = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    rows = []
    for batch in batch_sizes:
        for kv_len in kv_lens:
            for q_len in q_lens:
                row = _bench_one(batch, kv_len, q_len, heads, kv_heads, head_dim, page_size,
                                 torch_dtype, with_sdpa, layout, l2)  # fmt: skip
                row.update(device=device, capability=f"sm_{cap[0]}{cap[1]}", dtype=dtype,
                           copy_gbps=copy_gbps)  # fmt: skip
                row["triton_vs_copy"] = row["triton_gbps"] / copy_gbps
                sdpa = row.get("sdpa_ms")
                row["triton_vs_sdpa"] = sdpa / row["triton_ms"] if sdpa else None
                rows.append(row)
                torch.cuda.empty_cache()
    if print_table:
        print_rows(rows)
    return rows


def print_rows(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(x, spec):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    title = ""
    if rows:
        title = (f"paged verify attention, {rows[0]['device']} ({rows[0]['capability']}), "
                 f"L2 {rows[0]['l2']}")  # fmt: skip
    table = Table(title=title)
    for col in ("B", "kv_len", "q_len", "KV MB", "triton ms", "triton GB/s", "sdpa ms",
                "sdpa GB/s", "copy GB/s", "triton/copy", "speedup vs sdpa"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["batch"]), str(r["kv_len"]), str(r["q_len"]), fmt(r["kv_bytes"] / 1e6, ".0f"),
            fmt(r["triton_ms"], ".3f"), fmt(r["triton_gbps"], ".0f"), fmt(r["sdpa_ms"], ".3f"),
            fmt(r["sdpa_gbps"], ".0f"), fmt(r["copy_gbps"], ".0f"),
            fmt(r["triton_vs_copy"], ".2f"), fmt(r["triton_vs_sdpa"], ".2f"),
        )  # fmt: skip
    Console().print(table)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/kernels.json"))
    ap.add_argument("--batch-sizes", type=_ints, default=(1, 8))
    ap.add_argument("--kv-lens", type=_ints, default=(8192, 32768, 131072, 262144))
    ap.add_argument("--q-lens", type=_ints, default=(1, 16, 64))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument(
        "--layout",
        default="head",
        choices=["head", "token"],
        help="page storage: head-major (PagedKVCache's) or token-major",
    )
    ap.add_argument(
        "--l2",
        default="cold",
        choices=["cold", "warm"],
        help="cold: rotate input copies past L2 (the default); warm: one copy",
    )
    a = ap.parse_args(argv)
    rows = run_kernel_bench(a.batch_sizes, a.kv_lens, a.q_lens, a.heads, a.kv_heads,
                            a.head_dim, a.page_size, a.dtype, not a.no_sdpa,
                            layout=a.layout, l2=a.l2)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {len(rows)} rows to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
