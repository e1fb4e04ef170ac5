"""Host work of one verify step against the context length (CPU; no forward is run).

`TargetEngine._batch` turns a step's spans into device tensors: token ids, positions, KV
slots, the page table. Its cost must follow the block, not the context: a verify step at
185k tokens has the same 16 new tokens as one at 512. This times it (and the KV cache's
slot / page-table lookups inside it) for one request with a 16-token block at each context.

    python -m bench.host_step --contexts 512 32768 185000
"""

from __future__ import annotations

import argparse
import sys
import time


def _per_call_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / reps


def main(argv: list[str] | None = None) -> int:
    from splitflash.models.config import TargetConfig
    from splitflash.models.kv_cache import PagedKVCache
    from splitflash.models.target import TargetModel
    from splitflash.services.verify.engine import TargetEngine

    p = argparse.ArgumentParser(prog="python -m bench.host_step", description=__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 32768, 185_000])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    # The model is never run: a one-layer stand-in only gives the engine its config.
    cfg = TargetConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    model = TargetModel(cfg)
    print(f"{'context':>8} {'_batch ms':>10} {'slots ms':>9} {'page_table ms':>14}")
    for ctx in args.contexts:
        pages = -(-(ctx + args.block) // args.page_size) + 1
        cache = PagedKVCache(1, pages, args.page_size, cfg.num_kv_heads, cfg.head_dim)
        engine = TargetEngine(model, cache)
        cache.add("r")
        cache.reserve("r", ctx + args.block)
        cache.seq("r").length = ctx
        spans = [("r", [1] * args.block, ctx)]
        batch_ms = _per_call_ms(lambda s=spans, e=engine: e._batch(s), args.reps)
        slots_ms = _per_call_ms(lambda c=cache, x=ctx: c.slots("r", x, x + args.block),
                                args.reps)  # fmt: skip
        table_ms = _per_call_ms(lambda c=cache: c.page_table(["r"], "cpu"), args.reps)
        print(f"{ctx:>8} {batch_ms:>10.3f} {slots_ms:>9.3f} {table_ms:>14.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
