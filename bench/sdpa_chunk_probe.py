"""Which SDPA kernel a prefill chunk gets, and its time against the whole prompt's causal
SDPA (the default model's heads: H 9 / H_KV 3 / D 64, bf16, GQA expanded as the engine does).

    python -m bench.sdpa_chunk_probe --context 185000 --chunk 8192
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=185000)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--dim", type=int, default=64)
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    n, c, h, d = a.context, a.chunk, a.heads, a.dim
    q = torch.randn(1, h, n, d, device=dev, dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def timed(fn, reps=2):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def chunks():
        for lo in range(0, n, c):
            qc = q[:, :, lo : lo + c]
            kc, vc = k[:, :, : lo + qc.shape[2]], v[:, :, : lo + qc.shape[2]]
            if lo == 0:
                F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
            else:
                F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=causal_lower_right(qc.shape[2], kc.shape[2])
                )

    whole = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    print(f"whole causal {n}: {whole:.1f} ms", flush=True)
    for name, b in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]:
        try:
            with sdpa_kernel([b]):
                t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            print(f"whole causal, {name} only: {t:.1f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"whole causal, {name} only: {type(e).__name__}", flush=True)
    print(f"chunks of {c} (lower right): {timed(chunks):.1f} ms", flush=True)

    from splitflash.models.chunk_attention import chunk_attention_split

    def split_chunks():
        for lo in range(c, n, c):
            qc = q[:, :, lo : lo + c]
            kc, vc = k[:, :, : lo + qc.shape[2]], v[:, :, : lo + qc.shape[2]]
            chunk_attention_split(qc, kc, vc, None)
        F.scaled_dot_product_attention(q[:, :, :c], k[:, :, :c], v[:, :, :c], is_causal=True)

    print(f"chunks of {c} (split, cuDNN + LSE merge): {timed(split_chunks):.1f} ms", flush=True)
    lo = (n // c - 1) * c  # the last full chunk: its error against the masked kernel
    qc, kc, vc = q[:, :, lo : lo + c], k[:, :, : lo + c], v[:, :, : lo + c]
    want = F.scaled_dot_product_attention(qc.float(), kc.float(), vc.float(),
                                          attn_mask=causal_lower_right(c, lo + c))  # fmt: skip
    got = chunk_attention_split(qc, kc, vc, None).float()
    masked = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal_lower_right(c, lo + c))
    print(
        f"max err vs fp32: split {(got - want).abs().max():.2e}, "
        f"masked bf16 {(masked.float() - want).abs().max():.2e}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
