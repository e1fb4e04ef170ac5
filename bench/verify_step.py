"""End-to-end verify step of a model shape on the GPU: eager vs CUDA graph, against the
step's bytes floor (issue 5). CUDA only.

The model is SmolLM2-135M's shape (30 layers, D 576, 9 q / 3 kv heads of 64, vocab 49152),
or Llama-3-8B's with `--shape llama3-8b`, with random bf16 weights: a step's time depends
on shapes, not on weight values, so the real GGUF need not travel. A request's KV is filled
with random values up to the context length instead of a prefill (185k tokens are past the
model's trained context anyway). One step = TargetEngine._verify_spans' forward: embed,
every layer, all-row logits and features.

Bytes floor = (weights read once + KV of the context read once) / copy bandwidth measured in
the same run. Times are medians of CUDA-event timings after warm-up.

    python -m bench.verify_step --json-out verify_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SMOLLM2 = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
               rms_norm_eps=1e-5, max_position_embeddings=8192)  # fmt: skip
# A production-scale shape (Llama-3-8B's: 32 layers, D 4096, 32 q / 8 kv heads of 128,
# untied 128k vocab): at this size a step's floor is ~15 GB of weights plus the KV, and the
# per-kernel latency that dominates the 135M model's short steps is small beside it.
LLAMA3_8B = dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 max_position_embeddings=131072)  # fmt: skip
SHAPES = {"smollm2-135m": SMOLLM2, "llama3-8b": LLAMA3_8B}


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose features verify returns for a DFlash drafter: the shipped drafter's
    five for SmolLM2's 30 layers, five spread the same way for other depths."""
    if num_layers == SMOLLM2["num_layers"]:
        return (2, 8, 14, 21, 27)  # what the shipped DFlash drafter asks verify for
    return tuple(round(1 + i * (num_layers - 3) / 4) for i in range(5))


