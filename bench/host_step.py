"""Host work of one verify step against the context length (CPU; no forward is run).

`TargetEngine._batch` turns a step's spans into device tensors: token ids, positions, KV
slots, the page table. Its cost must follow the block, not the context: a verify step at
185k tokens has the same 16 new tokens as one at 512. This times it (and the KV cache's
slot / page-table lookups inside it) for one request with a 16-token block at each context.

`--batches` then times the host side of a whole `TargetEngine.verify` (spans, inputs,
acceptance, KV bookkeeping, reports) for B requests at once, with a stand-in forward that
returns precomputed outputs: on the GPU this work runs serially with the graph replay, so it
adds to every step. Drafts never match the stand-in's argmax (0), so each step commits one
token and the KV grows by one, as in a real step.

    python -m bench.host_step --contexts 512 32768 185000 --batches 1 8 32
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


def _verify_host_ms(batch: int, context: int, block: int, reps: int) -> float:
    """ms of host work per TargetEngine.verify of `batch` requests, forward stubbed out."""
    import torch

    from splitflash.models.config import TargetConfig
    from splitflash.models.kv_cache import PagedKVCache
    from splitflash.models.target import ForwardOutput, TargetModel
    from splitflash.services.verify.engine import Sequence, TargetEngine, VerifyInput
    from splitflash.services.verify.sampling import Sampling, make_generator

    cfg = TargetConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    model = TargetModel(cfg)
    pages = batch * (-(-(context + block + reps + 8) // 16) + 1)
    engine = TargetEngine(model, PagedKVCache(1, pages, 16, 1, 8), feature_layer_ids=(0,))
    logits, hidden = torch.zeros(batch * block, 8), torch.zeros(batch * block, 16)

    class StandIn:  # what the engine reads from a model; the forward returns fixed outputs
        cfg, embed_tokens = model.cfg, model.embed_tokens

        def __call__(self, fb, cache, rows, layer_ids):
            n = len(fb.token_ids)
            return ForwardOutput(logits[:n], hidden[:n])

    engine.model = StandIn()
    rids = [f"r{b}" for b in range(batch)]
    for rid in rids:
        engine.cache.add(rid)
        engine.cache.reserve(rid, context)
        engine.cache.seq(rid).length = context
        engine.seqs[rid] = Sequence(rid, [1] * (context + 1), Sampling(), make_generator(None),
                                    frozenset())  # fmt: skip

    def step():
        engine.verify([VerifyInput(r, len(engine.seqs[r].tokens), [7] * (block - 1), 1 << 30)
                       for r in rids])  # fmt: skip

    return _per_call_ms(step, reps)


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
    p.add_argument("--batches", type=int, nargs="*", default=[],
                   help="also time a whole verify()'s host work for these batch sizes")  # fmt: skip
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
    if args.batches:
        print(f"{'context':>8} {'B':>3} {'verify() host ms':>17} {'per request':>12}")
    for ctx in args.contexts if args.batches else []:
        for b in args.batches:
            ms = _verify_host_ms(b, ctx, args.block, max(20, args.reps // b))
            print(f"{ctx:>8} {b:>3} {ms:>17.3f} {ms / b:>12.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
