"""The floor of a chain of dependent kernel launches on this GPU: what a verify step pays per
kernel boundary before any kernel does work (issue 5's 185k target). CUDA only.

A verify step of the default model is a chain of ~210 kernels (30 layers x 7: RoPE + K/V
write, attention, split combine, four fused linears), each waiting for the one before. Here
each link is a kernel that does nothing but read one value its predecessor wrote and write
one value, timed as a chain captured in one CUDA graph (bench.linear_sweep's chain timing:
time per link = replay / chain length, median of --reps replays), for grids of 1 program,
one per SM and two per SM, launched plainly and with programmatic dependent launch
(kernels/pdl.py). A step of N kernels cannot take less than N links of its kind, whatever
each kernel does.

    python -m bench.launch_floor --json-out launch_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
import triton.language as tl

from bench.linear_sweep import _chain_us


@triton.jit
def _link_kernel(src_ptr, dst_ptr, USE_GDC: tl.constexpr):
    """dst[pid] = src[pid] + 1: every program depends on the previous link's write."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1.0)


def chain_us(programs: int, pdl: bool, chain: int, reps: int) -> tuple[float, bool]:
    """(us per link, whether a chain's result is right) for one grid size and launch kind."""
    import torch

    bufs = [torch.zeros(programs, device="cuda") for _ in range(2)]
    meta = {"USE_GDC": True, "launch_pdl": True} if pdl else {"USE_GDC": False}
    links = 0

    def link():  # the two buffers alternate: each link reads what the previous one wrote
        nonlocal links
        _link_kernel[(programs,)](bufs[links % 2], bufs[(links + 1) % 2], **meta)
        links += 1

    us = _chain_us(link, chain, reps)
    # A chain from zeros leaves `chain` in the last buffer written; a link that ran before
    # its predecessor finished would leave less.
    for buf in bufs:
        buf.zero_()
    start = links
    for _ in range(chain):
        link()
    torch.cuda.synchronize()
    return us, bool((bufs[(start + chain) % 2] == chain).all())


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.launch_floor", description=__doc__)
    p.add_argument("--chain", type=int, default=210, help="links per graph (a step's kernels)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.launch_floor needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"chain of {args.chain} dependent launches, CUDA graph, {sms} SMs")
    for programs in (1, sms, 2 * sms):
        for pdl in (False, True):
            us, ok = chain_us(programs, pdl, args.chain, args.reps)
            rows.append(dict(programs=programs, pdl=pdl, us_per_link=us, result_ok=ok,
                             chain_ms=us * args.chain / 1e3))  # fmt: skip
            print(f"  grid {programs:4d} {'PDL  ' if pdl else 'plain'} {us:6.2f} us/link"
                  f"  {args.chain} links {us * args.chain / 1e3:.3f} ms"
                  f"{'' if ok else '  WRONG RESULT'}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"chain": args.chain, "sms": sms, "rows": rows}, f, indent=2)
    return 0 if all(r["result_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