def _median_ms(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _host_ms(fn, reps: int) -> float:
    """Median wall ms of fn() from an idle GPU to its work done (host + transfers)."""
    import torch

    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times[3:])[reps // 2]


def _engine(context: int, batch: int, page: int, invariant: bool = False,
            shape: str = "smollm2-135m"):  # fmt: skip
    import torch

    from splitflash.models.config import TargetConfig
    from splitflash.models.graphs import VerifyGraphs
    from splitflash.models.kv_cache import PagedKVCache
    from splitflash.models.target import TargetModel
    from splitflash.services.verify.engine import TargetEngine

    cfg = TargetConfig(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):  # built and filled on the GPU: an 8B shape in seconds
        model = TargetModel(cfg)
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.02)
    model = model.to(dtype=torch.bfloat16).eval()
    torch.cuda.empty_cache()  # the fp32 weights are garbage now
    model.batch_invariant = invariant  # TargetModel: rows computed the same in any step
    pages = 2 * batch * (-(-(context + 2048) // page)) + 8  # bench requests + live ones
    cache = PagedKVCache(cfg.num_layers, pages, page, cfg.num_kv_heads, cfg.head_dim,
                         dtype=torch.bfloat16, device="cuda", scratch_pages=64 // page)  # fmt: skip
    cache.k.normal_()
    cache.v.normal_()
    graphs = VerifyGraphs(model, cache, (1, 2, 4, 8, 16, 32))
    features = feature_layers(cfg.num_layers)
    return TargetEngine(model, cache, features, max_context=1 << 30, graphs=graphs)


def _engine_step_ms(engine, batch: int, q_len: int, reps: int, mixed: bool = False) -> float:
    """Wall time of TargetEngine.verify (host work, forward, acceptance) on live sequences
    whose KV is the random context: what the verify server spends per step. mixed: request b
    drafts q_len - 1 - b % q_len tokens (an n-gram drafter's varying lengths)."""
    import torch

    from splitflash.services.verify.engine import Sequence, VerifyInput
    from splitflash.services.verify.sampling import Sampling, make_generator

    rids = []
    for b in range(batch):
        rid = f"live{b}-{len(engine.seqs)}"
        ctx = engine.cache.seq(f"r{b}").length or 0
        engine.cache.add(rid)
        engine.cache.reserve(rid, ctx)
        engine.cache.seq(rid).length = ctx
        engine.seqs[rid] = Sequence(rid, [1] * (ctx + 1), Sampling(), make_generator(None),
                                    frozenset())  # fmt: skip
        rids.append(rid)
    times = []
    for i in range(reps + 3):
        n_drafts = [q_len - 1 - (b % q_len if mixed else 0) for b in range(batch)]
        items = [VerifyInput(r, len(engine.seqs[r].tokens), [7] * n, 1 << 30)
                 for r, n in zip(rids, n_drafts, strict=True)]  # fmt: skip
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.verify(items)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t) * 1e3)
    for r in rids:
        engine.release(r)
    return sorted(times)[len(times) // 2]


def _run_host_us(engine, step, ids, entry, reps: int) -> dict:
    """Median host microseconds of the parts of VerifyGraphs.run before and around the
    replay, each timed alone on an idle GPU (no sync inside the timed span): what the
    graph figure spends beyond the replay's own GPU time."""
    import torch

    from splitflash.models.step_inputs import pack

    graphs = engine.graphs
    key = graphs.key_for(step.q_lens, step.kv_lens)
    width = engine.cache.pages_for(key[2])
    parts = {
        "pack": lambda: pack(step, width, pin=True),
        "load": lambda: graphs._load(entry.buf, step, key),
        "replay_call": entry.graph.replay,
        "run_call": lambda: graphs.run(step, ids),
        "sync_idle": torch.cuda.synchronize,
    }
    out = {}
    for name, fn in parts.items():
        times = []
        for _ in range(reps + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        out[name] = sorted(times[3:])[reps // 2]
    print("    host us: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def kernel_profile(fn, steps: int = 5, top: int = 14) -> dict:
    """GPU time per step of each kernel (torch.profiler/CUPTI) over `steps` calls of fn:
    where a step's time goes. Kernel durations are the same eager or replayed; the gap
    between their sum and the graph's wall time is launch/dependency latency."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name.setdefault(ev.name[:60], []).append(ev.device_time_total / steps)
    rows = sorted(((sum(t), len(t) / steps, n) for n, t in per_name.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"    kernels per step: {sum(r[1] for r in rows):.0f}, GPU busy {total / 1e3:.3f} ms")
    for us, count, name in rows[:top]:
        print(f"    {us:9.1f} us {count:5.0f}x  {name}")
    return dict(busy_ms=total / 1e3, kernels=[dict(us=u, count=c, name=n) for u, c, n in rows])


def measure(
    context: int,
    batch: int,
    q_len: int,
    copy_gbps: float,
    reps: int,
    page: int = 16,
    profile: bool = False,
    invariant: bool = False,
    shape: str = "smollm2-135m",
    mixed: bool = False,
    breakdown: bool = False,
):
    """One row: eager and graphed step times at `context` keys per request (mixed: the
    engine.verify steps draft mixed lengths, see _engine_step_ms)."""
    import torch

    engine = _engine(context, batch, page, invariant, shape)
    cfg, cache = engine.model.cfg, engine.cache
    spans = []
    for b in range(batch):
        rid = f"r{b}"
        cache.add(rid)
        cache.reserve(rid, context + q_len)
        cache.seq(rid).length = context  # the random KV stands for `context` tokens
        spans.append((rid, [b + 1] * q_len, context))  # q_len new tokens after the context
    step = engine._step_host(spans)
    batch_in = engine._batch(spans)
    ids = engine.feature_layer_ids
    batch_ms = _host_ms(lambda: engine._batch(spans), reps)  # the step's inputs to the GPU
    with torch.inference_mode():
        eager_ms = _median_ms(lambda: engine.model(batch_in, cache, None, ids), reps)
        engine.graphs.run(step, ids)  # capture
        graph_ms = _median_ms(lambda: engine.graphs.run(step, ids), reps)
        entry = next(iter(engine.graphs._graphs.values()))
        replay_ms = _median_ms(entry.graph.replay, reps) if entry.graph else float("nan")
        host = _run_host_us(engine, step, ids, entry, reps) if breakdown else None
        step_ms = _engine_step_ms(engine, batch, q_len, reps, mixed)
        saved, engine.graphs = engine.graphs, None
        eager_step_ms = _engine_step_ms(engine, batch, q_len, reps, mixed)
        engine.graphs = saved
        prof = None
        if profile:
            print(f"  profile ctx {context} B {batch} q {q_len}, eager forward:")
            prof = kernel_profile(lambda: engine.model(batch_in, cache, None, ids))
            if entry.graph:  # CUPTI may or may not see the kernels inside a replay
                print("  graph replay:")
                prof["replay"] = kernel_profile(entry.graph.replay, top=4)

    # Weights a step reads: all but an untied embedding table, of which it reads q_len rows
    # (a tied one is read whole as the LM head).
    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    weight_bytes = sum(nbytes(p) for p in engine.model.parameters())
    if not cfg.tie_word_embeddings:
        weight_bytes -= nbytes(engine.model.embed_tokens.weight)
    kv_bytes = batch * context * cfg.kv_bytes_per_token(2)
    floor_ms = (weight_bytes + kv_bytes) / (copy_gbps * 1e9) * 1e3
    row = dict(shape=shape, context=context, batch=batch, q_len=q_len, eager_ms=eager_ms,
               graph_ms=graph_ms, batch_ms=batch_ms,
               replay_ms=replay_ms, step_ms=step_ms, eager_step_ms=eager_step_ms,
               weight_mb=weight_bytes / 1e6, kv_mb=kv_bytes / 1e6,
               floor_ms=floor_ms, graph_over_floor=graph_ms / floor_ms, profile=prof,
               host_us=host)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.kernels import measure_copy_gbps

    p = argparse.ArgumentParser(prog="python -m bench.verify_step", description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 185_000])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--q-lens", type=int, nargs="+", default=[16, 1])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json-out", default=None)
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time of a step")
    p.add_argument("--breakdown", action="store_true",
                   help="host us of the graph path: pack, load, replay")  # fmt: skip
    p.add_argument("--mixed-drafts", action="store_true",
                   help="engine.verify steps whose requests draft different lengths")  # fmt: skip
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant steps (TargetModel.batch_invariant)")  # fmt: skip
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="smollm2-135m",
        help="model shape with random bf16 weights (default: the default model's)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.verify_step needs a CUDA GPU")
    t0 = time.perf_counter()
    copy = measure_copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s", flush=True)
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            for q in args.q_lens:
                r = measure(ctx, b, q, copy, args.reps, profile=args.profile,
                            invariant=args.batch_invariant, shape=args.shape,
                            mixed=args.mixed_drafts, breakdown=args.breakdown)  # fmt: skip
                r["batch_invariant"], r["mixed_drafts"] = args.batch_invariant, args.mixed_drafts
                torch.cuda.empty_cache()  # the last engine's KV pool is garbage now
                rows.append(r)
                print(f"[{time.perf_counter() - t0:6.1f}s] ctx {ctx} B {b} q {q}: eager "
                      f"{r['eager_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms (replay "
                      f"{r['replay_ms']:.3f}), floor {r['floor_ms']:.3f} ms -> "
                      f"{r['graph_over_floor']:.2f}x floor; engine.verify {r['step_ms']:.3f} ms "
                      f"(eager {r['eager_step_ms']:.3f}, _batch {r['batch_ms']:.3f})",
                      flush=True)  # fmt: skip
                if args.json_out:  # after every row: a run cut off by a time limit keeps its rows
                    with open(args.json_out, "w") as f:
                        json.dump({"copy_gbps": copy, "rows": rows}, f, indent=2)
    print(
        " context  B   q   eager ms   graph ms  replay ms   floor ms  graph/floor"
        "  verify() ms  eager verify() ms  _batch ms"
    )
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>2} {r['q_len']:>3} {r['eager_ms']:>10.3f} "
              f"{r['graph_ms']:>10.3f} {r['replay_ms']:>10.3f} {r['floor_ms']:>10.3f} "
              f"{r['graph_over_floor']:>11.2f} {r['step_ms']:>12.3f} "
              f"{r['eager_step_ms']:>18.3f} {r['batch_ms']:>10.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
