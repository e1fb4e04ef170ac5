"""N short prompts prefilled one forward each against all in one packed forward
(prompt_run.advance_together, what the verify server does with Prefills open at once):
milliseconds for all N, side by side in one process, the two orders alternating. Prompt i
has tokens - i tokens (requests' prompts differ in length).

    python -m bench.prefill_pack --device cpu --prompts 8 --tokens 200        # default model
    python -m bench.prefill_pack --shape smollm2-135m --prompts 1 4 16 --tokens 200  # CUDA
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _prefill_all(engine, prompts: list[list[int]], packed: bool, cuda: bool) -> float:
    """Seconds to prefill every prompt (packed or one at a time); their pages freed after."""
    import torch

    from splitflash.services.verify.prompt_run import advance_together
    from splitflash.services.verify.sampling import Sampling

    runs = [engine.start_prefill(f"r{i}", p, Sampling(), (), 2) for i, p in enumerate(prompts)]
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    groups = [runs] if packed else [[run] for run in runs]
    for group in groups:
        while group:
            reports = advance_together([(run, None) for run in group])
            group = [run for run, r in zip(group, reports, strict=True) if r is None]
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for i in range(len(prompts)):
        engine.release(f"r{i}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.prefill import _checkpoint_setup, _random_setup

    p = argparse.ArgumentParser(prog="python -m bench.prefill_pack", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default=None, help="bench.verify_step shape, random weights (CUDA)")
    p.add_argument("--prompts", type=int, nargs="+", default=[8])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.prompts) < 1 or args.tokens <= max(args.prompts) or args.reps < 1:
        p.error("need --prompts >= 1, --tokens > the largest --prompts, --reps >= 1")
    args.contexts = [args.tokens * max(args.prompts)]  # the KV room the setups reserve
    engine, make = _random_setup(args) if args.shape else _checkpoint_setup(args)
    cuda = args.device.startswith("cuda")
    rows = []
    for n in args.prompts:
        prompts = [make(args.tokens)[: args.tokens - i] for i in range(n)]
        _prefill_all(engine, prompts, True, cuda)  # warm-up: kernels, autotuning
        _prefill_all(engine, prompts, False, cuda)
        times = {True: [], False: []}
        for rep in range(args.reps):
            for packed in (rep % 2 == 0, rep % 2 == 1):
                times[packed].append(_prefill_all(engine, prompts, packed, cuda))
        alone_ms = statistics.median(times[False]) * 1e3
        packed_ms = statistics.median(times[True]) * 1e3
        rows.append(dict(prompts=n, tokens=args.tokens, alone_ms=alone_ms, packed_ms=packed_ms))
        print(f"{n:>3} prompts of ~{args.tokens} tokens: one forward each {alone_ms:9.2f} ms, "
              f"packed {packed_ms:9.2f} ms ({alone_ms / packed_ms:.2f}x)", flush=True)  # fmt: skip
    if args.json_out:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        args.json_out.write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
