"""Tile configs of the drafter's block attention (kernels/draft_attention.py) on the GPU:
which one config streams the context fastest at every length, so a drafter never has to
autotune while serving (tuning.MEASURED_DRAFT_PICKS).

The shipped drafter's shape by default (block 16, 9 / 3 heads of 64 dims, bf16): its sliding
layers (W 512, so 511 context keys whatever the context) and its full layer at each context
length, batch 1 and 8. Every config of the GPU's set is timed inside a CUDA graph
(triton.testing.do_bench_cudagraph) and its output checked against draft_attention_ref.
Per point: each config's time over the point's best; the pick is the config whose worst
such ratio is smallest.

    python -m bench.draft_attn_sweep --contexts 2048 32768 185000 --json-out sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _inputs(batch: int, w_cap: int, blk: int, heads: int, kv_heads: int, dim: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    q = rnd(batch, blk, heads, dim)
    blk_k, blk_v = rnd(batch, blk, kv_heads, dim), rnd(batch, blk, kv_heads, dim)
    ctx_k, ctx_v = rnd(batch, w_cap, kv_heads, dim), rnd(batch, w_cap, kv_heads, dim)
    return q, blk_k, blk_v, ctx_k, ctx_v


def sweep_point(batch, n_ctx, window, shape, configs, reps) -> dict:
    import torch
    from triton.testing import do_bench_cudagraph

    from splitflash.kernels.draft_attention import draft_attention_triton
    from splitflash.kernels.draft_attention_ref import draft_attention_ref

    blk, heads, kv_heads, dim = shape
    w_cap = n_ctx if window is None else min(n_ctx, window)  # a sliding layer's ring
    q, bk, bv, ck, cv = _inputs(batch, w_cap, blk, heads, kv_heads, dim)
    # On the device: a host list would be copied in, which a graph capture cannot hold.
    n = torch.full((batch,), n_ctx, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    ref = draft_attention_ref(q.float(), bk.float(), bv.float(), ck.float(), cv.float(), n,
                              window, scale)  # fmt: skip
    read = (min(n_ctx, window - 1) if window else n_ctx) + blk
    bytes_read = batch * read * kv_heads * dim * 2 * 2  # K and V, bf16
    rows = []
    for cfg in configs:

        def fn(cfg=cfg):
            return draft_attention_triton(q, bk, bv, ck, cv, n, window, scale,
                                          max_ctx_len=n_ctx, config=cfg)  # fmt: skip

        try:
            err = (fn().float() - ref).abs().max().item()
            ms = do_bench_cudagraph(fn, rep=reps)
        except Exception as exc:  # e.g. out of shared memory for this config
            rows.append(dict(config=list(cfg), error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        rows.append(dict(config=list(cfg), ms=ms, gbps=bytes_read / ms / 1e6, max_err=err))
    if not any("ms" in r for r in rows):
        raise RuntimeError(f"every config failed at B {batch} ctx {n_ctx}: {rows[0]['error']}")
    best = min(r["ms"] for r in rows if "ms" in r)
    for r in rows:
        if "ms" in r:
            r["over_best"] = r["ms"] / best
    torch.cuda.empty_cache()
    return dict(batch=batch, context=n_ctx, window=window, rows=rows)


def pick(points: list[dict]) -> tuple[list[int], float]:
    """The config whose worst time over its point's best is smallest, and that worst."""
    worst: dict[tuple, float] = {}
    for p in points:
        for r in p["rows"]:
            key = tuple(r["config"])
            worst[key] = max(worst.get(key, 1.0), r.get("over_best", float("inf")))
    cfg = min(worst, key=worst.get)
    return list(cfg), worst[cfg]


def main(argv: list[str] | None = None) -> int:
    import torch

    from splitflash.kernels.tuning import CONFIG_SETS, config_set_for, device_facts

    p = argparse.ArgumentParser(prog="python -m bench.draft_attn_sweep", description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 185000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--window", type=int, default=512, help="the sliding layers' window")
    p.add_argument("--shape", default="16,9,3,64", help="block,heads,kv_heads,head_dim")
    p.add_argument("--reps", type=int, default=50, help="ms of timing per config")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.draft_attn_sweep needs a CUDA GPU")
    shape = tuple(int(x) for x in args.shape.split(","))
    configs = CONFIG_SETS[config_set_for(device_facts(0)[0])]
    points, t0 = [], time.perf_counter()
    plan = [(b, c, None) for b in args.batches for c in args.contexts]
    plan += [(b, max(args.contexts), args.window) for b in args.batches]
    for batch, n_ctx, window in plan:
        pt = sweep_point(batch, n_ctx, window, shape, configs, args.reps)
        points.append(pt)
        ok = sorted((r for r in pt["rows"] if "ms" in r), key=lambda r: r["ms"])
        print(f"[{time.perf_counter() - t0:6.1f}s] B {batch} ctx {n_ctx} window {window}: "
              + ", ".join(f"{tuple(r['config'])} {r['ms'] * 1e3:.1f}us" for r in ok[:4]),
              flush=True)  # fmt: skip
    cfg, worst = pick(points)
    print(f"pick {tuple(cfg)}: at most {worst:.3f}x the best config of any point")
    for pt in points:
        r = next(r for r in pt["rows"] if r["config"] == cfg)
        print(
            f"  B {pt['batch']} ctx {pt['context']} window {pt['window']}: "
            f"{r['ms'] * 1e3:.1f} us, {r['gbps']:.0f} GB/s, x{r['over_best']:.3f} of best, "
            f"max err {r['max_err']:.2e}"
        )
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name(), shape=shape, window=args.window)
        out = dict(meta=meta, points=points, pick=cfg, pick_worst=worst)
        args.json_out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
