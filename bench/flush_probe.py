"""How long a DFlash proposal takes after n steps without one (the speculation gate paused
drafting): the n pending feature rows are written first. Random features, the shipped
drafter over the given target's embedding; prints propose ms per n (median of --reps).

    python -m bench.flush_probe --target PATH --device cuda
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    import torch

    from splitflash.services.draft.dflash_loading import build_dflash_drafter

    p = argparse.ArgumentParser(prog="python -m bench.flush_probe", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=1400)
    p.add_argument("--pauses", type=int, nargs="+", default=[0, 1, 8, 32, 64, 256])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    room = args.context + max(args.pauses) * (args.reps + 2) + 64
    prop = build_dflash_drafter(None, args.target, args.device, pool_slots=1,
                                pool_context=room, cuda_graphs=True)  # fmt: skip
    dim, dtype = prop.drafter.config.feature_dim, prop.drafter.fc.weight.dtype
    rows = lambda n: torch.randn(n, dim, device=args.device, dtype=dtype)  # noqa: E731
    ids = list(range(100, 100 + args.context))
    prop.open("r", ids)
    prop.add_features("r", 0, rows(len(ids) - 1))
    for pause in args.pauses:
        times = []
        for _ in range(args.reps + 1):  # the first rep compiles / captures: not counted
            for _step in range(pause):  # plain steps: a committed token and its row each
                held = len(ids)
                ids.append(7)
                prop.extend("r", [7], len(ids))
                prop.add_features("r", held - 1, rows(1))
            held = len(ids)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            prop.propose("r", 7)
            times.append((time.perf_counter() - t0) * 1e3)
            ids.append(7)  # the speculative step commits one token
            prop.extend("r", [7], len(ids))
            prop.add_features("r", held - 1, rows(1))
        t = sorted(times[1:])
        print(f"after {pause:4d} paused steps: propose {t[len(t) // 2]:7.3f} ms "
              f"(min {t[0]:.3f}, first {times[0]:.3f})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
