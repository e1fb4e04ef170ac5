"""The first step of a CUDA-graph key not yet captured against a replay of it: how long a live
request stalls when verify or the drafter meets a new shape (issue 5, item 4).

Verify: the default model's shape with random weights (as bench.verify_step), one request.
At each context (each in a new KV bucket) three first steps: a draft block (q 16), a short
block (q 8: blocks are padded to a power of two) and a decode step (q 1). Draft: the
shipped drafter with a random target head (as bench.draft_graphs), one request whose
context grows into each new bucket. A first key of each kind at 300 tokens compiles the
kernels and is reported apart. Times are wall ms from an idle GPU to the step's work done;
a repeat is the median of 5; mem_mb: CUDA memory a verify first step left allocated (its
graph's static buffers and outputs). --warmup runs the services' start-up warm-ups first
(their seconds are reported); with --late-layers the verify warm-up runs without feature
layers, as at a service's start, then the layers arrive (a drafter's Hello) and the idle
warm-up (IdleWarmUp) runs for them.

    python -m bench.first_step --contexts 3000 20000 100000 --json-out first_step.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

WARM_CONTEXT = 300  # the first key of a process: every kernel compiles here


def _wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _first_and_repeat(fn) -> tuple[float, float]:
    first = _wall_ms(fn)
    return first, sorted(_wall_ms(fn) for _ in range(5))[2]


def verify_rows(contexts: list[int], q_lens: list[int], warmup: bool, late: bool) -> list[dict]:
    from bench.verify_step import _engine
    from splitflash.services.verify.warmup import IdleWarmUp, warm_up

    engine = _engine(max(contexts) + 64, 1, 16)
    cache, ids = engine.cache, engine.feature_layer_ids
    if late:
        engine.feature_layer_ids = ()
    rows = [dict(part="verify", warmup_s=warm_up(engine))] if warmup else []
    engine.feature_layer_ids = ids
    if late and warmup:
        idle, t0 = IdleWarmUp(engine), time.perf_counter()
        while not idle.done:
            idle.run_one()
        rows.append(dict(part="verify late layers", warmup_s=time.perf_counter() - t0))
    cache.add("r")
    cache.reserve("r", max(contexts) + 64)
    with torch.inference_mode():
        for ctx in [WARM_CONTEXT, *contexts]:
            cache.seq("r").length = ctx  # the random KV stands for `ctx` tokens
            for q in q_lens:
                step = engine._step_host([("r", [1] * q, ctx)])
                held = torch.cuda.memory_allocated()
                first, repeat = _first_and_repeat(lambda s=step: engine.graphs.run(s, ids))
                mem_mb = (torch.cuda.memory_allocated() - held) / 1e6
                rows.append(dict(part="verify", context=ctx, q=q, first_ms=first,
                                 repeat_ms=repeat, mem_mb=mem_mb))  # fmt: skip
                print(f"  verify ctx {ctx} q {q}: first {first:.1f} ms, repeat {repeat:.3f} ms,"
                      f" {mem_mb:.1f} MB held", flush=True)  # fmt: skip
    return rows


def draft_rows(contexts: list[int], block: int, warmup: bool) -> list[dict]:
    from bench.draft_graphs import _drafter
    from splitflash.models.dflash.graphs import DraftGraphs
    from splitflash.models.dflash.pool import DraftKVPool
    from splitflash.services.draft.dflash_drafter import DFlashProposer
    from splitflash.services.draft.warmup import warm_up

    drafter = _drafter(torch.device("cuda"), torch.bfloat16)
    pool = DraftKVPool(drafter, slots=1, context=max(contexts) + 2 * block)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1,))
    rows = []
    if warmup:
        rows.append(dict(part="draft", warmup_s=warm_up(DFlashProposer(drafter, pool, graphs))))
    state = pool.new_state()
    gen = torch.Generator(device="cuda").manual_seed(0)
    filled = 0
    for ctx in [WARM_CONTEXT, *contexts]:
        while filled < ctx:  # random context features up to ctx, in chunks
            n = min(8192, ctx - filled)
            f = torch.randn(n, drafter.config.feature_dim, generator=gen, device="cuda")
            drafter.append_context(state, f.to(torch.bfloat16), filled)
            filled += n
        first, repeat = _first_and_repeat(lambda c=ctx: graphs.run([state], [1], [c], block))
        rows.append(dict(part="draft", context=ctx, q=block, first_ms=first, repeat_ms=repeat))
        print(f"  draft ctx {ctx}: first {first:.1f} ms, repeat {repeat:.3f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.first_step", description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[3000, 20000, 100000])
    p.add_argument("--q-lens", type=int, nargs="+", default=[16, 8, 1])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", action="store_true", help="the services' warm-ups first")
    p.add_argument(
        "--late-layers",
        action="store_true",
        help="verify's feature layers arrive after its warm-up (a drafter's Hello)",
    )
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.first_step needs a CUDA GPU")
    rows = verify_rows(args.contexts, args.q_lens, args.warmup, args.late_layers)
    torch.cuda.empty_cache()
    rows += draft_rows(args.contexts, args.block_size, args.warmup)
    for r in (r for r in rows if "warmup_s" in r):
        print(f"  {r['part']} warm-up: {r['warmup_s']:.1f} s")
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        args.json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
