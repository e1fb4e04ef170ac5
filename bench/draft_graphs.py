"""DFlash draft step on the GPU, three ways side by side (issue 5): per-request eager (one
attention call per request per layer, the unpooled path), pooled eager (DraftKVPool: one
call per layer for the batch) and the CUDA graph of the pooled step (DraftGraphs).

The shipped SmolLM2 drafter (3 layers: 2 sliding W=512, 1 full) with a random target
embedding and LM head of the real shapes (time depends on shapes only) and random context
features. Times are medians of CUDA-event timings of whole draft_batch / graphs.run calls
(host work included: what the draft service spends per step), after warm-up; every way's
logits are checked against the per-request eager ones.

    python -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 --json-out dg.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

ASSET = Path(__file__).resolve().parents[1] / "splitflash/assets/drafters/smollm2-135m-dflash"


def _median_ms(fn, reps: int) -> float:
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


def _drafter(device, dtype):
    from splitflash.models.dflash import load_dflash
    from splitflash.models.dflash.config import DFlashConfig

    cfg = DFlashConfig.from_json(ASSET / "config.json")
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    return load_dflash(ASSET, embed, head, cfg.num_target_layers, dtype, device)


def _fill(drafter, state, n_ctx: int, gen, chunk: int = 8192) -> None:
    w = drafter.fc.weight
    for lo in range(0, n_ctx, chunk):
        n = min(chunk, n_ctx - lo)
        f = torch.randn(n, drafter.config.feature_dim, generator=gen, device=w.device)
        drafter.append_context(state, f.to(w.dtype), lo)


def measure(drafter, n_ctx: int, batch: int, block: int, reps: int) -> dict:
    from splitflash.models.dflash.graphs import DraftGraphs
    from splitflash.models.dflash.pool import DraftKVPool

    pool = DraftKVPool(drafter, slots=batch, context=max(n_ctx, 16))
    graphs = DraftGraphs(drafter, pool, batch_sizes=(batch,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    plain, pooled = [], []
    for _ in range(batch):  # the same context into a plain and a pooled state
        seed = int(torch.randint(0, 1 << 30, (1,), generator=gen, device="cuda"))
        for states, new in ((plain, drafter.new_state), (pooled, pool.new_state)):
            states.append(new())
            _fill(drafter, states[-1], n_ctx, torch.Generator(device="cuda").manual_seed(seed))
    anchors, positions = list(range(1, batch + 1)), [n_ctx] * batch
    want = drafter.draft_batch(plain, anchors, positions, block)
    got = {"pooled": drafter.draft_batch(pooled, anchors, positions, block, pool=pool),
           "graph": graphs.run(pooled, anchors, positions, block)}  # fmt: skip
    err = {k: (v.float() - want.float()).abs().max().item() for k, v in got.items()}
    replay = next(iter(graphs._graphs.values())).graph.replay
    ways = {
        "per_request_ms": lambda: drafter.draft_batch(plain, anchors, positions, block),
        "pooled_ms": lambda: drafter.draft_batch(pooled, anchors, positions, block, pool=pool),
        "graph_ms": lambda: graphs.run(pooled, anchors, positions, block),
        "replay_ms": replay,
    }
    row = dict(context=n_ctx, batch=batch, block=block, max_abs_err=err)
    row.update({name: _median_ms(fn, reps) for name, fn in ways.items()})
    row["graph_speedup"] = row["per_request_ms"] / row["graph_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_graphs", description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.draft_graphs needs a CUDA GPU")
    drafter = _drafter(torch.device("cuda"), torch.bfloat16)
    t0, rows = time.perf_counter(), []
    for n_ctx in args.contexts:
        for b in args.batches:
            r = measure(drafter, n_ctx, b, args.block_size, args.reps)
            rows.append(r)
            torch.cuda.empty_cache()  # the last pool is garbage now
            print(f"[{time.perf_counter() - t0:6.1f}s] ctx {n_ctx} B {b}: per-request "
                  f"{r['per_request_ms']:.3f} ms, pooled {r['pooled_ms']:.3f} ms, graph "
                  f"{r['graph_ms']:.3f} ms (replay {r['replay_ms']:.3f}) -> x"
                  f"{r['graph_speedup']:.1f}; max |err| {r['max_abs_err']}",
                  flush=True)  # fmt: skip
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        args.json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
