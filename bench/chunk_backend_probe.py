"""A prefill chunk's split attention (models/chunk_attention.py) through cuDNN or through
FlashAttention-2: wall and host ms per layer for the default model's heads (9 x 64, bf16),
30 calls (a forward's layers) then a sync, with the cached-key count seen before or new
each round (as every chunk's is); then a whole prompt's causal attention, torch's pick
(F.scaled_dot_product_attention) against FlashAttention, at a new length and a length seen.
It measured where cuDNN's per-shape graph build pays (chunk_attention.CUDNN_MIN_WORK); the
first rows time a new shape's first call against its next ones.
CUDA only.

    python -m bench.chunk_backend_probe
"""

from __future__ import annotations

import argparse
import time

LAYERS = 30


def _ops():
    import torch

    ops = torch.ops.aten

    def cudnn(q, k, v, causal):
        return ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                       scale=0.125)[:2]  # fmt: skip

    def flash(q, k, v, causal):
        return ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.125)[:2]

    return cudnn, flash


def _split_rows(heads: int, dim: int) -> None:
    import torch

    cudnn, flash = _ops()

    def run(fn, q, kv, p):
        fn(q, kv[:, :, :p], kv[:, :, :p], False)
        fn(q, kv[:, :, p:], kv[:, :, p:], True)

    for p in (16384, 100_000, 185_000):
        for c in (256, 1024, 4096, 8192):
            q = torch.randn(1, heads, c, dim, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(1, heads, p + c, dim, device="cuda", dtype=torch.bfloat16)
            row = []
            for name, fn in (("cudnn", cudnn), ("flash", flash)):
                for shift in (0, 1):  # 0: the key count seen before; 1: a new one each round
                    pp = p
                    run(fn, q, kv, pp)
                    torch.cuda.synchronize()
                    walls, hosts = [], []
                    for _ in range(3):
                        pp -= shift
                        t0 = time.perf_counter()
                        for _ in range(LAYERS):
                            run(fn, q, kv, pp)
                        t1 = time.perf_counter()
                        torch.cuda.synchronize()
                        hosts.append((t1 - t0) / LAYERS * 1e3)
                        walls.append((time.perf_counter() - t0) / LAYERS * 1e3)
                    tag = name + ("+new p" if shift else "")
                    row.append(f"{tag} {min(walls):.2f}/{min(hosts):.2f}")
            print(f"p {p:>6} c {c:>5}: " + "  ".join(row) + "  (wall/host ms per layer)",
                  flush=True)  # fmt: skip


def _build_rows(heads: int, dim: int) -> None:
    """Where a new key count's cost falls: the first cuDNN call of a new shape against the
    next calls of that same shape (one forward's 30 layers share a chunk's shape), each call
    timed alone with a sync."""
    import torch

    cudnn, flash = _ops()
    for p, c in ((100_000, 1024), (185_000, 256), (185_000, 8192)):
        q = torch.randn(1, heads, c, dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, heads, p + c, dim, device="cuda", dtype=torch.bfloat16)
        row = []
        for name, fn in (("cudnn", cudnn), ("flash", flash)):
            for half, (k, causal) in (("cached", (kv[:, :, : p - 7], False)),
                                      ("causal", (kv[:, :, p - 7 :], True))):  # fmt: skip
                times = []
                for _ in range(4):  # a shape not seen before, then the same shape 3 times
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn(q, k, k, causal)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                row.append(f"{name} {half} {times[0]:.2f} then {min(times[1:]):.2f}")
        print(f"new shape p {p:>6} c {c:>5}: " + "  ".join(row) + "  (ms per call)", flush=True)


def _whole_rows(heads: int, dim: int) -> None:
    import torch
    import torch.nn.functional as F

    _, flash = _ops()
    for n in (512, 2048, 8192, 32768):
        qkv = torch.randn(3, 1, heads, n + 8, dim, device="cuda", dtype=torch.bfloat16)
        row = []
        for name in ("sdpa", "flash"):
            walls = []
            for r in (0, 1, 2, 2):  # new lengths, then the last one again
                q, k, v = (t[:, :, : n - r] for t in qkv)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(LAYERS):
                    if name == "sdpa":
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    else:
                        flash(q, k, v, True)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) / LAYERS * 1e3)
            row.append(f"{name} new {min(walls[1:3]):.2f} seen {walls[3]:.2f}")
        print(f"whole prompt {n:>6}: " + "  ".join(row) + "  (ms per layer)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chunk_backend_probe", description=__doc__)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--parts",
        nargs="+",
        choices=("build", "split", "whole"),
        default=["build", "split", "whole"],
        help="which tables to measure",
    )
    a = p.parse_args(argv)
    for part in a.parts:
        dict(build=_build_rows, split=_split_rows, whole=_whole_rows)[part](a.heads, a.dim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
