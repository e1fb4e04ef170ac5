"""Pooled mean commit_len of a DFlash drafter over held-out prompts (greedy, local loop).

The loop is `splitflash.local.generate_local` plus the feature path: after every target step
the kept rows' hidden features go into the drafter, and the drafter's context length is
checked against the target's KV length before every proposal.

    python -m bench.drafter --drafter DIR --data DIR --device cuda --block-sizes 8 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from splitflash.local import generate_local, open_local
from splitflash.services.common.spec_stats import SpecStats
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.sampling import Sampling


def generate_dflash(
    engine: TargetEngine, proposer, prompt: list[int], max_tokens: int, block_size: int, stop_ids=()
) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding of one prompt; proposer None = target only."""
    gen = generate_local(engine, proposer, prompt, max_tokens, Sampling(), stop_ids, block_size)
    return gen.token_ids, gen.stats


def measure_commit_len(
    engine: TargetEngine,
    proposer,
    prompts: list[list[int]],
    max_tokens: int,
    block_size: int,
    stop_ids=(),
) -> dict:
    """Pooled figures over all prompts: sum(c) / steps, never a mean of per-prompt means."""
    pooled = SpecStats()
    t0 = time.perf_counter()
    tokens = 0
    for prompt in prompts:
        out, stats = generate_dflash(engine, proposer, prompt, max_tokens, block_size, stop_ids)
        pooled.merge(stats)
        tokens += len(out)
    seconds = time.perf_counter() - t0
    return {
        "block_size": block_size,
        "prompts": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        **pooled.to_dict(),
    }


@torch.no_grad()
def offline_commit_len(
    target,
    drafter,
    prompts: list[list[int]],
    max_tokens: int,
    block_size: int,
    stop_ids=(),
    greedy: dict | None = None,
) -> dict:
    """The same pooled figures without the step loop, for machines where it is slow.

    Greedy speculative decoding commits exactly the target's greedy tokens, so the step
    sequence follows from that output alone: from anchor a the drafter proposes from the
    features of positions < a, the longest matching prefix is accepted, the next anchor is
    a + accepted + 1. One target forward gives every feature and one training-path forward
    (`block_logits`, tested equal to `DFlashDrafter.draft`) every block.
    """
    from splitflash.training.blocks import block_logits
    from splitflash.training.dense import generate_batch, target_features

    pooled = SpecStats()
    t0 = time.perf_counter()
    stops = set(stop_ids)
    tokens = 0
    dev = target.embed_tokens.weight.device
    w = drafter.fc.weight
    greedy = {} if greedy is None else greedy
    missing = [p for p in prompts if (tuple(p), max_tokens) not in greedy]
    for lo in range(0, len(missing), 16):  # batched: the target's greedy output only
        chunk = missing[lo : lo + 16]
        for prompt, out in zip(
            chunk, generate_batch(target, chunk, max_tokens, stops), strict=True
        ):
            greedy[(tuple(prompt), max_tokens)] = out
    for prompt in prompts:
        out = greedy[(tuple(prompt), max_tokens)]
        tokens += len(out)
        seq = torch.tensor([prompt + out], device=dev)  # [1, T]
        feats = target_features(target, seq, drafter.config.target_layer_ids).to(w.dtype)
        p, t = len(prompt), seq.shape[1]
        anchors = torch.arange(p, t, device=dev)[None]  # every anchor the loop may visit
        drafts = block_logits(drafter, feats, seq, anchors, block_size).argmax(-1)[0].tolist()
        done = 1  # the prefill committed one token
        while done < len(out) and out[done - 1] not in stops:
            a = p + done - 1  # anchor: the last committed token
            k = min(block_size - 1, max_tokens - done - 1)
            want = out[done : done + k]
            acc = 0
            while acc < min(k, len(want)) and drafts[a - p][acc] == want[acc]:
                acc += 1
            commit = min(acc + 1, len(out) - done)
            pooled.record(k, k, min(acc, commit), commit)
            done += commit
    return {
        "block_size": block_size,
        "prompts": len(prompts),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - t0, 2),
        "mode": "offline",
        **pooled.to_dict(),
    }


def eval_prompts(data_dir: Path, n: int) -> list[list[int]]:
    """Held-out prompts (split 'eval': their source files were never used for training)."""
    from splitflash.training.data import read_jsonl
    from splitflash.training.responses import PROMPTS

    rows = [r["ids"] for r in read_jsonl(data_dir / PROMPTS) if r["split"] == "eval"]
    if not rows:
        raise ValueError(f"{data_dir / PROMPTS} holds no held-out ('eval') prompts")
    return rows[:n]


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from splitflash.cli.generate import stop_token_ids
    from splitflash.models import store
    from splitflash.services.draft.dflash_loading import default_drafter_path, load_proposer

    p = argparse.ArgumentParser(prog="python -m bench.drafter", description=__doc__)
    p.add_argument("--target", default=store.DEFAULT_TARGET)
    p.add_argument("--drafter", type=Path, default=None, help="DFlash dir (default: shipped)")
    p.add_argument("--data", type=Path, required=True, help="dir with prompts.jsonl")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument(
        "--offline",
        action="store_true",
        help="derive the steps from the target's greedy output (no step loop)",
    )
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    engine, tokenizer = open_local(args.target, args.device, dtype, kv_pages=1024)
    model, cfg = engine.model, engine.model.cfg
    proposer = load_proposer(
        args.drafter or default_drafter_path(args.target),
        model.embed_tokens,
        model.lm_head.weight,
        cfg.num_layers,
        args.device,
        dtype,
    )
    engine.feature_layer_ids = proposer.target_layer_ids
    prompts = eval_prompts(args.data, args.n_prompts)
    stops = stop_token_ids(tokenizer, cfg)
    results = [
        measure_commit_len(engine, proposer, prompts, args.max_tokens, b, stops)
        for b in args.block_sizes
    ]
    table = Table(title=f"DFlash {proposer.policy_string()}")
    for col in ("block", "prompts", "tokens", "steps", "mean commit_len", "acceptance", "s"):
        table.add_column(col)
    for r in results:
        table.add_row(
            str(r["block_size"]),
            str(r["prompts"]),
            str(r["tokens"]),
            str(r["steps"]),
            f"{r['mean_commit_len']:.3f}",
            f"{r['acceptance_rate']:.3f}",
            str(r["seconds"]),
        )
    Console().print(table)
    print(json.dumps(results))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
