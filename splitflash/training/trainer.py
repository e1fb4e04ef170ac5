"""The DFlash training loop: AdamW, warm-up + cosine, bf16 autocast on GPU, frozen target.

Target features are recomputed every step from the frozen target (a 135M forward is cheaper
than storing K*D floats per token). A checkpoint holds the drafter, optimizer, step, the
planned total and every RNG, so `--resume` continues the same run.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitflash.models.dflash.checkpoint import save_dflash
from splitflash.models.dflash.model import DFlashDrafter
from splitflash.models.target import TargetModel
from splitflash.training.blocks import block_logits, block_loss, lr_at, sample_anchors
from splitflash.training.dense import target_features

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 32  # sequences per step
    seq_len: int = 640
    anchors: int = 32  # per sequence
    lr: float = 6e-4
    gamma: float = 7.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_frac: float = 0.04
    ckpt_every: int = 500
    log_every: int = 50
    seed: int = 0
    time_budget_s: float | None = None  # shrink the planned steps to fit (after a probe)


def _batch(seqs, idx: list[int], seq_len: int, device):
    """Right-padded ids [N, T], lengths, prompt lengths (rows cut to seq_len)."""
    rows = [seqs[i][0][:seq_len] for i in idx]
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    return ids.to(device), [len(r) for r in rows], [seqs[i][1] for i in idx]


def _tau_estimate(logits, ids, lengths, anchors, valid) -> float:
    """1 + mean accepted drafts if the data were the target's greedy output (teacher forced)."""
    n, a, bm1, _ = logits.shape
    k = torch.arange(1, bm1 + 1, device=ids.device)
    pos = anchors[:, :, None] + k
    inside = (pos < lengths[:, None, None]) & valid[:, :, None]
    labels = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).view(n, -1)).view(n, a, bm1)
    ok = ((logits.argmax(-1) == labels) & inside).long().cumprod(-1).sum(-1)  # [N, A]
    return 1.0 + float(ok[valid].float().mean()) if bool(valid.any()) else 1.0


def plan_total(
    step: int, elapsed_s: float, per_step_s: float, budget_s: float, max_steps: int
) -> int:
    """Total steps that fit the budget at the current pace (never past max_steps)."""
    fit = step + int(max(0.0, budget_s - elapsed_s) / max(per_step_s, 1e-9))
    return max(step + 1, min(max_steps, fit))


