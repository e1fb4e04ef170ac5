"""Tile configs of the fused small-M linear kernels (kernels/fused_linear.py) on the GPU, against
the unfused ops they replace (Triton RMSNorm / SwiGLU + cuBLAS GEMM + torch add). CUDA only.

The default model's four linears of a decoder layer at M = 16 rows (one 16-token block):
norm+qkv (576 -> 960), o_proj+residual (576 -> 576), norm+gate_up+SwiGLU (576 -> 2 x 1536),
down+residual (1536 -> 576). Each variant is timed as a chain of `--chain` dependent launches
captured in one CUDA graph (as in a verify step, where every kernel waits for the one before):
time per link = graph replay time / chain length, median of `--reps` replays.
`--invariant`: the batch-invariant launches (16-row tiles up to M 16, else 64; configs fixed
by K, never by M), timed at each of `--rows` (e.g. 1 16 128: a decode step, a block, eight).
`--compare`: no sweep; at each of `--rows`, the unfused ops, the shipped configs on 16-row
tiles and on 64-row tiles (`row_tile`: which height the fast path takes above one block).
`--splits`: no sweep; the shipped configs at each split-K cap given (kernels/split_k.py; 0 =
auto). `--cold`: the links of a chain rotate over copies of the weights, >= 256 MB in all,
so they come from HBM as in a verify step (a chain over one weight reads it from L2).

    python -m bench.linear_sweep --json-out linear_sweep.json
    python -m bench.linear_sweep --invariant --rows 16 128 --json-out linear_sweep_inv.json
    python -m bench.linear_sweep --compare --rows 32 64 128 256 --json-out tiles.json
    python -m bench.linear_sweep --splits 1 2 3 4 6 0 --cold --rows 1 16 32 --json-out sk.json
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
INVARIANT_CONFIGS = [
    (bn, bk, w, s)
    for bn, bk, (w, s) in itertools.product((32, 64, 128), (64, 128), ((4, 3), (4, 4), (8, 3)))
] + [(16, 64, 4, 4), (32, 256, 4, 3), (16, 128, 4, 3), (32, 64, 4, 4)]  # the fast path's picks


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


def _copies(name: str) -> int:
    """Weight copies of a cold chain: >= 256 MB of bf16, past any L2."""
    k, n, kind = SHAPES[name]
    return -(-(256 << 20) // ((2 * n if kind == "swiglu" else n) * k * 2))


def _steps(name: str, m: int, invariant: bool = False, cold: bool = False):
    """(unfused step, fused step(config, block_m, split_k)) for one shape; each reads the last
    output, so the links of a chain depend on each other. cold: each call takes the next of
    enough weight copies to hold >= 256 MB."""
    import torch
    import torch.nn.functional as F

    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton
    from splitflash.kernels.fused_norm import rms_norm_triton
    from splitflash.kernels.silu_mul import silu_mul_triton

    k, n, kind = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    nw = torch.ones(k, device=dev, dtype=dt)
    rows_w = 2 * n if kind == "swiglu" else n
    copies = _copies(name) if cold else 1
    ws = [torch.randn(rows_w, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
    turn = itertools.count()

    def w():  # the next copy (captured once per link: each link keeps its own)
        return ws[next(turn) % copies]

    if kind != "res":  # fold the norm weight into every copy now, not inside a capture
        from splitflash.kernels.fused_linear_ref import fold_norm_weight

        for copy in ws:
            fold_norm_weight(copy, nw)
    res = torch.randn(m, n, device=dev, dtype=dt)
    hidden = n if kind == "swiglu" else None
    if kind == "res":

        def unfused():
            return res + F.linear(x, w())

        def fused(cfg, block_m=None, split_k=None):
            return linear_residual_triton(x, w(), res, config=cfg, invariant=invariant,
                                          block_m=block_m, split_k=split_k)  # fmt: skip
    else:

        def unfused():
            y = F.linear(rms_norm_triton(x, nw, 1e-5), w())
            return y if hidden is None else silu_mul_triton(y, hidden)

        def fused(cfg, block_m=None, split_k=None):
            return norm_linear_triton(x, nw, 1e-5, w(), hidden, config=cfg,
                                      invariant=invariant, block_m=block_m,
                                      split_k=split_k)  # fmt: skip

    return unfused, fused


def compare_tiles(ms: list[int], chain: int, reps: int) -> list[dict]:
    """us per link of each layer at each M: unfused, 16-row tiles (the fast configs), 64-row
    tiles (invariant_config); the per-layer sums printed last."""
    from splitflash.kernels.linear_tiles import invariant_config, launch_config

    rows = []
    for m in ms:
        total = {"unfused": 0.0, "rows16": 0.0, "rows64": 0.0}
        for name in SHAPES:
            unfused, fused = _steps(name, m)
            k = SHAPES[name][0]
            rows16, rows64 = (launch_config(k), 16), (invariant_config(k), 64)
            times = {
                "unfused": _chain_us(unfused, chain, reps),
                "rows16": _chain_us(lambda f=fused, a=rows16: f(*a), chain, reps),
                "rows64": _chain_us(lambda f=fused, a=rows64: f(*a), chain, reps),
            }
            for variant, us in times.items():
                total[variant] += us
                rows.append(dict(rows_m=m, shape=name, variant=variant, us=us))
            print(f"M {m:4d} {name:13s} " + " ".join(f"{v} {u:6.2f}" for v, u in times.items()),
                  flush=True)  # fmt: skip
        print(f"M {m:4d} {'layer':13s} " + " ".join(f"{v} {u:6.2f}" for v, u in total.items()))
    return rows


def _by_cap(times: dict) -> str:
    return " ".join(f"s{cap or 'auto'} {us:6.2f}" for cap, us in times.items())


def compare_splits(ms: list[int], caps: list[int], cold: bool, chain: int,
                   reps: int) -> list[dict]:  # fmt: skip
    """us per link of each layer at each M and split-K cap (0: auto), the shipped configs;
    the per-layer sums printed last."""
    from splitflash.kernels.linear_tiles import launch_config

    rows = []
    for m in ms:
        total = dict.fromkeys(caps, 0.0)
        for name in SHAPES:
            _, fused = _steps(name, m, cold=cold)
            cfg = launch_config(SHAPES[name][0])
            links = max(chain, _copies(name)) if cold else chain  # every copy once a replay
            times = {cap: _chain_us(lambda c=cap, f=fused, g=cfg: f(g, None, c), links,
                                    reps) for cap in caps}  # fmt: skip
            for cap, us in times.items():
                total[cap] += us
                rows.append(dict(rows_m=m, shape=name, split_cap=cap, cold=cold, us=us))
            print(f"M {m:4d} {name:13s} " + _by_cap(times), flush=True)
        print(f"M {m:4d} {'layer':13s} " + _by_cap(total))
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.linear_sweep", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[16])
    p.add_argument("--invariant", action="store_true", help="64-row batch-invariant tiles")
    p.add_argument("--compare", action="store_true", help="16- vs 64-row tiles, no sweep")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="split-K caps to time (0: auto), no sweep")  # fmt: skip
    p.add_argument("--cold", action="store_true", help="weights from HBM, not L2")
    p.add_argument("--chain", type=int, default=60)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.linear_sweep needs a CUDA GPU")
    from splitflash.kernels.linear_tiles import invariant_config, launch_config

    if args.compare or args.splits:
        rows = (compare_splits(args.rows, args.splits, args.cold, args.chain, args.reps)
                if args.splits else compare_tiles(args.rows, args.chain, args.reps))  # fmt: skip
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"compare": True, "chain": args.chain, "results": rows}, f, indent=2)
        return 0
    configs = INVARIANT_CONFIGS if args.invariant else CONFIGS
    rows = []
    for m in args.rows:
        for name in SHAPES:
            unfused, fused = _steps(name, m, args.invariant)
            base = _chain_us(unfused, args.chain, args.reps)
            rows.append(dict(rows_m=m, shape=name, variant="unfused", config=None, us=base))
            k = SHAPES[name][0]
            shipped = invariant_config(k) if args.invariant else launch_config(k)
            results = []
            for cfg in configs:
                try:
                    us = _chain_us(lambda c=cfg, f=fused: f(c), args.chain, args.reps)
                except Exception as exc:  # a config that does not compile: say which, go on
                    print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                results.append((us, cfg))
                rows.append(dict(rows_m=m, shape=name, variant="fused", config=cfg, us=us,
                                 shipped=cfg == shipped))  # fmt: skip
            results.sort()
            best = ", ".join(f"{c} {u:.2f}" for u, c in results[:4])
            mine = next((f"{u:.2f}" for u, c in results if c == shipped), "-")
            print(f"M {m:4d} {name:13s} unfused {base:6.2f} us/link | shipped {shipped} {mine}"
                  f" | best: {best}", flush=True)  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"invariant": args.invariant, "chain": args.chain, "results": rows}, f,
                      indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
