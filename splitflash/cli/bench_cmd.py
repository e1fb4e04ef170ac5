"""`splitflash bench kernels [...]`: the benchmarks under bench/ (run from a checkout)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHES = {
    "kernels": "bench.kernels",
    "kernel_sweep": "bench.kernel_sweep",
    "linear_sweep": "bench.linear_sweep",
    "invariant_sweep": "bench.invariant_sweep",
    "launch_floor": "bench.launch_floor",
    "attn_floor": "bench.attn_floor",
    "spec_gate": "bench.spec_gate",
    "verify_step": "bench.verify_step",
    "drafter": "bench.drafter",
    "drafter_step": "bench.drafter_step",
    "draft_graphs": "bench.draft_graphs",
    "host_step": "bench.host_step",
    "draft_host": "bench.draft_host",
    "textstream": "bench.textstream",
    "ngram": "bench.ngram_cpu",
    "transport": "bench.transport",
    "feature_send": "bench.feature_send",
    "long_context": "bench.long_context",
    "longctx": "bench.long_context",  # DESIGN.md §7's name for it
    "context_append": "bench.context_append",
    "flush_probe": "bench.flush_probe",
    "draft_attn_sweep": "bench.draft_attn_sweep",
    "first_step": "bench.first_step",
    "graph_memory": "bench.graph_memory",
    "prefill": "bench.prefill",
    "sdpa_chunk_probe": "bench.sdpa_chunk_probe",
    "chunk_backend_probe": "bench.chunk_backend_probe",
    "prefill_pack": "bench.prefill_pack",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (GPU figures go to bench/RESULTS.md)")
    p.add_argument("which", choices=sorted(BENCHES))
    p.add_argument("args", nargs="*", help="passed to the benchmark (see its --help)")
    p.set_defaults(run=run)


def run(args) -> int:
    # The benchmarks live beside the package in the repository, not inside it.
    root = Path(__file__).resolve().parents[2]
    if (root / "bench").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(BENCHES[args.which])
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"benchmark {args.which!r} not found ({exc}); run it from a splitflash checkout"
        ) from None
    return int(module.main(args.args) or 0)