class Trainer:
    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter,
        seqs,
        cfg: TrainConfig,
        out_dir: Path,
        device: str,
    ) -> None:
        usable = [s for s in seqs if s[1] <= min(len(s[0]), cfg.seq_len) - 3]
        if not usable:
            raise ValueError("no training sequence has a response inside --seq-len")
        self.target, self.drafter, self.seqs, self.cfg = target, drafter, usable, cfg
        self.out_dir, self.device = Path(out_dir), torch.device(device)
        self.opt = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.step, self.total = 0, cfg.steps
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.py_rng = random.Random(cfg.seed)
        self.history: list[dict] = []

    # ---- checkpoints ---------------------------------------------------------------------
    def save_state(self) -> None:
        state = {
            "drafter": self.drafter.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "total": self.total,
            "train_config": asdict(self.cfg),
            "dflash_config": self.drafter.config.to_dict(),
            "gen": self.gen.get_state(),
            "py_rng": self.py_rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "history": self.history,
        }
        tmp = self.out_dir / (STATE_FILE + ".tmp")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        tmp.replace(self.out_dir / STATE_FILE)  # never a half-written checkpoint

    def load_state(self) -> bool:
        path = self.out_dir / STATE_FILE
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["dflash_config"] != self.drafter.config.to_dict():
            raise ValueError(
                f"{path} was written for another drafter config; "
                "use a new --out or the same options"
            )
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.total = state["step"], state["total"]
        self.gen.set_state(state["gen"])
        self.py_rng.setstate(state["py_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.history = state["history"]
        return True

    # ---- one step ------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        cfg, dev = self.cfg, self.device
        idx = [self.py_rng.randrange(len(self.seqs)) for _ in range(cfg.batch)]
        ids, lengths, starts = _batch(self.seqs, idx, cfg.seq_len, dev)
        anchors, valid = sample_anchors(lengths, starts, cfg.anchors, self.gen)
        anchors, valid = anchors.to(dev), valid.to(dev)
        len_t = torch.tensor(lengths, device=dev)
        fc = self.drafter.fc.weight
        with torch.no_grad():
            feats = target_features(self.target, ids, self.drafter.config.target_layer_ids)
        use_amp = dev.type == "cuda"
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = block_logits(
                self.drafter,
                feats if use_amp else feats.to(fc.dtype),
                ids,
                anchors,
                self.drafter.config.block_size,
            )
            loss = block_loss(logits, ids, len_t, anchors, valid, cfg.gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.total, cfg.lr, cfg.warmup_frac)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        tau = _tau_estimate(logits.detach(), ids, len_t, anchors, valid)
        self.step += 1
        return loss.item(), tau

    # ---- the loop ------------------------------------------------------------------------
    def fit(self, log=print, stop_at: int | None = None) -> dict:
        """Train to the planned total (or stop early at step `stop_at`, checkpointed)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        cfg = self.cfg
        # The step time is re-measured every 25 steps until half-way: early steps pay for
        # kernel selection and allocator growth, so one early probe plans far too few steps.
        t0 = t_mark = time.perf_counter()
        s_mark = self.step
        loss_sum = tau_sum = 0.0
        n_sum = 0
        self.drafter.train()
        with Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
            TimeRemainingColumn(),
        ) as bar:
            task = bar.add_task("train", total=self.total, completed=self.step, info="")
            while self.step < min(self.total, stop_at or self.total):
                loss, tau = self.train_step()
                loss_sum, tau_sum, n_sum = loss_sum + loss, tau_sum + tau, n_sum + 1
                if (
                    cfg.time_budget_s
                    and self.step % 25 == 0
                    and self.step - s_mark >= 10
                    and self.step < self.total // 2
                ):
                    now = time.perf_counter()
                    per_step = (now - t_mark) / (self.step - s_mark)
                    t_mark, s_mark = now, self.step
                    total = plan_total(self.step, now - t0, per_step, cfg.time_budget_s, cfg.steps)
                    if total != self.total:
                        log(
                            f"time budget {cfg.time_budget_s:.0f}s at {per_step * 1e3:.0f} "
                            f"ms/step: planned steps {self.total} -> {total}"
                        )
                        self.total = total
                        bar.update(task, total=self.total)
                info = f"loss {loss:.3f} tau~{tau:.2f}"
                bar.update(task, completed=self.step, info=info)
                if self.step % cfg.log_every == 0 or self.step == self.total:
                    row = {
                        "step": self.step,
                        "loss": loss_sum / n_sum,
                        "tau_est": tau_sum / n_sum,
                        "lr": self.opt.param_groups[0]["lr"],
                        "elapsed_s": round(time.perf_counter() - t0, 1),
                    }
                    self.history.append(row)
                    log(json.dumps(row))
                    loss_sum = tau_sum = 0.0
                    n_sum = 0
                if self.step % cfg.ckpt_every == 0:
                    self.save_state()
        self.save_state()
        self.drafter.eval()
        return {
            "steps": self.step,
            "seconds": round(time.perf_counter() - t0, 1),
            "sequences": len(self.seqs),
            "last": self.history[-1] if self.history else {},
        }

    def export(self, out_dir: Path) -> None:
        """Public DFlash format, weights in bf16 (the master copy stays fp32 in the state)."""
        self.drafter.to(torch.bfloat16)
        try:
            save_dflash(self.drafter, out_dir)
        finally:
            self.drafter.to(torch.float32)
