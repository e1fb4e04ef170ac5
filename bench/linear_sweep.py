"""Tile configs of the fused small-M linear kernels (kernels/fused_linear.py) on the GPU, against
the unfused ops they replace (Triton RMSNorm / SwiGLU + cuBLAS GEMM + torch add). CUDA only.

The default model's four linears of a decoder layer at M = 16 rows (one 16-token block):
norm+qkv (576 -> 960), o_proj+residual (576 -> 576), norm+gate_up+SwiGLU (576 -> 2 x 1536),
down+residual (1536 -> 576). Each variant is timed as a chain of `--chain` dependent launches
captured in one CUDA graph (as in a verify step, where every kernel waits for the one before):
time per link = graph replay time / chain length, median of `--reps` replays.

    python -m bench.linear_sweep --json-out linear_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

SHAPES = {  # name: (K, N, kind)
    "norm_qkv": (576, 960, "norm"),
    "o_res": (576, 576, "res"),
    "norm_gate_up": (576, 1536, "swiglu"),
    "down_res": (1536, 576, "res"),
}
CONFIGS = [(bn, bk, w, s) for bn, bk, (w, s) in
           itertools.product((16, 32), (64, 128, 256), ((4, 3), (2, 2), (4, 4)))]  # fmt: skip


def _chain_us(step, chain: int, reps: int) -> float:
    import torch

    for _ in range(2):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(chain):
            step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / chain)
    return sorted(times)[len(times) // 2]


def _steps(name: str, m: int):
    """(unfused step, fused step(config)) for one shape; each reads the last output, so the
    links of a chain depend on each other."""
    import torch
    import torch.nn.functional as F

    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton
    from splitflash.kernels.fused_norm import rms_norm_triton
    from splitflash.kernels.silu_mul import silu_mul_triton

    k, n, kind = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    nw = torch.ones(k, device=dev, dtype=dt)
    w = torch.randn(2 * n if kind == "swiglu" else n, k, device=dev, dtype=dt) / k**0.5
    res = torch.randn(m, n, device=dev, dtype=dt)
    hidden = n if kind == "swiglu" else None
    if kind == "res":

        def unfused():
            return res + F.linear(x, w)

        def fused(cfg):
            return linear_residual_triton(x, w, res, config=cfg)
    else:

        def unfused():
            y = F.linear(rms_norm_triton(x, nw, 1e-5), w)
            return y if hidden is None else silu_mul_triton(y, hidden)

        def fused(cfg):
            return norm_linear_triton(x, nw, 1e-5, w, hidden, config=cfg)

    return unfused, fused


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.linear_sweep", description=__doc__)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--chain", type=int, default=60)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.linear_sweep needs a CUDA GPU")
    rows = []
    for name in SHAPES:
        unfused, fused = _steps(name, args.rows)
        base = _chain_us(unfused, args.chain, args.reps)
        rows.append(dict(shape=name, variant="unfused", config=None, us=base))
        results = []
        for cfg in CONFIGS:
            try:
                us = _chain_us(lambda c=cfg, f=fused: f(c), args.chain, args.reps)
            except Exception as exc:  # a config that does not compile: say which, go on
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append((us, cfg))
            rows.append(dict(shape=name, variant="fused", config=cfg, us=us))
        results.sort()
        best = ", ".join(f"{c} {u:.2f}" for u, c in results[:4])
        print(f"{name:13s} unfused {base:6.2f} us/link | fused best: {best}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows_m": args.rows, "chain": args.chain, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
