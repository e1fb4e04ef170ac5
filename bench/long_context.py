"""Decode speed of one request against its context length: the incident's measurement.

The deployment behind splitflash fell from 118.6 tok/s at 1.4k context to 0.7 tok/s at 185k,
mean commit_len stuck at 1.00, because the drafter's sliding window was not applied. This
runs the same question on our stack: the engines built as the services build them (verify:
`load_engine`, CUDA graphs on CUDA; draft: `build_dflash_drafter`, KV pool and graphs on
CUDA), one greedy request at each context, target-only and with DFlash (window as the
checkpoint says, and optionally `off`: the incident's failure mode). Every DFlash output
must equal the target-only one token for token (lossless; the bench exits non-zero if not).

Decode tok/s = tokens committed / seconds over the steps after the first --warm-steps (graph
captures, autotuning); prefill (the prompt forward and the drafter's prompt features) is
reported apart. The context is a synthetic document of numbered records (the default model
has no long-context corpus here) and a question after it; past the model's 8k training
positions its text degrades, the same for every way compared.

    python -m bench.long_context --device cuda --contexts 1400 32768 185000 --windows checkpoint off
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUESTION = "\n\nNow write a short story about a lighthouse keeper and the sea.\n"


def build_prompt(tokenizer, n_tokens: int) -> list[int]:
    """n_tokens ids: the tail of a document of numbered records, then QUESTION."""
    tail = tokenizer.encode(QUESTION, add_special_tokens=False)
    lines, ids = [], []
    i = 0
    while len(ids) < n_tokens:  # grows geometrically: a few encodes even at 185k tokens
        more = max(64, len(lines))
        lines += [f"Record {k}: crate {k * 37 % 1009} holds {k * 11 % 97} tins of pears."
                  for k in range(i, i + more)]  # fmt: skip
        i += more
        ids = tokenizer.encode("\n".join(lines), add_special_tokens=False)
    return ids[len(ids) - (n_tokens - len(tail)) :] + tail


def decode_rate(gen, warm_steps: int) -> tuple[float, int]:
    """(tokens/s, steps timed) over the steps after the first warm_steps."""
    timed = gen.steps[warm_steps:] or gen.steps
    seconds = sum(s for s, _ in timed)
    return (sum(n for _, n in timed) / seconds if seconds > 0 else 0.0), len(timed)


def run(args) -> list[dict]:
    import torch

    from splitflash.local import generate_local
    from splitflash.models import store
    from splitflash.models.loading import load_tokenizer
    from splitflash.services.draft.dflash_drafter import build_dflash_drafter
    from splitflash.services.verify.config import VerifySettings
    from splitflash.services.verify.loader import load_engine

    room = max(args.contexts) + args.max_tokens + 64
    settings = VerifySettings(target=args.target, device=args.device,
                              kv_pages=-(-room // 16) + 64, max_context=room)  # fmt: skip
    engine = load_engine(settings)
    tokenizer = load_tokenizer(store.resolve(args.target))
    drafters = {
        w: build_dflash_drafter(args.drafter_path, args.target, args.device, window_override=w,
                                pool_slots=1, pool_context=room, cuda_graphs=True)
        for w in args.windows
    }  # fmt: skip
    engine.feature_layer_ids = next(iter(drafters.values())).target_layer_ids
    rows = []
    for ctx in args.contexts:
        prompt = build_prompt(tokenizer, ctx)
        ways = {"target-only": None} | {f"dflash ({w})": d for w, d in drafters.items()}
        ref = None
        for name, drafter in ways.items():
            gen = generate_local(engine, drafter, prompt, args.max_tokens,
                                 block_size=args.block_size)  # fmt: skip
            if ref is None:
                ref = gen.token_ids
            elif gen.token_ids != ref:
                raise SystemExit(f"{name} at {ctx} differs from target-only decoding (lossy)")
            rate, timed = decode_rate(gen, args.warm_steps)
            row = dict(context=ctx, way=name, tokens=len(gen.token_ids), decode_tok_s=rate,
                       steps_timed=timed, prefill_s=gen.prefill_seconds,
                       mean_commit_len=gen.stats.mean_commit_len,
                       violations=gen.violations)  # fmt: skip
            rows.append(row)
            print(f"ctx {ctx:>7}  {name:<18} decode {rate:8.1f} tok/s over {timed:3d} steps, "
                  f"commit_len {row['mean_commit_len']:.2f}, prefill {row['prefill_s']:.2f} s",
                  flush=True)  # fmt: skip
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter-path", default=None, help="DFlash checkpoint (default: shipped)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[1400, 32768, 185_000])
    p.add_argument("--windows", nargs="+", default=["checkpoint"], choices=["checkpoint", "off"],
                   help="drafter sliding window(s) to run")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = run(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
