"""`splitflash generate PROMPT`: target and drafter in one process, text and speculative stats."""

from __future__ import annotations

import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from splitflash.local import generate_local, open_local
from splitflash.models import store
from splitflash.services.draft.dflash_loading import default_drafter_path, load_proposer
from splitflash.services.draft.ngram import NgramDrafter
from splitflash.services.verify.sampling import Sampling


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text in one process (no services)")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--target", default=store.DEFAULT_TARGET, help="model name or path")
    p.add_argument(
        "--drafter",
        default="ngram",
        choices=["ngram", "dflash", "none"],
        help="dflash: the target's shipped DFlash drafter (or --drafter-path)",
    )
    p.add_argument("--drafter-path", default=None, help="a DFlash checkpoint directory")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    p.add_argument("--block-size", type=int, default=8, help="draft block (anchor + drafts)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt without chat template")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def stop_token_ids(tokenizer, cfg) -> set[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def run(args) -> int:
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    engine, tokenizer = open_local(args.target, args.device)
    model, cfg = engine.model, engine.model.cfg
    drafter = None
    if not args.no_spec and args.drafter == "ngram":
        drafter = NgramDrafter()
    elif not args.no_spec and args.drafter == "dflash":
        on_cuda = torch.device(args.device).type == "cuda"  # one request: a 1-slot pool, graphed
        drafter = load_proposer(
            args.drafter_path or default_drafter_path(args.target),
            model.embed_tokens,
            model.lm_head.weight,
            cfg.num_layers,
            args.device,
            pool_slots=1 if on_cuda else 0,
            pool_context=engine.max_context,
            cuda_graphs=on_cuda,
        )
    # DFlash drafts from the target's hidden features: the engine exports those layers.
    engine.feature_layer_ids = getattr(drafter, "target_layer_ids", ())
    prompt_ids = encode_prompt(tokenizer, args.prompt, not args.no_chat)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)
    torch.manual_seed(0)
    gen = generate_local(
        engine,
        drafter,
        prompt_ids,
        args.max_tokens,
        sampling,
        stop_token_ids(tokenizer, cfg),
        args.block_size,
    )
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    stats = gen.stats.to_dict()
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": gen.token_ids,
                    "tokens_per_second": round(gen.tokens_per_second, 3),
                    "finish_reason": gen.finish_reason,
                    "speculative_decoding_stats": stats,
                }
            )
        )
        return 0
    console = Console()
    console.print(text)
    table = Table(title=f"{len(gen.token_ids)} tokens, {gen.tokens_per_second:.1f} tok/s")
    table.add_column("stat")
    table.add_column("value")
    for key, value in stats.items():
        table.add_row(key, str(value))
    Console(file=sys.stderr).print(table)
    if gen.violations:
        console.print(f"[red]invariant violations: {gen.violations}[/red]")
    return 0
