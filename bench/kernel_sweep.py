"""Config x split sweep of the paged verify kernel (issue 5): which (BLOCK_N, warps, stages)
and `waves` (programs per SM, kv_splits.plan_splits) stream K/V closest to copy speed. Batch
1/8 x kv 32k/128k x q_len 16/64 (bf16, H 32, H_KV 8, D 128, page 16), every candidate config
at the split counts of waves 1/2/4/8, plus "auto" (autotuned, default waves) and a q_len 1
control. GPU time in a CUDA graph; frac = (K/V bytes / time) / copy GB/s of the same run.
Kernel variants are compiled first by parallel processes (Triton's disk cache is shared).
    python -m bench.kernel_sweep --out sweep.json          # H200: ~70-100 s (limit 140)
    python -m bench.kernel_sweep --quick --time-limit 40   # 4 configs, 6 points: ~30 s
    TRITON_INTERPRET=1 python -m bench.kernel_sweep --smoke --out /tmp/sweep.json  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

T0 = time.monotonic()
SHAPE = dict(heads=32, kv_heads=8, head_dim=128, page=16)
SMOKE_SHAPE = dict(heads=8, kv_heads=2, head_dim=32, page=16)
# (BLOCK_N, warps, stages). 4-warp configs run 64-row tiles; 8-warp ones 128-row tiles at
# q_len 64 (pick_block_m). Offline sm_90 compiles: BLOCK_N 128 spills except (128, 8, 3)
# with 64-row tiles; stages 2 only double-buffer. See tuning.HOPPER_CONFIGS.
CANDIDATES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4),
              (64, 8, 3), (64, 8, 4), (32, 8, 3), (128, 8, 3))  # fmt: skip
QUICK = ((64, 4, 3), (32, 4, 3), (64, 4, 4), (64, 8, 3))
WAVES, QUICK_WAVES = (1, 2, 4, 8), (1, 2, 4)
CONTROL, CONTROL_CONFIG = (8, 131072, 1), (64, 4, 3)  # q_len 1 was 0.97 of copy: yardstick
POINTS = [(b, kv, q) for q in (16, 64) for kv in (32768, 131072) for b in (1, 8)]
QUICK_POINTS = POINTS[:4] + [(1, 32768, 64), (8, 32768, 64)]
SMOKE_POINTS = [(1, 300, 16), (2, 200, 64)]


def _elapsed() -> float:
    return time.monotonic() - T0


def _inputs(batch, kv_len, q_len, shape, dtype, cuda, layout="head", seed=0):
    """(q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits) as bench.kernels builds
    them; on CPU (smoke) the same layout, built here."""
    import torch

    if cuda:
        from bench.kernels import _paged_inputs

        gen = torch.Generator(device="cuda").manual_seed(seed)
        return _paged_inputs(batch, kv_len, q_len, shape["heads"], shape["kv_heads"],
                             shape["head_dim"], shape["page"], dtype, gen, layout)  # fmt: skip
    n_pp = -(-kv_len // shape["page"])
    kv = (batch * n_pp, shape["page"], shape["kv_heads"], shape["head_dim"])
    chain = [(1 << (i + 1)) - 1 - (1 << 64) * (i == 63) for i in range(q_len)]  # int64
    return (torch.randn(batch * q_len, shape["heads"], shape["head_dim"], dtype=dtype),
            torch.randn(kv, dtype=dtype), torch.randn(kv, dtype=dtype),
            torch.randperm(batch * n_pp).to(torch.int32).view(batch, n_pp),
            torch.full((batch,), kv_len, dtype=torch.int32),
            torch.arange(batch + 1, dtype=torch.int32) * q_len,
            torch.tensor(chain * batch, dtype=torch.int64))  # fmt: skip


def plan_rows(point, configs, waves, shape, device, with_auto, q1_waves=False, block_ms=(None,)):
    """Rows to time at one point: one per (config, rows per program, distinct split count);
    'auto' last. q_len 1 keeps the legacy split rule unless q1_waves (--waves given).
    block_ms: rows per program to try (None: pick_block_m's); those a config cannot run
    (128 rows at 4 warps) are left out."""
    from splitflash.kernels.kv_splits import plan_launch

    batch, kv_len, q_len = point
    group = shape["heads"] // shape["kv_heads"]
    args = (device, q_len * group, q_len, batch, shape["kv_heads"], kv_len)
    seen = {}
    for cfg in configs:
        for bm in block_ms:
            if bm == 128 and cfg[1] < 8:
                continue
            for w in waves if q_len > 1 or q1_waves else (None,):
                lp = plan_launch(*args, config=cfg, waves=w, block_m=bm)
                n = lp.splits.num_splits
                seen.setdefault((cfg, lp.block_m, n), dict(config=list(cfg), waves=[], splits=n,
                                block_m=lp.block_m))["waves"].append(w)  # fmt: skip
    rows = list(seen.values())
    if with_auto:
        lp = plan_launch(*args)
        rows.append(dict(config="auto", waves=["default"], splits=lp.splits.num_splits,
                         block_m=lp.block_m))  # fmt: skip
    return rows


def compile_jobs(point_rows, shape, device):
    """(config, q_len, splits) calls that compile every kernel and combine variant the sweep
    launches: kernel variants by (config, BLOCK_M, direct), combine ones by split count."""
    import torch

    from splitflash.kernels.tuning import CONFIG_SETS, config_set_for

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    jobs, kernels, combines = [], set(), set()
    for (_, _, q_len), rows in point_rows:
        for r in rows:
            cfgs = [tuple(r["config"])] if r["config"] != "auto" else [
                c for c in CONFIG_SETS[config_set_for(cap)]
                if r["block_m"] < 128 or c[1] >= 8]  # autotune_prune's rule  # fmt: skip
            for cfg in cfgs:
                k = (cfg, r["block_m"], r["splits"] == 1)
                c = (1 << max(0, r["splits"] - 1).bit_length(), r["splits"] % 16 == 0)
                if k not in kernels or (r["splits"] > 1 and c not in combines):
                    kernels.add(k)
                    combines.add(c)
                    jobs.append((cfg, q_len, r["splits"], shape, r["block_m"]))
    return jobs


def _compile_job(job):
    """Worker process: one tiny launch with the sweep's exact specialization: same shape,
    16-aligned ints (page-table width 16 * splits), same split count."""
    try:
        import torch

        from splitflash.kernels.paged_attention import paged_attention_triton

        cfg, q_len, splits, shape, block_m = job
        kv_len = 256 * splits
        args = _inputs(1, kv_len, q_len, shape, torch.bfloat16, cuda=True)
        paged_attention_triton(*args, 0.088, config=tuple(cfg), num_splits=splits,
                               max_kv_len=kv_len, max_q_len=q_len, block_m=block_m)  # fmt: skip
        torch.cuda.synchronize()
        return job, None
    except Exception as exc:  # noqa: BLE001 - reported, the main run skips or retries it
        return job, f"{type(exc).__name__}: {str(exc)[:160]}"


def precompile(jobs, workers, deadline):
    """Compile in `workers` spawned processes until done or deadline; returns error notes."""
    import multiprocessing as mp

    from bench import kernel_sweep as this  # a picklable reference under -m

    notes = []
    with mp.get_context("spawn").Pool(workers) as pool:
        it = pool.imap_unordered(this._compile_job, jobs)
        try:
            for job, err in (it.next(timeout=max(1.0, deadline - _elapsed())) for _ in jobs):
                if err:
                    notes.append(f"compile {job}: {err}")
        except mp.TimeoutError:
            notes.append(f"precompile stopped at the deadline ({_elapsed():.0f} s)")
        pool.terminate()
    return notes


def time_row(row, point, copies, ref, scale, rep, cuda):
    """Fill row with ms / error, or an 'error' note when it fails to compile or launch.
    copies: input sets (bench.kernels.copies_for) one timed call runs in turn; ms is per set,
    the error is the first set's against ref."""
    import importlib

    import torch

    pa = importlib.import_module("splitflash.kernels.paged_attention")  # not the function
    batch, kv_len, q_len = point
    kw = dict(max_kv_len=kv_len, max_q_len=q_len)
    if row["config"] != "auto":
        kw.update(config=tuple(row["config"]), block_m=row["block_m"])
        if row["waves"] != [None]:  # the control keeps the default (legacy) split rule
            kw.update(num_splits=row["splits"])

    def fn():
        for inputs in copies:
            pa.paged_attention_triton(*inputs, scale, **kw)

    try:
        out = pa.paged_attention_triton(*copies[0], scale, **kw)
        err = (out.float() - ref.float()).abs().max().item()
        row["max_err"], row["rel_err"] = err, err / max(ref.float().abs().max().item(), 1e-6)
        if cuda:
            from triton.testing import do_bench_cudagraph

            if row["config"] == "auto":
                tuned = pa._tuned_kernel(pa.config_set_for(torch.cuda.get_device_capability()))
                row["picked"] = str(getattr(tuned, "best_config", "a measured pick"))
            row["ms"] = float(do_bench_cudagraph(fn, rep=rep)) / len(copies)
        else:
            t = time.perf_counter()
            fn()
            row["ms"] = (time.perf_counter() - t) * 1e3 / len(copies)
    except Exception as exc:  # noqa: BLE001 - a config that cannot run is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"


def _label(r):
    cfg = "auto" if r["config"] == "auto" else "({},{},{})".format(*r["config"])
    return f"{cfg} bm{r['block_m']} w{r['waves'][0] or '-'} s{r['splits']}"


def summarize(best_rows, copy_gbps):
    print(f"summary (copy {copy_gbps:.0f} GB/s; frac = GB/s / copy):\n"
          f"{'B':>2} {'kv':>6} {'q':>2} | {'best':<28} {'ms':>7} {'frac':>5} | auto frac",
          flush=True)  # fmt: skip
    for p, best, auto in best_rows:
        b = f"{_label(best):<28} {best['ms']:7.3f} {best['frac']:5.2f}" if best else "-"
        a = f"{auto['frac']:.2f} {auto.get('picked', '')}" if auto and "frac" in auto else "-"
        print(f"{p[0]:>2} {p[1]:>6} {p[2]:>2} | {b} | {a}", flush=True)


def run(args) -> dict:
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("kernel_sweep needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    device = torch.device("cuda" if cuda else "cpu")
    shape = SHAPE if cuda else SMOKE_SHAPE
    if args.shape:
        shape = dict(shape, **dict(zip(("heads", "kv_heads", "head_dim"), args.shape, strict=True)))
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:  # one 8-warp config: 64- and 128-row tiles, tails, several splits
        configs, waves, rep, points, control = [(32, 8, 1)], (1, 2), 1, SMOKE_POINTS, (1, 200, 1)
    else:
        configs = args.configs or (QUICK if args.quick else CANDIDATES)
        waves = args.waves or (QUICK_WAVES if args.quick else WAVES)
        points, control = QUICK_POINTS if args.quick else POINTS, CONTROL
        points = args.points or points
        rep = args.rep or (10.0 if args.quick else 15.0)
    deadline = args.time_limit - 3.0  # leave time for the summary and the JSON
    auto = not args.quick  # autotuning a point costs ~1 s plus compiles: not in --quick
    point_rows = [(control, plan_rows(control, [CONTROL_CONFIG], waves, shape, device, auto))]
    block_ms = args.block_m or (None,)
    point_rows += [(p, plan_rows(p, configs, waves, shape, device, auto, bool(args.waves),
                                 block_ms)) for p in points]  # fmt: skip
    notes, n_rows = [], sum(len(r) for _, r in point_rows)
    if cuda and args.workers > 0:
        jobs = compile_jobs(point_rows, shape, device)
        workers = min(args.workers, len(jobs))
        print(f"[{_elapsed():5.1f}s] {n_rows} rows to time; compiling {len(jobs)} variants "
              f"in {workers} processes", flush=True)  # fmt: skip
        notes += precompile(jobs, workers, min(deadline * 0.6, _elapsed() + 60))
    from bench.kernels import copies_for, measure_copy_gbps

    copy_gbps = measure_copy_gbps() if cuda else 1.0  # smoke: frac means nothing on CPU
    print(f"[{_elapsed():5.1f}s] copy {copy_gbps:.0f} GB/s", flush=True)
    from splitflash.kernels.paged_attention_ref import paged_attention_ref

    scale = shape["head_dim"] ** -0.5
    all_rows, best_rows, truncated = [], [], False
    for point, rows in point_rows:
        if _elapsed() > deadline:
            truncated = True
            break
        batch, kv_len, q_len = point
        kv_bytes = 2 * batch * kv_len * shape["kv_heads"] * shape["head_dim"] * dtype.itemsize
        n_copies = copies_for(kv_bytes, args.l2) if cuda else 1
        copies = [_inputs(batch, kv_len, q_len, shape, dtype, cuda, args.layout, seed)
                  for seed in range(n_copies)]  # fmt: skip
        ref = paged_attention_ref(*copies[0], scale)
        for row in rows:
            if _elapsed() > deadline:
                truncated = True
                break
            row.update(batch=batch, kv_len=kv_len, q_len=q_len)
            row["input_copies"] = n_copies
            time_row(row, point, copies, ref, scale, rep, cuda)
            if "ms" in row:
                row["gbps"] = kv_bytes / (row["ms"] * 1e-3) / 1e9
                row["frac"] = row["gbps"] / copy_gbps
                row["suspect"] = not row["rel_err"] <= 0.1  # also catches nan
            all_rows.append(row)
        ok = [r for r in rows if "ms" in r and not r["suspect"] and r["config"] != "auto"]
        auto = next((r for r in rows if r["config"] == "auto" and "ms" in r), None)
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        best_rows.append((point, best, auto))
        desc = f"{_label(best)}: {best['ms']:.3f} ms {best['gbps']:.0f} GB/s " \
               f"{best['frac']:.2f} of copy" if best else "no config ran"  # fmt: skip
        extra = f" | auto {auto['frac']:.2f}" if auto else ""
        print(f"[{_elapsed():5.1f}s] B={batch} kv={kv_len} q={q_len}: best {desc}{extra}",
              flush=True)  # fmt: skip
        del copies, ref
        if cuda:
            torch.cuda.empty_cache()
    if truncated:
        notes.append(f"stopped at the time limit ({args.time_limit:.0f} s)")
    notes += [f"{_label(r)} @ {r['batch']},{r['kv_len']},{r['q_len']}: "
              f"{r.get('error', 'suspect numerics')}"
              for r in all_rows if "error" in r or r.get("suspect")]  # fmt: skip
    device = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    best = [dict(point=list(p), best=b, auto=a) for p, b, a in best_rows]
    return dict(device=device, copy_gbps=copy_gbps, shape=shape, layout=args.layout, l2=args.l2,
                truncated=truncated,
                notes=notes, elapsed_s=_elapsed(), rows=all_rows, best=best)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("sweep.json"))
    ap.add_argument("--quick", action="store_true", help="4 configs, waves 1/2/4, 6 points")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny")
    ap.add_argument("--time-limit", type=float, default=140.0, help="seconds from start")
    ap.add_argument("--rep", type=float, default=None, help="do_bench_cudagraph rep, ms "
                    "(default 15, --quick 10)")  # fmt: skip
    ap.add_argument(
        "--shape",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        help="H,H_KV,D instead of 32,8,128 (e.g. 9,3,64: SmolLM2-135M)",
    )
    ap.add_argument(
        "--points",
        nargs="+",
        help="B:KV:Q points instead of the default set",
        type=lambda t: tuple(int(x) for x in t.split(":")),
    )
    ap.add_argument("--waves", type=float, nargs="+",
                    help="programs per SM to try (q_len 1 too) instead of 1 2 4 8")  # fmt: skip
    ap.add_argument("--block-m", type=int, nargs="+",
                    help="query rows per program to try (16 32 64; 128 with 8 warps) instead "
                    "of the kernel's pick")  # fmt: skip
    ap.add_argument(
        "--configs",
        nargs="+",
        help="BLOCK_N,warps,stages configs instead of the candidate set (e.g. 128,4,3)",
        type=lambda t: tuple(int(x) for x in t.split(",")),
    )
    ap.add_argument(
        "--layout",
        default="head",
        choices=["head", "token"],
        help="page storage: head-major (PagedKVCache's) or token-major",
    )
    ap.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument(
        "--l2",
        default="cold",
        choices=["cold", "warm"],
        help="cold: rotate input copies past L2 (bench.kernels); warm: one copy",
    )
    a = ap.parse_args(argv)
    if a.smoke and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--smoke runs in the interpreter: set TRITON_INTERPRET=1")
    result = run(a)
    for note in result["notes"][:3]:
        print("note:", note, flush=True)
    if len(result["notes"]) > 3:
        print(f"note: {len(result['notes']) - 3} more in the JSON", flush=True)
    summarize([(b["point"], b["best"], b["auto"]) for b in result["best"]], result["copy_gbps"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {len(result['rows'])} rows to {a.out} ({_elapsed():.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
