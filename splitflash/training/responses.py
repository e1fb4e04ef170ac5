"""The target regenerates every training response (DFLASH.md: the drafter must learn the
target's own continuations), cached on disk as token ids so a run can resume and a later
run can reuse them.

Files in the data directory:
  prompts.jsonl    {"ids": [...], "kind", "split": train|eval, "source"} one per line
  responses.jsonl  {"i": prompt line index, "ids": [...]} appended batch by batch
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from splitflash.models.target import TargetModel
from splitflash.training.data import read_jsonl
from splitflash.training.dense import generate_batch

PROMPTS = "prompts.jsonl"
RESPONSES = "responses.jsonl"


def done_indices(path: Path) -> set[int]:
    if not path.exists():
        return set()
    return {int(json.loads(line)["i"]) for line in path.read_text(encoding="utf-8").splitlines()}


def generate_responses(
    model: TargetModel,
    data_dir: Path,
    max_new: int,
    batch: int,
    stop_ids,
    split: str = "train",
    limit: int | None = None,
    temperature: float = 0.0,
    progress: Callable[[int], None] | None = None,
    time_budget_s: float | None = None,
) -> int:
    """Generate the missing responses of `split` prompts; returns how many were written.
    With a time budget no new batch starts once it is spent (the rest waits for a rerun)."""
    t0 = time.perf_counter()
    prompts = read_jsonl(data_dir / PROMPTS)
    todo = [i for i, p in enumerate(prompts) if p["split"] == split]
    todo = todo[:limit] if limit else todo
    out_file = data_dir / RESPONSES
    _drop_torn_tail(out_file)
    done = done_indices(out_file)
    todo = [i for i in todo if i not in done]
    todo.sort(key=lambda i: len(prompts[i]["ids"]))  # similar lengths: little left padding
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
    written = 0
    with out_file.open("a", encoding="utf-8") as f:
        for lo in range(0, len(todo), batch):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            chunk = todo[lo : lo + batch]
            outs = generate_batch(
                model, [prompts[i]["ids"] for i in chunk], max_new, stop_ids, temperature, gen
            )
            for i, ids in zip(chunk, outs, strict=True):
                f.write(json.dumps({"i": i, "ids": ids}) + "\n")
            f.flush()
            written += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return written


def _drop_torn_tail(path: Path) -> None:
    """Keep only complete lines (a crash mid-write can leave a torn last one)."""
    if not path.exists():
        return
    good = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            json.loads(line)["i"]
        except (ValueError, KeyError):
            continue
        good.append(line)
    path.write_text("".join(ln + "\n" for ln in good), encoding="utf-8")


def load_sequences(data_dir: Path, split: str = "train") -> list[tuple[list[int], int]]:
    """(prompt + response ids, prompt length) of every generated sequence of `split`."""
    prompts = read_jsonl(data_dir / PROMPTS)
    out = []
    for row in read_jsonl(data_dir / RESPONSES):
        p = prompts[row["i"]]
        if p["split"] == split and row["ids"]:
            out.append((p["ids"] + row["ids"], len(p["ids"])))
    return out
