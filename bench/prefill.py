"""Prefill of one long prompt, whole or in chunks (VerifySettings.prefill_chunk): seconds,
the slowest chunk's seconds (the verify server runs other requests' steps between chunks,
so that is the most a running stream's step waits behind this prompt) and the GPU memory it
took beyond the engine's own (peak allocated minus before), side by side in one process.
Chunks are timed one by one (a device sync after each, as the server's next step makes).
The engine is built as the verify service builds it (`load_engine`), with the drafter's
feature layers on, as a DFlash deployment runs it; each chunk setting prefills once to warm
up (kernels, autotuning), then --reps times, each one token shorter than the run before (a
length not seen before, as every request's prompt is).

    python -m bench.prefill --device cuda --contexts 32768 185000 --chunks 0 8192 2048
    python -m bench.prefill --shape smollm2-135m ...   # random bf16 weights (no checkpoint)
    python -m bench.prefill --device cpu --contexts 600 --chunks 0 128 --reps 1   # smoke

A chunk of 0 is the whole prompt in one forward (the engine's behaviour before chunking).
--chunk-ms MS sizes chunks as the verify server does with PREFILL_CHUNK_MS while streams
decode (chunk_sizer.py, at most the largest --chunks tokens each; the warm-up trains it):
    python -m bench.prefill --shape smollm2-135m --contexts 185000 --chunks 8192 --chunk-ms 50 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def measure(engine, prompt: list[int], chunk: int, reps: int, cuda: bool,
            budget_ms: float | None = None, verbose: bool = False) -> dict:  # fmt: skip
    import torch

    from splitflash.services.verify.chunk_sizer import ChunkSizer
    from splitflash.services.verify.sampling import Sampling

    engine.prefill_chunk = chunk or len(prompt)
    sizer = ChunkSizer(budget_ms / 1e3, engine.prefill_chunk) if budget_ms else None
    seconds, slowest, peaks, counts = [], [], [], []
    for i in range(reps + 1):  # the first one warms up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        # one token shorter each run: a length not seen before, as each request's prompt is
        # (per-shape costs such as cuDNN's graph builds are paid as in serving)
        run = engine.start_prefill(f"p{i}", prompt[: len(prompt) - i], Sampling(), (), 2)
        chunk_s, sizes, report = [], [], None
        while report is None:
            cached = run.cached
            size = None if sizer is None else sizer.tokens(cached, others_waiting=True)
            t0 = time.perf_counter()
            report = run.advance(size)
            if cuda:
                torch.cuda.synchronize()
            chunk_s.append(time.perf_counter() - t0)
            if sizer is not None:
                sizer.observe(run.cached - cached, cached, chunk_s[-1])
            sizes.append(run.cached - cached)
            if verbose:
                print(f"  chunk {len(chunk_s)}: {sizes[-1]} tokens after {cached}: "
                      f"{chunk_s[-1] * 1e3:.1f} ms", flush=True)  # fmt: skip
        if cuda:
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        seconds.append(sum(chunk_s))
        slowest.append(max(chunk_s))
        counts.append(len(chunk_s))
        engine.release(f"p{i}")
    return dict(context=len(prompt), chunk=chunk, budget_ms=budget_ms,
                seconds=statistics.median(seconds[1:]), chunks=counts[-1],
                first_seconds=seconds[0],  # the warm-up: every shape new to this process
                run_seconds=seconds[1:],
                slowest_chunk_s=statistics.median(slowest[1:]),
                chunk_tokens=sizes, chunk_seconds=chunk_s,  # the last run's
                peak_gib=max(peaks[1:]) if cuda else None)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 185_000])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 8192, 2048])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--chunk-ms", type=float, nargs="*", default=[],
                   help="also: chunks sized to this many ms each, as PREFILL_CHUNK_MS does "
                   "while streams decode (at most the largest --chunks)")  # fmt: skip
    p.add_argument("--cudnn-min-work", type=float, nargs="*", default=[],
                   help="also: each run again with chunk_attention.CUDNN_MIN_WORK set to this "
                   "(0: every chunk through cuDNN)")  # fmt: skip
    p.add_argument("--warm-up", action="store_true",
                   help="run the verify service's start-up warm-up (warmup.warm_up, the "
                   "prefill part included) first and report its seconds: the first run then "
                   "shows what a server's first prompt costs")  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--verbose", action="store_true", help="print every chunk's size and time")
    p.add_argument("--shape", default=None,
                   help="a bench.verify_step shape with random bf16 weights and a random "
                   "prompt, instead of --target's checkpoint (CUDA only)")  # fmt: skip
    args = p.parse_args(argv)
    if any(c < 0 for c in args.chunks) or args.reps < 1 or any(m <= 0 for m in args.chunk_ms):
        p.error("--chunks must be >= 0 (0: whole prompt), --reps >= 1, --chunk-ms > 0")
    engine, prompts = _random_setup(args) if args.shape else _checkpoint_setup(args)
    from splitflash.models import chunk_attention

    warm_s = None
    if args.warm_up:
        from splitflash.services.verify.warmup import warm_up

        warm_s = warm_up(engine)
        print(f"start-up warm-up {warm_s:.2f} s", flush=True)

    shipped = chunk_attention.CUDNN_MIN_WORK
    cuda = args.device.startswith("cuda")
    rows = []
    for ctx in args.contexts:
        prompt = prompts(ctx)
        cap = max(args.chunks) or len(prompt)
        runs = [(c, None) for c in args.chunks] + [(cap, ms) for ms in args.chunk_ms]
        for work in [chunk_attention.CUDNN_MIN_WORK, *args.cudnn_min_work]:
            chunk_attention.CUDNN_MIN_WORK = work
            for chunk, budget_ms in runs:
                row = measure(engine, prompt, chunk, args.reps, cuda, budget_ms, args.verbose)
                rows.append(dict(row, cudnn_min_work=work, warm_up_seconds=warm_s))
                peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.2f} GiB"
                name = f"{budget_ms:g} ms" if budget_ms else chunk or "whole"
                print(f"ctx {ctx:>7} chunk {name:>6} cudnn from {work:.2g}: {row['seconds']:.3f}"
                      f" s in {row['chunks']} chunks (first run {row['first_seconds']:.3f} s),"
                      f" slowest chunk {row['slowest_chunk_s']:.3f} s{peak}",
                      flush=True)  # fmt: skip
        chunk_attention.CUDNN_MIN_WORK = shipped
    if args.json_out:
        meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                    target=args.shape or args.target, random_weights=bool(args.shape))  # fmt: skip
        args.json_out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


def _random_setup(args):
    """The engine of bench.verify_step (random bf16 weights, the drafter's feature layers)
    and random prompts: a prefill's time does not depend on the values."""
    import torch

    from bench.verify_step import SHAPES, _engine

    if not args.device.startswith("cuda"):
        raise SystemExit("--shape needs --device cuda")
    engine = _engine(max(args.contexts) + 64, 1, 16, shape=args.shape)
    engine.graphs = None  # a prefill is never graphed
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    return engine, lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()


def _checkpoint_setup(args):
    """The engine as the verify service loads --target, and prompts of its tokenizer."""
    from bench.long_context import build_prompt
    from splitflash.models import store
    from splitflash.models.dflash.checkpoint import CONFIG_FILE
    from splitflash.models.dflash.config import DFlashConfig
    from splitflash.models.loading import load_tokenizer
    from splitflash.services.draft.dflash_loading import default_drafter_path
    from splitflash.services.verify.config import VerifySettings
    from splitflash.services.verify.loader import load_engine

    room = max(args.contexts) + 64
    settings = VerifySettings(target=args.target, device=args.device, max_context=room,
                              kv_pages=-(-room // 16) + 16, cuda_graphs=False,
                              warmup=False)  # main runs it with --warm-up  # fmt: skip
    engine = load_engine(settings)
    drafter_config = DFlashConfig.from_json(default_drafter_path(args.target) / CONFIG_FILE)
    engine.feature_layer_ids = drafter_config.target_layer_ids
    tokenizer = load_tokenizer(store.resolve(args.target))
    return engine, lambda n: build_prompt(tokenizer, n)


if __name__ == "__main__":
    sys.exit(main())
