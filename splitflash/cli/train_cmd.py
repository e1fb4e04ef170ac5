"""`splitflash train-drafter`: build local prompts, let the target regenerate the responses,
train a DFlash drafter on them and write it in the public format (config.json +
model.safetensors). Every stage is cached under --data / --out, so a rerun resumes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from splitflash.models import store
from splitflash.models.dflash.model import DFlashDrafter
from splitflash.models.loading import load_target, load_tokenizer

DEFAULT_PROMPTS, DEFAULT_EVAL_PROMPTS = 4000, 64


def register(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target")
    p.add_argument("--target", default=store.DEFAULT_TARGET, help="model name or path")
    p.add_argument("--out", required=True, type=Path, help="output drafter directory")
    p.add_argument("--data", type=Path, default=None, help="data cache (default OUT/data)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=3, help="draft decoder layers")
    p.add_argument("--intermediate", type=int, default=1024, help="draft MLP width")
    p.add_argument("--window", type=int, default=512, help="sliding window (0: all full)")
    p.add_argument("--target-layers", default="auto", help="'auto' or ids like 2,8,14,21,27")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=640)
    p.add_argument("--anchors-per-seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay over block position")
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="training prompts")
    p.add_argument("--max-new", type=int, default=256, help="tokens per regenerated response")
    p.add_argument("--gen-batch", type=int, default=256, help="prompts per generation batch")
    p.add_argument("--temperature", type=float, default=0.0, help="response sampling (0=greedy)")
    p.add_argument(
        "--gen-budget",
        type=float,
        default=None,
        help="seconds of response generation (no new batch after it)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of training; fewer steps are planned if they would not fit",
    )
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resume", action="store_true", help="continue OUT/train_state.pt")
    p.set_defaults(run=run)


def prepare_prompts(tokenizer, data_dir: Path, n_train: int, n_eval: int, seed: int) -> None:
    from splitflash.training.data import balanced, collect_prompts, split_of, write_prompts
    from splitflash.training.responses import PROMPTS

    if (data_dir / PROMPTS).exists():
        return  # cached: the same prompts on every rerun
    prompts = collect_prompts(seed)
    train = balanced([p for p in prompts if split_of(p.source) == "train"], n_train)
    held = balanced([p for p in prompts if split_of(p.source) == "eval"], n_eval)
    kept = write_prompts(train + held, tokenizer, data_dir / PROMPTS, max_prompt_tokens=400)
    Console(stderr=True).print(f"wrote {kept} prompts to {data_dir / PROMPTS}")


def run(args) -> int:
    from splitflash.cli.generate import stop_token_ids
    from splitflash.training.recipe import drafter_config, parse_layer_ids, pick_mask_token
    from splitflash.training.responses import generate_responses, load_sequences
    from splitflash.training.trainer import TrainConfig, Trainer

    for name in ("block_size", "steps", "batch", "seq_len", "anchors_per_seq", "prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    console = Console(stderr=True)
    path = store.resolve(args.target)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = load_target(path, device=args.device, dtype=dtype).requires_grad_(False)
    tokenizer = load_tokenizer(path)
    tcfg = target.cfg
    data_dir = args.data or args.out / "data"
    torch.manual_seed(args.seed)
    prepare_prompts(tokenizer, data_dir, args.prompts, DEFAULT_EVAL_PROMPTS, args.seed)
    t_gen = time.perf_counter()
    with Progress(console=console) as bar:
        task = bar.add_task("target regenerates responses", total=None)
        n = generate_responses(
            target,
            data_dir,
            args.max_new,
            args.gen_batch,
            stop_token_ids(tokenizer, tcfg),
            "train",
            args.prompts,
            args.temperature,
            lambda k: bar.advance(task, k),
            args.gen_budget,
        )
    seqs = load_sequences(data_dir, "train")
    console.print(f"generation: {time.perf_counter() - t_gen:.1f}s")
    console.print(
        f"{n} new responses; {len(seqs)} training sequences, {sum(len(s[0]) for s in seqs)} tokens"
    )
    config = drafter_config(
        tcfg,
        layers=args.layers,
        window=args.window or None,
        block_size=args.block_size,
        target_layer_ids=parse_layer_ids(args.target_layers, tcfg.num_layers),
        mask_token_id=pick_mask_token(tokenizer, tcfg.vocab_size),
        intermediate_size=args.intermediate,
    )
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head.weight).to(dev)
    cfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        anchors=args.anchors_per_seq,
        lr=args.lr,
        gamma=args.gamma,
        ckpt_every=args.ckpt_every,
        seed=args.seed,
        time_budget_s=args.time_budget,
    )
    trainer = Trainer(target, drafter, seqs, cfg, args.out, args.device)
    if args.resume and trainer.load_state():
        console.print(f"resumed at step {trainer.step}/{trainer.total}")
    console.print(
        f"drafter: {drafter.policy_string()}; target layers "
        f"{list(config.target_layer_ids)}; "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters"
    )
    summary = trainer.fit(log=lambda s: console.print(s))
    trainer.export(args.out)
    summary["data_tokens"] = sum(len(s[0]) for s in seqs)
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.out} ({json.dumps(summary)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m splitflash.cli.train_cmd ...`)."""
    parser = argparse.ArgumentParser(prog="splitflash")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train-drafter", *(sys.argv[1:] if argv is None else argv)])
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
