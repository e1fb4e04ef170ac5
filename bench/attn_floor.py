"""Where a long-context attention launch's time goes at the default model's shape (issue 5's
185k target). CUDA only.

A verify step at 185k keys reads 142 MB of K/V per layer (3 KV heads of 64, bf16): 33 us at
copy bandwidth, while the paged attention took ~43 us per layer in session 18's profile.
This times, as chains of --chain launches in one CUDA graph (bench.linear_sweep's chain
timing: us per launch), kernels that READ the same bytes and do no attention math:
- paged_read: attention's own grid (its split plan x KV heads), its page-table walk and
  tile (64 keys of one head, page ids loaded one tile ahead), summing K * V;
- paged_read_2x / _4x: the same with 2x / 4x the splits (more, shorter programs);
- flat_read: the same bytes as one contiguous buffer, one chunk per program, at the
  attention's program count and at 4x;
beside the attention itself (+ its split combine), q_len 16 and 1, with CUPTI's split of
the attention kernel from the combine. What the reads take is the floor a kernel of this
size and grid can reach; what attention takes beyond it is its math and pipeline.

    python -m bench.attn_floor --json-out attn_floor.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import triton
import triton.language as tl

from bench.linear_sweep import _chain_us

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16  # SmolLM2-135M; PagedKVCache's page size


@triton.jit
def _paged_read_kernel(
    k_ptr, v_ptr, pages_ptr, out_ptr, kv_len, split_len, stride_p, stride_s, stride_h,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """out[split, head] = sum of K * V over the split's keys of one KV head, read as the
    attention's full-tile loop reads them (page ids of the next tile carried)."""
    split = tl.program_id(0)
    head = tl.program_id(1)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    last_page = tl.maximum(end - 1, 0) // PAGE
    offs_d = tl.arange(0, D)
    t = start + tl.arange(0, BLOCK_N)
    page = tl.load(pages_ptr + tl.minimum(t // PAGE, last_page)).to(tl.int64)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for n0 in range(start, full_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        off = (page * stride_p + (t % PAGE) * stride_s + head * stride_h)[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + off).to(tl.float32)
        v = tl.load(v_ptr + off).to(tl.float32)
        page = tl.load(pages_ptr + tl.minimum((t + BLOCK_N) // PAGE, last_page)).to(tl.int64)
        acc += k * v
    tl.store(out_ptr + split * tl.num_programs(1) + head, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _flat_read_kernel(x_ptr, out_ptr, chunk, n, BLOCK: tl.constexpr):
    """out[pid] = sum of the pid-th contiguous chunk of x (chunk a multiple of BLOCK)."""
    pid = tl.program_id(0)
    start = pid * chunk
    end = tl.minimum(start + chunk, n)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < end, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _kv(kv_len: int, order: str):
    """K, V pages stored head-major [P, H_KV, S, D] as PagedKVCache stores them, viewed
    [P, S, H_KV, D]; the request's page table [1, P] in sequential or shuffled order."""
    import torch

    n_pages = -(-kv_len // PAGE)
    shape = (n_pages, KV_HEADS, PAGE, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    if order == "random":
        table = torch.randperm(n_pages, device="cuda")
    else:
        table = torch.arange(n_pages, device="cuda")
    return k, v, table.to(torch.int32).view(1, n_pages)


def _attention_rows(k, v, table, kv_len: int, chain: int, reps: int,
                    configs: list[tuple[int, int, int] | None]) -> list[dict]:  # fmt: skip
    """The paged attention (+ split combine) at q_len 16 and 1, for each tile config (None:
    the shipped choice): us per launch in a chain, CUPTI's time of the attention kernel."""
    import torch

    from bench.verify_step import kernel_profile
    from splitflash.kernels.kv_splits import plan_launch
    from splitflash.kernels.paged_attention import paged_attention_triton

    rows = []
    for q_len, config in itertools.product((16, 1), configs):
        q = torch.randn(q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor([kv_len], device="cuda", dtype=torch.int32)
        cu_q = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
        anc = torch.tensor([(1 << (i + 1)) - 1 for i in range(q_len)], device="cuda")
        inputs = (q, k, v, table, lens, cu_q, anc, HEAD_DIM**-0.5)

        def attend(inputs=inputs, q_len=q_len, config=config):
            return paged_attention_triton(*inputs, max_kv_len=kv_len, max_q_len=q_len,
                                          config=config)  # fmt: skip

        plan = plan_launch(
            q.device,
            q_len * HEADS // KV_HEADS,
            q_len,
            1,
            KV_HEADS,
            kv_len,
            config=config,
            head_dim=HEAD_DIM,
        )
        us = _chain_us(attend, chain, reps)
        prof = kernel_profile(attend, steps=10, top=4)
        tag = "_" + "-".join(map(str, config)) if config else ""
        rows.append(dict(variant=f"attention_q{q_len}{tag}", us=us,
                         splits=plan.splits.num_splits,
                         programs=plan.splits.num_splits * plan.m_tiles * KV_HEADS,
                         kernel_us=sum(r["us"] for r in prof["kernels"]
                                       if "paged_attn" in r["name"])))  # fmt: skip
    return rows


def _paged_read_rows(k, v, table, kv_len: int, splits: int, chain: int, reps: int):
    """The read-only kernel on the attention's grid, and on 2x / 4x the splits."""
    import torch

    rows = []
    for mult in (1, 2, 4):
        n_split = splits * mult
        split_len = _round_up(-(-kv_len // n_split), 128)  # as the attention's splits
        out = torch.empty(n_split * KV_HEADS, device="cuda")

        def read(n_split=n_split, split_len=split_len, out=out):
            _paged_read_kernel[(n_split, KV_HEADS)](
                k, v, table, out, kv_len, split_len, *k.stride()[:3],
                PAGE=PAGE, BLOCK_N=64, D=HEAD_DIM, num_warps=4, num_stages=3,
            )  # fmt: skip

        rows.append(dict(variant="paged_read" + (f"_{mult}x" if mult > 1 else ""),
                         us=_chain_us(read, chain, reps), programs=n_split * KV_HEADS))  # fmt: skip
    return rows


def _flat_read_rows(n_bytes: int, programs: int, chain: int, reps: int) -> list[dict]:
    """The same bytes as one contiguous buffer, one chunk per program, at 1x and 4x."""
    import torch

    flat = torch.randn(n_bytes // 2, device="cuda", dtype=torch.bfloat16)
    block = 4096
    rows = []
    for mult in (1, 4):
        n_prog = programs * mult
        chunk = _round_up(-(-flat.numel() // n_prog), block)
        out = torch.empty(n_prog, device="cuda")

        def read(n_prog=n_prog, chunk=chunk, out=out):
            _flat_read_kernel[(n_prog,)](flat, out, chunk, flat.numel(), BLOCK=block,
                                         num_warps=4, num_stages=3)  # fmt: skip

        rows.append(dict(variant="flat_read" + (f"_{mult}x" if mult > 1 else ""),
                         order="-", us=_chain_us(read, chain, reps), programs=n_prog))  # fmt: skip
    return rows


def measure(kv_len: int, chain: int, reps: int,
            configs: list[tuple[int, int, int]] = ()) -> dict:  # fmt: skip
    import torch

    from bench.kernels import measure_copy_gbps

    torch.manual_seed(0)
    copy_gbps = measure_copy_gbps()
    kv_bytes = 2 * kv_len * KV_HEADS * HEAD_DIM * 2
    rows = []
    for order in ("sequential", "random"):
        k, v, table = _kv(kv_len, order)
        attention = _attention_rows(k, v, table, kv_len, chain, reps, [None, *configs])
        splits = attention[0]["splits"]  # q_len 16's plan
        reads = _paged_read_rows(k, v, table, kv_len, splits, chain, reps)
        rows += [dict(r, order=order) for r in attention + reads]
        programs = attention[0]["programs"]
        del k, v
    rows += _flat_read_rows(kv_bytes, programs, chain, reps)
    floor_us = kv_bytes / copy_gbps / 1e3
    for r in rows:
        r["gbps"] = kv_bytes / r["us"] / 1e3
        r["of_copy"] = floor_us / r["us"]
    return dict(kv_len=kv_len, kv_bytes=kv_bytes, copy_gbps=copy_gbps, copy_floor_us=floor_us,
                chain=chain, rows=rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.attn_floor", description=__doc__)
    p.add_argument("--kv-len", type=int, default=185_000)
    p.add_argument("--chain", type=int, default=30, help="launches per graph (a step's layers)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--configs",
        nargs="*",
        default=[],
        metavar="BLOCK_N,WARPS,STAGES",
        help="attention tile configs to time beside the shipped one",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.attn_floor needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    res = measure(args.kv_len, args.chain, args.reps, configs)
    print(f"{args.kv_len} keys, {res['kv_bytes'] / 1e6:.0f} MB of K/V per launch; copy "
          f"{res['copy_gbps']:.0f} GB/s -> floor {res['copy_floor_us']:.1f} us")  # fmt: skip
    print(f"{'variant':22} {'pages':10} {'us/launch':>9} {'kernel us':>9} {'GB/s':>6} "
          f"{'of copy':>7} {'programs':>8}")  # fmt: skip
    for r in res["rows"]:
        kernel = f"{r['kernel_us']:9.1f}" if "kernel_us" in r else " " * 9
        progs = r["programs"]
        print(f"{r['variant']:22} {r['order']:10} {r['us']:9.2f} {kernel} {r['gbps']:6.0f} "
              f"{r['of_copy']:7.2f} {progs!s:>8}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
