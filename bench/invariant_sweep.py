"""Sweep of the batch-invariant attention's fixed choices (CUDA only): tile config, granule
size and key-axis programs, against the fast kernel, side by side in one process. Those
choices are module constants (fixed per build: what makes the kernel launch-invariant);
this bench swaps them between measurements. GPU time in a CUDA graph, the default model's
attention shape (H 9, H_KV 3, D 64, page 16), bf16.
    python -m bench.invariant_sweep --out sweep.json   # every variant (~4 min on the H200)
    python -m bench.invariant_sweep --ab   # the build against session 17's choices
A sweep variant's granule is used past SMALL_SPAN (GRANULE = GRANULE_LARGE); "shipped" is
the module as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.kernels import _paged_inputs, _time_graph_ms

SHAPE = dict(heads=9, kv_heads=3, head_dim=64, page=16)
# (BLOCK_N, warps, stages)
CONFIGS = ((64, 4, 3), (64, 4, 4), (32, 4, 4), (64, 8, 3), (128, 8, 3), (128, 4, 2))
GRANULES = (1024, 2048, 4096)
PROGRAMS_PER_SM = (2, 4)
# Module attributes each variant sets (the others as shipped). "session17" has its sizes and
# program count, not its equal-count shares (gone: 1.3x slower at 8 x 131k).
SESSION17 = dict(CONFIG_BY_HEAD_DIM={64: (64, 4, 3)}, GRANULE=1024, GRANULE_LARGE=1024,
                 PROGRAMS_PER_SM=2)  # fmt: skip
AB_VARIANTS = [("session17", SESSION17), ("shipped", {})]
POINTS = ((1, 32768, 16), (1, 185000, 16), (1, 185000, 1), (8, 32768, 16))
AB_POINTS = ((1, 8192, 16),) + POINTS + ((8, 131072, 16),)


def _variant(inv, overrides: dict) -> dict:
    """Set the module's choices; returns the previous ones."""
    old = {name: getattr(inv, name) for name in overrides}
    for name, value in overrides.items():
        setattr(inv, name, value)
    return old


def _point(point, variants) -> list[dict]:
    import torch

    from splitflash.kernels import paged_attention_invariant as inv
    from splitflash.kernels.paged_attention import paged_attention_triton

    batch, kv_len, q_len = point
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = _paged_inputs(batch, kv_len, q_len, SHAPE["heads"], SHAPE["kv_heads"],
                         SHAPE["head_dim"], SHAPE["page"], torch.bfloat16, gen)  # fmt: skip
    scale = SHAPE["head_dim"] ** -0.5
    known = dict(max_kv_len=kv_len, max_q_len=q_len)
    kv_bytes = 2 * batch * kv_len * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2
    fast_ms = _time_graph_ms(lambda: paged_attention_triton(*args, scale, **known))
    base = dict(batch=batch, kv_len=kv_len, q_len=q_len, fast_ms=fast_ms,
                fast_gbps=kv_bytes / fast_ms / 1e6)  # fmt: skip
    print(f"b{batch} kv{kv_len} q{q_len}: fast {fast_ms * 1e3:.1f} us", flush=True)
    rows = []
    for name, choice in variants:
        old = _variant(inv, choice)
        try:
            ms = _time_graph_ms(lambda: inv.paged_attention_invariant(*args, scale, **known))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit: reported
            print(f"  {name}: {type(exc).__name__}", flush=True)
            continue
        finally:
            _variant(inv, old)
        rows.append(dict(base, variant=name, choice=repr(choice), inv_ms=ms,
                         ratio=ms / fast_ms))  # fmt: skip
        print(f"  {name}: {ms * 1e3:.1f} us ({ms / fast_ms:.2f}x fast)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ab", action="store_true", help="shipped vs session 17's choice")
    args = parser.parse_args(argv)
    if args.ab:
        points, variants = AB_POINTS, AB_VARIANTS
    else:
        points = POINTS
        variants = [(f"{c} g{g} x{k}", dict(CONFIG_BY_HEAD_DIM={64: c}, GRANULE=g,
                                            GRANULE_LARGE=g, PROGRAMS_PER_SM=k))
                    for c in CONFIGS for g in GRANULES for k in PROGRAMS_PER_SM
                    if g % c[0] == 0]  # fmt: skip
    rows = [row for point in points for row in _point(point, variants)]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
