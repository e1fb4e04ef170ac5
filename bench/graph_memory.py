"""GPU memory one captured verify CUDA graph holds, by padded batch and block length: what
sizes `SPLITFLASH_VERIFY_GRAPH_MAX_HELD` (the LRU of graphs; each keeps its static inputs
and outputs in the shared graph pool, the outputs dominated by the fp32 logits
[B_pad * Q, vocab]).

The default model's shape (or --shape llama3-8b) with random weights, as bench.verify_step;
B requests at a context of --context tokens; one capture per (B_pad, Q), each read as what
it adds: held MB = torch.cuda.memory_allocated() after the capture minus before (what the
graph keeps live; the step's outputs are copied out and freed before the reading), reserved
MB likewise for the allocator's pool; logits MB = B_pad * Q * vocab * 4 bytes, the
arithmetic beside it.

    python -m bench.graph_memory --json-out graph_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def measure(shape: str, batches: list[int], q_lens: list[int], context: int) -> list[dict]:
    from bench.verify_step import _engine

    engine = _engine(context + 64, max(batches), 16, shape=shape)
    vocab = engine.model.cfg.vocab_size
    for b in range(max(batches)):
        engine.cache.add(f"r{b}")
        engine.cache.reserve(f"r{b}", context + 64)
        engine.cache.seq(f"r{b}").length = context  # the random KV stands for the context
    rows = []
    with torch.inference_mode():
        for batch in batches:
            for q in q_lens:
                step = engine._step_host([(f"r{b}", [1] * q, context) for b in range(batch)])
                torch.cuda.synchronize()
                held, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                engine.graphs.run(step, engine.feature_layer_ids)
                torch.cuda.synchronize()
                row = dict(batch=batch, q=q, captures=engine.graphs.captures,
                           held_mb=(torch.cuda.memory_allocated() - held) / 1e6,
                           reserved_mb=(torch.cuda.memory_reserved() - reserved) / 1e6,
                           logits_mb=batch * q * vocab * 4 / 1e6)  # fmt: skip
                rows.append(row)
                print(f"  B {batch:>2} q {q:>2}: held {row['held_mb']:8.1f} MB, reserved "
                      f"{row['reserved_mb']:8.1f} MB, logits {row['logits_mb']:7.1f} MB",
                      flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.graph_memory", description=__doc__)
    p.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", "llama3-8b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--q-lens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.graph_memory needs a CUDA GPU")
    rows = measure(args.shape, args.batches, args.q_lens, args.context)
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    shape=args.shape, context=args.context)  # fmt: skip
        args.json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
