"""Probe (session 35): a prefill chunk's split attention through cuDNN or FlashAttention,
host time per call (issuing only) and wall per call (30 calls, a step's layers, then sync),
for the default model's heads (9 x 64, bf16)."""

import time

import torch

ops = torch.ops.aten
H, D = 9, 64


def cudnn(q, k, v, causal):
    return ops._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=0.125
    )[:2]


def flash(q, k, v, causal):
    return ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.125)[:2]


def run(fn, q, k, v, p):
    fn(q, k[:, :, :p], v[:, :, :p], False)
    fn(q, k[:, :, p:], v[:, :, p:], True)


for p in (16384, 100_000, 185_000):
    for c in (256, 1024, 4096, 8192):
        q = torch.randn(1, H, c, D, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, H, p + c, D, device="cuda", dtype=torch.bfloat16)
        row = []
        for name, fn in (("cudnn", cudnn), ("flash", flash)):
            for shift in (0, 1):  # 0: the shape seen before; 1: a new p each round
                pp = p
                run(fn, q, kv, kv, pp)
                torch.cuda.synchronize()
                walls, hosts = [], []
                for _ in range(3):
                    pp -= shift
                    t0 = time.perf_counter()
                    for _ in range(30):
                        run(fn, q, kv, kv, pp)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    hosts.append((t1 - t0) / 30 * 1e3)
                    walls.append((time.perf_counter() - t0) / 30 * 1e3)
                row.append(f"{name}{'+newp' if shift else ''} {min(walls):.2f}/{min(hosts):.2f}")
        print(f"p {p:>6} c {c:>5}: " + "  ".join(row) + "  (wall/host ms per layer)", flush=True)

# The whole prompt (square causal, c == keys): torch's pick (F.sdpa) against FlashAttention,
# a new length each round as every request's prompt brings.
for n in (512, 2048, 8192, 32768):
    qkv = torch.randn(3, 1, H, n + 8, D, device="cuda", dtype=torch.bfloat16)
    row = []
    for name in ("sdpa", "flash"):
        walls = []
        for r in (0, 1, 2, 2):  # new lengths, then the last one again
            q, k, v = (t[:, :, : n - r] for t in qkv)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                if name == "sdpa":
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    flash(q, k, v, True)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 30 * 1e3)
        row.append(f"{name} new {min(walls[1:3]):.2f} seen {walls[3]:.2f}")
    print(
        f"whole prompt {n:>6}: " + "  ".join(row) + "  (ms per layer)",
        flush=True,
    )
