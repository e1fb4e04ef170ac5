"""Decode speed of one request against its context length: the incident's measurement.

The deployment behind splitflash fell from 118.6 tok/s at 1.4k context to 0.7 tok/s at 185k,
mean commit_len stuck at 1.00, because the drafter's sliding window was not applied. This
runs the same question on our stack: the engines built as the services build them (verify:
`load_engine`, CUDA graphs on CUDA; draft: `build_dflash_drafter`, KV pool and graphs on
CUDA), one greedy request at each context, target-only and with DFlash (window as the
checkpoint says, and optionally `off`: the incident's failure mode), and with --gate DFlash
under the gateway's speculation gate (services/gateway/spec_gate.py: drafting paused while
plain steps are faster). Every DFlash output is compared with the target-only one token
for token (see below).

On CUDA each way runs twice per context: the first run is a warm-up (it captures the CUDA
graphs of its shapes and autotunes the kernels: ~1 s per new graph), the second is timed
(on CPU there is nothing to warm up: one run). Decode
tok/s = tokens committed / seconds over the timed run's steps after the first --warm-steps;
prefill (the prompt forward and the drafter's prompt features) is reported apart, and so
are graph captures that still happened in the timed run.

On CUDA in bf16 with the fast kernels, a verify block of q tokens and a single-token
decode step round differently (other split plans and tile shapes), so greedy speculative
output can leave target-only output where the target's top two logits are within that
rounding. Such a divergence is diagnosed, not just flagged: the target scores the common
prefix in one fresh forward, and the gap between its logits for the two tokens is reported.
With --invariant on, the verify engine runs batch-invariant steps (VerifySettings.
batch_invariant): every row is computed the same way in any step, so speculative output must
equal target-only output exactly, and any divergence there is lossy (exit 1), as is a
fast-kernel divergence whose gap exceeds --tie-tolerance. CPU tests check exact equality in
fp32.

The context is a synthetic document of numbered records (the default model
has no long-context corpus here) and a question after it; past the model's 8k training
positions its text degrades, the same for every way compared.

    python -m bench.long_context --device cuda --contexts 1400 32768 185000 \
        --windows checkpoint off --invariant off on
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


def _captures(engine, drafter) -> int:
    """CUDA graphs captured so far by the verify engine and the drafter (0 on CPU)."""
    n = engine.graphs.captures if engine.graphs is not None else 0
    graphs = getattr(drafter, "graphs", None)
    return n + (graphs.captures if graphs is not None else 0)


class PhaseTimer:
    """Wall ms of every call of obj.<method> (the device synchronized before and after, so
    GPU time lands in the phase that queued it): where a decode step's time goes."""

    def __init__(self, obj, method: str, sync) -> None:
        self.ms: list[float] = []
        inner = getattr(obj, method)

        def timed(*a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                sync()
                self.ms.append((time.perf_counter() - t) * 1e3)

        setattr(obj, method, timed)

    def median(self) -> float:
        ms = sorted(self.ms)
        return ms[len(ms) // 2] if ms else 0.0


def diagnose(engine, prompt: list[int], ref: list[int], out: list[int]) -> dict:
    """Where `out` leaves `ref` (target-only), and the target's logit gap there: logit of
    ref's token minus logit of out's token, from one fresh forward over the common prefix."""
    import torch

    n = min(len(ref), len(out))
    i = next((j for j, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), n)
    if i >= n:
        return dict(position=i, note="one output is a prefix of the other (length differs)")
    ids = prompt + ref[:i]
    rid = "divergence-probe"
    engine.cache.add(rid)
    try:
        engine.cache.reserve(rid, len(ids))
        with torch.inference_mode():
            rows = torch.tensor([len(ids) - 1], device=engine.device)
            logits = engine.model(engine._batch([(rid, ids, 0)]), engine.cache, rows).logits[0]
        top2 = logits.topk(2).values.tolist()
        gap = float(logits[ref[i]] - logits[out[i]])
    finally:
        engine.cache.free(rid)
    return dict(position=i, target_token=ref[i], spec_token=out[i], logit_gap=gap,
                top2=top2)  # fmt: skip


def run(args) -> list[dict]:
    import torch

    from splitflash.local import generate_local
    from splitflash.models import store
    from splitflash.models.loading import load_tokenizer
    from splitflash.services.draft.dflash_loading import build_dflash_drafter
    from splitflash.services.gateway.spec_gate import SpecGate
    from splitflash.services.verify.config import VerifySettings
    from splitflash.services.verify.loader import load_engine

    room = max(args.contexts) + args.max_tokens + 64
    # One verify engine per mode: a CUDA graph holds the kernels it was captured with.
    engines = {
        mode: load_engine(VerifySettings(target=args.target, device=args.device,
                                         kv_pages=-(-room // 16) + 64, max_context=room,
                                         batch_invariant=mode == "on"))
        for mode in args.invariant
    }  # fmt: skip
    tokenizer = load_tokenizer(store.resolve(args.target))
    drafters = {
        w: build_dflash_drafter(args.drafter_path, args.target, args.device, window_override=w,
                                pool_slots=1, pool_context=room, cuda_graphs=True)
        for w in args.windows
    }  # fmt: skip
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    verify_ms = {}
    for mode, engine in engines.items():
        engine.feature_layer_ids = next(iter(drafters.values())).target_layer_ids
        verify_ms[mode] = PhaseTimer(engine, "verify", sync)
    propose_ms = {w: PhaseTimer(d, "propose", sync) for w, d in drafters.items()}
    rows = []
    for ctx, mode in ((c, m) for c in args.contexts for m in args.invariant):
        engine = engines[mode]
        prompt = build_prompt(tokenizer, ctx)
        ways = {"target-only": None} | {f"dflash ({w})": d for w, d in drafters.items()}
        if args.gate:  # the gateway's speculation gate over the first drafter
            ways["dflash gated"] = next(iter(drafters.values()))
        ref = None
        for way, drafter in ways.items():
            name = way if len(args.invariant) == 1 else f"{way} [invariant {mode}]"
            # One gate per context for both runs, as a server's gate carries what it learnt
            # over from one request to the next: the timed run starts from the warm-up's.
            gate = SpecGate() if way == "dflash gated" else None
            for _ in range(2 if cuda else 1):  # a first run warms up: graphs, autotuning
                for timer in (verify_ms[mode], *propose_ms.values()):
                    timer.ms.clear()
                before = _captures(engine, drafter)
                gen = generate_local(engine, drafter, prompt, args.max_tokens,
                                     block_size=args.block_size, gate=gate)  # fmt: skip
            captures = _captures(engine, drafter) - before
            rate, timed = decode_rate(gen, args.warm_steps)
            step_ms = sorted(s * 1e3 for s, _ in gen.steps[args.warm_steps :]) or [0.0]
            row = dict(context=ctx, way=name, invariant=mode, tokens=len(gen.token_ids),
                       decode_tok_s=rate,
                       steps_timed=timed, prefill_s=gen.prefill_seconds,
                       mean_commit_len=gen.stats.mean_commit_len,
                       paused_steps=gen.paused_steps,
                       step_ms_median=step_ms[len(step_ms) // 2], step_ms_max=step_ms[-1],
                       timed_captures=captures, verify_ms_median=verify_ms[mode].median(),
                       propose_ms_median=sum(t.median() for t in propose_ms.values()),
                       violations=gen.violations,
                       # per step: [drafted, tokens committed, step ms, propose ms]
                       steps=[[int(p > 0), c, round(s * 1e3, 3), round(p * 1e3, 3)] for (s, c), p
                              in zip(gen.steps, gen.propose_seconds, strict=True)])  # fmt: skip
            if ref is None:
                ref = gen.token_ids
                # What the target writes here (past its 8k trained positions it may degrade).
                row["text"] = tokenizer.decode(gen.token_ids[:48])
            elif gen.token_ids != ref:
                row["divergence"] = diagnose(engine, prompt, ref, gen.token_ids)
            rows.append(row)
            print(f"ctx {ctx:>7}  {name:<18} decode {rate:8.1f} tok/s over {timed:3d} steps "
                  f"(median {row['step_ms_median']:.2f} ms, max {row['step_ms_max']:.2f}, "
                  f"{captures} captures; verify {row['verify_ms_median']:.2f} ms, propose "
                  f"{row['propose_ms_median']:.2f} ms), commit_len {row['mean_commit_len']:.2f}, "
                  f"{gen.paused_steps} paused, "
                  f"prefill {row['prefill_s']:.2f} s", flush=True)  # fmt: skip
            if "divergence" in row:
                print(f"    differs from target-only: {row['divergence']}", flush=True)
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
    p.add_argument(
        "--gate",
        action="store_true",
        help="also DFlash under the gateway's speculation gate (one per context)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument(
        "--invariant",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="batch-invariant verify steps (exact equality required when on)",
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=0.25,
        help="largest target logit gap at a fast-kernel divergence taken as bf16 rounding",
    )
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = run(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    lossy = [r for r in rows if "divergence" in r and (
        r["invariant"] == "on" or r["divergence"].get("note")
        or r["divergence"]["logit_gap"] > args.tie_tolerance)]  # fmt: skip
    for r in lossy:
        print(f"LOSSY: {r['way']} at {r['context']}: {r['divergence']}")
    return 1 if lossy or any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
