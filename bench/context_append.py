"""One verify step's context features into the drafter: per request vs one batched pass.

After each verify step the drafter takes every request's new feature rows (accepted + 1,
up to the block size) into its KV cache: fc, hidden_norm, RoPE, then each layer's K/V
projection and cache write. Per request (`append_context`, as the draft service did before
session 15) that is ~40 small kernels per request; batched (`append_contexts`, what the
proposer now runs at its next proposal) the projections run once for the step, only the
cache writes stay per request. The shipped SmolLM2 drafter (3 layers), random features,
requests holding --context rows of context already (untimed); both ways alternated, each
step appends at the next positions. At the end both ways' caches must hold the same K/V.

    python -m bench.context_append --batches 1 8 32 --rows 16 [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.draft_graphs import _drafter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(device: torch.device, batches: list[int], rows: int, context: int, reps: int):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter = _drafter(device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    out = []

    def rand(n: int) -> torch.Tensor:  # [n, K*D] random target features
        f = torch.randn(n, drafter.config.feature_dim, generator=gen, device=device)
        return f.to(dtype)

    for b in batches:
        states = {way: [drafter.new_state() for _ in range(b)] for way in ("one", "batched")}
        for i in range(b):  # request i holds the same context both ways
            held = rand(context)
            for way_states in states.values():
                drafter.append_context(way_states[i], held, 0)
        step_feats = [rand(rows) for _ in range(b)]
        times: dict[str, list[float]] = {"one": [], "batched": []}
        for i in range(reps + 3):  # alternated; the first 3 of each are warm-up
            for way, sts in states.items():
                _sync(device)
                t = time.perf_counter()
                if way == "one":
                    for st, f in zip(sts, step_feats, strict=True):
                        drafter.append_context(st, f, st.n_ctx)
                else:
                    drafter.append_contexts(
                        [(st, f, st.n_ctx) for st, f in zip(sts, step_feats, strict=True)]
                    )
                _sync(device)
                if i >= 3:
                    times[way].append((time.perf_counter() - t) * 1e3)
        # Same rows written both ways, up to GEMMs of another height: max |diff| relative
        # to the largest value. Measured on the dev machine's CPU: 5e-7 typically, once
        # 1.2e-4 at batch 1, where both ways run the very same ops (the CPU BLAS is not
        # bit-reproducible under load); a wrong row or position would be O(1).
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        for a, c in zip(states["one"], states["batched"], strict=True):
            assert a.n_ctx == c.n_ctx
            for la, lc in zip(a.layers, c.layers, strict=True):
                n = a.n_ctx if la.window is None else min(a.n_ctx, la.window)
                for x, y in ((la.k[:n], lc.k[:n]), (la.v[:n], lc.v[:n])):
                    err = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
                    if err > tol:
                        raise SystemExit(f"batched appends differ: {err:.2e} > {tol} (B {b})")
        one, batched = statistics.median(times["one"]), statistics.median(times["batched"])
        out.append(dict(batch=b, rows=rows, one_by_one_ms=one, batched_ms=batched))
        print(f"B {b:3d}: one by one {one:.3f} ms, batched {batched:.3f} ms "
              f"(x{one / batched:.2f})", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.context_append", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rows", type=int, default=16, help="new rows per request (accepted + 1)")
    p.add_argument("--context", type=int, default=1024, help="rows held before the timed steps")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args(argv)
    with torch.inference_mode():
        run(torch.device(args.device), args.batches, args.rows, args.context, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
