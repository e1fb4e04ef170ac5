"""Gateway detokenisation cost against the response length (CPU, the default model's
tokenizer): total time of `TextStream.push` over a response of n tokens committed 2 at a
time (a speculative step's usual commit), and the time of the last push.

    python -m bench.textstream --tokens 1024 8192 32768
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from splitflash.models import store
    from splitflash.models.loading import load_tokenizer
    from splitflash.services.gateway.textstream import TextStream

    p = argparse.ArgumentParser(prog="python -m bench.textstream", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--commit", type=int, default=2)
    args = p.parse_args(argv)
    tok = load_tokenizer(store.pull(store.DEFAULT_TARGET, log=lambda *_: None))
    text = "Un café, s'il vous plaît! 東京 naïve ☕ fin — the quick brown fox. " * 4000
    source = tok.encode(text, add_special_tokens=False)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    print(f"{'tokens':>7} {'all pushes s':>13} {'last push ms':>13}")
    for n in args.tokens:
        ids = source[:n]
        stream = TextStream(decode, ("</stop>",))
        start = time.perf_counter()
        last = 0.0
        for i in range(0, n, args.commit):
            t = time.perf_counter()
            stream.push(ids[i : i + args.commit])
            last = time.perf_counter() - t
        total = time.perf_counter() - start
        print(f"{n:>7} {total:>13.3f} {last * 1e3:>13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
