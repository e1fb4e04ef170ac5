"""DFlash draft-step time against context length, sliding window on and off (issue 4).

For each context L and window setting (on: the checkpoint's per-layer policy; off:
window_override="off", so the checkpoint's sliding layers read the whole context) it fills
the drafter state with L positions of random target features (untimed), then times:
- step: one `draft_batch` call, the forward that drafts a whole block (as DFlashProposer
  runs it, without the argmax), median over --reps after warm-up;
- attn: in-step attention time of each layer (the drafter's own attention backend: the
  Triton kernel on CUDA, torch `block_attention` on CPU; bracketed with CUDA events, so
  eager launch overhead included), summed over the checkpoint's sliding layers and over
  its full layers;
- kern: the Triton `draft_attention` kernel alone on the same cache tensors and shapes each
  layer uses, GPU time in a CUDA graph, and the keys it reads
  (the torch reference, eager, on CPU);
- keys: context keys read per layer, as the state counts them (`keys_read_by_kind`).
step and attn run eagerly, as served (draft_batch builds tensors from Python lists: no CUDA
graph), so at short contexts they are mostly host launch time; kern shows GPU time alone.
Issue 4: with the window on the sliding layers' time must not grow with context (ratio ~1).

Timing needs only the shapes, not the weights of the target: the shared embedding and LM
head are random tensors of the target's shape (V x D from the drafter's config); the drafter
layers come from the checkpoint. bf16 on CUDA (CUDA events), fp32 on CPU (perf_counter).

    python -m bench.drafter_step --device cuda --json-out bench/results/drafter_step.json
    python -m bench.drafter_step --device cpu --contexts 256 1024 --reps 3   # smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from splitflash.kernels.dispatch import draft_attention
from splitflash.models.dflash import DFlashConfig, load_dflash
from splitflash.models.dflash.cache import (
    AttentionBackend,
    block_attention,
    triton_block_attention,
)
from splitflash.models.dflash.config import SLIDING

ASSET = Path(__file__).resolve().parents[1] / "splitflash/assets/drafters/smollm2-135m-dflash"


def log(msg: str) -> None:
    print(msg, flush=True)


class Clock:
    """Marks on the GPU timeline (CUDA events) or the host clock; ms() only after sync()."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class TimedAttention:
    """block_attention, optionally bracketed by clock marks. Calls come layer-major,
    request-minor (see DFlashDrafter.draft_batch), so call i belongs to layer i // R."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.on, self.marks = clock, False, []
        self.fn = block_attention  # build() picks the device's backend

    def __call__(self, *args):
        if not self.on:
            return self.fn(*args)
        start = self.clock.mark()
        out = self.fn(*args)
        self.marks.append((start, self.clock.mark()))
        return out


def build(root: Path, device: torch.device, dtype, override: str, timer: TimedAttention):
    cfg = DFlashConfig.from_json(root / "config.json")
    v, d = cfg.vocab_size, cfg.hidden_size
    embed = nn.Embedding(v, d, device=device, dtype=dtype)  # random: timing needs shapes only
    head = torch.randn(v, d, device=device, dtype=dtype)
    n_target = cfg.num_target_layers or max(cfg.target_layer_ids) + 1
    # The drafter's default backend (Triton on CUDA, torch elsewhere), bracketed by events.
    timer.fn = triton_block_attention if device.type == "cuda" else block_attention
    backend = AttentionBackend(f"{timer.fn.__name__}+events", timer, bounds_window_reads=True)
    return load_dflash(root, embed, head, n_target, dtype, device,
                       window_override=override, attention_backend=backend)  # fmt: skip


def fill(drafter, n_ctx: int, chunk: int, gen: torch.Generator):
    w = drafter.fc.weight
    state = drafter.new_state()
    for lo in range(0, n_ctx, chunk):
        n = min(chunk, n_ctx - lo)
        feats = torch.randn(n, drafter.config.feature_dim, generator=gen, device=w.device)
        drafter.append_context(state, feats.to(w.dtype), lo)
    return state


def median_ms(clock: Clock, fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    clock.sync()
    times = []
    for _ in range(reps):  # one sync per rep: each step starts on an idle queue, as served
        a = clock.mark()
        fn()
        b = clock.mark()
        clock.sync()
        times.append(clock.ms(a, b))
    return statistics.median(times)


def kernel_ms(drafter, states, clock: Clock, blk: int, reps: int, warmup: int, gen):
    """Per layer: (ms, context keys read per request) of the dispatch `draft_attention` kernel
    over the layer's own cache tensors, [R, W_cap, H_KV, hd] (a ring of W slots for a sliding
    layer). On CUDA: GPU time of the kernel alone, replayed in a CUDA graph (eager launch
    overhead would hide how it scales); on CPU the torch reference, eager. Fixed tile config
    (keys_read given: no autotuning, quick to compile)."""
    import triton.testing

    cfg, w = drafter.config, drafter.fc.weight
    n_req, n_ctx = len(states), states[0].n_ctx
    q = torch.randn(n_req, blk, cfg.num_attention_heads, cfg.head_dim, generator=gen,
                    device=w.device).to(w.dtype)  # fmt: skip
    bk, bv = (torch.randn(n_req, blk, cfg.num_key_value_heads, cfg.head_dim, generator=gen,
                          device=w.device).to(w.dtype) for _ in range(2))  # fmt: skip
    lens = torch.full((n_req,), n_ctx, dtype=torch.int32, device=w.device)  # no H2D per call
    out = []
    for li, pol in enumerate(drafter.policy):
        ck = torch.stack([s.layers[li].k for s in states])
        cv = torch.stack([s.layers[li].v for s in states])
        window = pol.window  # the kernel follows the ring's layout (slot = pos % capacity)

        def call(reads, ck=ck, cv=cv, window=window):
            return draft_attention(
                q, bk, bv, ck, cv, lens, window, cfg.head_dim**-0.5,
                max_ctx_len=n_ctx, keys_read=reads,
            )  # fmt: skip

        reads = torch.zeros(n_req, dtype=torch.int32, device=w.device)
        call(reads)  # one counting call (compiles too); the reference ignores the counter
        keys = int(reads[0]) if w.is_cuda else None
        timed = functools.partial(call, reads)
        if w.is_cuda:
            ms = triton.testing.do_bench_cudagraph(timed, return_mode="median")
        else:
            ms = median_ms(clock, timed, reps, warmup)
        out.append((float(ms), keys))
    return out


def measure(args, n_ctx: int, window: str, clock: Clock, device, dtype) -> dict:
    timer = TimedAttention(clock)
    drafter = build(args.drafter, device, dtype, "checkpoint" if window == "on" else "off", timer)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    states = [fill(drafter, n_ctx, args.chunk, gen) for _ in range(args.batch)]
    clock.sync()
    fill_s = time.perf_counter() - t0
    anchors = torch.randint(drafter.config.vocab_size, (args.batch,), generator=gen,
                            device=device).tolist()  # fmt: skip

    # draft_batch reads the caches and only overwrites state.keys_read_last: it neither
    # appends the block's K/V nor advances n_ctx, so every repetition is the same step.
    def step():
        return drafter.draft_batch(states, anchors, [n_ctx] * args.batch, args.block_size)

    step_ms = median_ms(clock, step, args.reps, args.warmup)
    n_layers = len(drafter.policy)
    per_layer: list[list[float]] = [[] for _ in range(n_layers)]
    timer.on = True
    for _ in range(args.reps):
        timer.marks.clear()
        step()
        clock.sync()
        sums = [0.0] * n_layers
        for i, (a, b) in enumerate(timer.marks):
            sums[i // args.batch] += clock.ms(a, b)
        for li, s in enumerate(sums):
            per_layer[li].append(s)
    timer.on = False
    attn = [statistics.median(x) for x in per_layer]
    sliding = [t == SLIDING for t in drafter.config.layer_types]  # the checkpoint's kinds
    st = states[0]
    row = dict(context=n_ctx, window=window, batch=args.batch, block_size=args.block_size,
               policy=drafter.policy_string(), fill_s=round(fill_s, 3), step_ms=step_ms,
               attn_ms_per_layer=attn, layer_kinds=list(st.layer_kinds),
               sliding_attn_ms=sum(t for t, s in zip(attn, sliding, strict=True) if s),
               full_attn_ms=sum(t for t, s in zip(attn, sliding, strict=True) if not s),
               keys_read_per_layer=list(st.keys_read_last),
               keys_read_by_kind=st.keys_read_by_kind(), cache_rows=st.cache_rows())  # fmt: skip
    if args.kernel:
        kern = kernel_ms(drafter, states, clock, args.block_size, args.reps, args.warmup, gen)
        row["kernel_ms_per_layer"] = [k[0] for k in kern]
        row["kernel_keys_read_per_layer"] = [k[1] for k in kern]
        row["kernel_sliding_ms"] = sum(k[0] for k, s in zip(kern, sliding, strict=True) if s)
        row["kernel_full_ms"] = sum(k[0] for k, s in zip(kern, sliding, strict=True) if not s)
    return row


def ratios(rows: list[dict]) -> dict:
    """Per window setting: time at the longest context / time at the shortest."""
    out = {}
    for window in ("on", "off"):
        rs = sorted((r for r in rows if r["window"] == window), key=lambda r: r["context"])
        if len(rs) < 2:
            continue
        lo, hi = rs[0], rs[-1]
        keys = ["step_ms", "sliding_attn_ms", "full_attn_ms", "kernel_sliding_ms"]
        out[window] = {"contexts": [lo["context"], hi["context"]]}
        out[window].update({f"{k}_ratio": hi[k] / lo[k] for k in keys if lo.get(k)})
    return out


def print_table(rows: list[dict], summary: dict) -> None:
    head = (f"{'context':>8} {'window':>6} {'step ms':>9} {'slide attn':>10} {'full attn':>9} "
            f"{'kern slide':>10} {'kern full':>9}  keys read/layer (state | kernel)")  # fmt: skip
    log(head)
    log("-" * len(head))
    for r in rows:
        ks, kf = r.get("kernel_sliding_ms"), r.get("kernel_full_ms")
        kernel_keys = r.get("kernel_keys_read_per_layer")
        log(f"{r['context']:>8} {r['window']:>6} {r['step_ms']:>9.3f} {r['sliding_attn_ms']:>10.3f}"
            f" {r['full_attn_ms']:>9.3f} {'-' if ks is None else f'{ks:.3f}':>10}"
            f" {'-' if kf is None else f'{kf:.3f}':>9}  {r['keys_read_per_layer']}"
            f"{'' if kernel_keys is None else f' | {kernel_keys}'}")  # fmt: skip
    for window, rat in summary.items():
        lo, hi = rat["contexts"]
        parts = ", ".join(f"{k[:-6]} x{v:.2f}" for k, v in rat.items() if k.endswith("_ratio"))
        log(f"window {window}: {hi} / {lo} context: {parts}")
    on = summary.get("on", {}).get("sliding_attn_ms_ratio")
    if on is not None:
        verdict = "flat (ok)" if on < 1.5 else "GROWS with context"
        log(f"sliding layers, window on: {verdict} (ratio {on:.2f}; want ~1)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drafter_step", description=__doc__)
    p.add_argument("--drafter", type=Path, default=ASSET, help="DFlash dir (default: shipped)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768, 131072])
    p.add_argument("--windows", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="requests per draft step")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--chunk", type=int, default=4096, help="context positions per append")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kernel", dest="kernel", action="store_false",
                   help="skip timing the Triton draft_attention kernel")  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = Clock(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"drafter {args.drafter} on {name} ({dtype}), torch {torch.__version__}, "
        f"block {args.block_size}, batch {args.batch}, reps {args.reps}")  # fmt: skip
    t_all = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for n_ctx in args.contexts:
            for window in args.windows:
                t0 = time.perf_counter()
                row = measure(args, n_ctx, window, clock, device, dtype)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # this setting's caches died with measure()
                log(f"[{time.perf_counter() - t_all:6.1f}s] L={n_ctx} window {window}: step "
                    f"{row['step_ms']:.3f} ms, sliding attn {row['sliding_attn_ms']:.3f} ms, "
                    f"full attn {row['full_attn_ms']:.3f} ms, keys {row['keys_read_by_kind']} "
                    f"(fill {row['fill_s']:.2f}s, {time.perf_counter() - t0:.1f}s)")  # fmt: skip
    summary = ratios(rows)
    print_table(rows, summary)
    if args.json_out:
        meta = dict(device=name, dtype=str(dtype), torch=torch.__version__,
                    seconds=round(time.perf_counter() - t_all, 1))  # fmt: skip
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"meta": meta, "rows": rows, "ratios": summary},
                                            indent=2) + "\n")  # fmt: skip
        log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
