"""GPU memory one captured verify CUDA graph holds, by padded batch, block length and KV
bucket: what sizes `SPLITFLASH_VERIFY_GRAPH_MAX_HELD` (the LRU of graphs). A graph keeps its
static inputs, and its intermediates in the shared graph pool; its outputs (fp32 logits
[B_pad * Q, vocab] and the features) are shared by every graph of one padded row count
(models/graphs.py), so the first graph of a row count adds them and a graph of the same
rows at another KV bucket (the second of `--contexts`) should add little.

The default model's shape (or --shape llama3-8b) with random weights, as bench.verify_step;
B requests at each context of --contexts; one capture per (B_pad, Q, context), each read as
what it adds: held MB = torch.cuda.memory_allocated() after the capture minus before (what
the graph keeps live; the step's outputs are copied out and freed before the reading),
reserved MB likewise for the allocator's pool; logits MB = B_pad * Q * vocab * 4 bytes, the
arithmetic beside it.

    python -m bench.graph_memory --json-out graph_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def measure(shape: str, batches: list[int], q_lens: list[int], contexts: list[int]) -> list[dict]:
    from bench.verify_step import _engine

    top = max(contexts)
    engine = _engine(top + 64, max(batches), 16, shape=shape)
    vocab = engine.model.cfg.vocab_size
    for b in range(max(batches)):
        engine.cache.add(f"r{b}")
        engine.cache.reserve(f"r{b}", top + 64)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            for q in q_lens:
                for context in contexts:
                    for b in range(batch):  # the random KV stands for the context
                        engine.cache.seq(f"r{b}").length = context
                    items = [(f"r{b}", [1] * q, context) for b in range(batch)]
                    step = engine._step_host(items)
                    torch.cuda.synchronize()
                    held, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                    engine.graphs.run(step, engine.feature_layer_ids)
                    torch.cuda.synchronize()
                    row = dict(batch=batch, q=q, context=context, captures=engine.graphs.captures,
                               held_mb=(torch.cuda.memory_allocated() - held) / 1e6,
                               reserved_mb=(torch.cuda.memory_reserved() - reserved) / 1e6,
                               logits_mb=batch * q * vocab * 4 / 1e6)  # fmt: skip
                    rows.append(row)
                    print(f"  B {batch:>2} q {q:>2} ctx {context:>6}: held {row['held_mb']:8.1f} "
                          f"MB, reserved {row['reserved_mb']:8.1f} MB, logits "
                          f"{row['logits_mb']:7.1f} MB", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.graph_memory", description=__doc__)
    p.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", "llama3-8b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--q-lens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 3000])
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.graph_memory needs a CUDA GPU")
    rows = measure(args.shape, args.batches, args.q_lens, args.contexts)
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    shape=args.shape, contexts=args.contexts)  # fmt: skip
        args.json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
