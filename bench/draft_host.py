"""Host work of one graphed DFlash draft call (CPU; the forward itself is not run).

`DraftGraphs.run` checks the step, plans where the context rows of the step go, packs the
block and those plans into one buffer and copies it in before the replay; on the GPU this
runs serially with the replay, and with the fused drafter (~0.2 ms of replay at batch 1,
bench/RESULTS.md session 29) it is about half of a draft call. This times it for B requests
that each append `--rows` context rows, with the shipped drafter's config at an 8-token
vocab (random weights) and the captured forward replaced by nothing. On the GPU the logits'
clone or argmax is one kernel launch; on CPU it runs here as host work, so at a 256-token
vocab a greedy run (argmax) and a sampling one (clone) differed by more than the host work
compared (session 31): the vocab is kept too small for either to count.

    python -m bench.draft_host --batches 1 8 --reps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit

VOCAB = 8


def measure(batch: int, rows: int, reps: int) -> tuple[float, float, float]:
    """(median, fastest) us of one DraftGraphs.run (forward stubbed) over 15 rounds of `reps`
    calls (on a shared machine the fastest round is the steadier figure for A/B), and the
    fastest round's us of its append planning alone (graph_inputs.append_rows)."""
    import torch

    from bench.draft_graphs import ASSET, _fill
    from splitflash.models.dflash import DFlashDrafter
    from splitflash.models.dflash.config import DFlashConfig
    from splitflash.models.dflash.graph_inputs import append_rows
    from splitflash.models.dflash.graphs import DraftGraphs
    from splitflash.models.dflash.pool import DraftKVPool

    raw = json.loads((ASSET / "config.json").read_text())
    raw["vocab_size"] = VOCAB
    cfg = DFlashConfig.from_dict(raw)
    drafter = DFlashDrafter(cfg, torch.nn.Embedding(VOCAB, cfg.hidden_size),
                            torch.randn(VOCAB, cfg.hidden_size)).eval()  # fmt: skip
    pool = DraftKVPool(drafter, slots=batch + 1, context=4096)  # slot 0 is scratch
    graphs = DraftGraphs(drafter, pool, batch_sizes=(batch,), capture=False)
    gen = torch.Generator().manual_seed(0)
    states = []
    for _ in range(batch):
        states.append(pool.new_state())
        _fill(drafter, states[-1], 300, gen)
    feats = torch.randn(rows, drafter.config.feature_dim, generator=gen)
    appends = [(feats, 300)] * batch
    anchors, positions = [5] * batch, [300 + rows] * batch
    with torch.no_grad():  # the first call captures (eagerly here) and must take the graph
        if graphs.run(states, anchors, positions, 16, appends=appends) is None:
            raise SystemExit(f"batch {batch}: the step did not take the graph path")
    graphs._forward = lambda entry, bucket: None  # host work only from here

    def one():
        for state in states:
            state.n_ctx = 300  # the same step again
        graphs.run(states, anchors, positions, 16, appends=appends, greedy=True)  # as proposed

    for _ in range(reps):
        one()
    rounds = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(reps):
            one()
        rounds.append((time.perf_counter() - start) * 1e6 / reps)
    plan = (pool, pool.slots_of(states), [300] * batch, [rows] * batch, batch, 16)
    planning = min(timeit.repeat(lambda: append_rows(*plan), number=reps, repeat=15))
    return statistics.median(rounds), min(rounds), planning * 1e6 / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_host", description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rows", type=int, default=3, help="context rows each request appends")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for b in args.batches:
        median, fastest, planning = measure(b, args.rows, args.reps)
        print(f"B {b:3d}: {median:8.1f} us per draft call (host), fastest round {fastest:.1f}"
              f", append planning {planning:.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
