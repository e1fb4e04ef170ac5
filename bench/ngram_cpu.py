"""Target-only vs n-gram speculative decoding in one process, side by side (CPU or GPU).

    python -m bench.ngram_cpu [--max-tokens 128] [--repeats 3]

Prints tokens/s of both, their ratio, the pooled speculative stats, and checks that the
outputs are identical (greedy is lossless).
"""

from __future__ import annotations

import argparse
import json

from splitflash.cli.generate import encode_prompt, stop_token_ids
from splitflash.local import generate_local, open_local
from splitflash.models import store
from splitflash.services.common.spec_stats import SpecStats
from splitflash.services.draft.ngram import NgramDrafter

PROMPTS = [
    "Repeat the following list exactly three times, one item per line: apples, pears, "
    "plums, cherries, grapes.",
    "Copy this sentence five times: the quick brown fox jumps over the lazy dog.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    engine, tok = open_local(store.DEFAULT_TARGET, args.device, kv_pages=256)
    stops = stop_token_ids(tok, engine.model.cfg)
    seconds = {"target_only": 0.0, "ngram": 0.0}
    tokens = {"target_only": 0, "ngram": 0}
    pooled = SpecStats()
    for _ in range(args.repeats):
        for prompt in PROMPTS:  # interleaved, so drift hits both sides alike
            ids = encode_prompt(tok, prompt, chat=True)
            plain = generate_local(engine, None, ids, args.max_tokens, stop_ids=stops)
            spec = generate_local(
                engine,
                NgramDrafter(),
                ids,
                args.max_tokens,
                stop_ids=stops,
                block_size=args.block_size,
            )
            if spec.token_ids != plain.token_ids:
                raise SystemExit("speculative output differs from target-only output")
            for name, gen in (("target_only", plain), ("ngram", spec)):
                seconds[name] += gen.seconds
                tokens[name] += len(gen.token_ids)
            pooled.merge(spec.stats)
    tps = {k: tokens[k] / seconds[k] for k in seconds}
    print(
        json.dumps(
            {
                "tokens_per_second": {k: round(v, 2) for k, v in tps.items()},
                "speedup": round(tps["ngram"] / tps["target_only"], 3),
                "tokens": tokens,
                "speculative_decoding_stats": pooled.to_dict(),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
