"""Trainer: learns, resumes to the same weights, exports the public format."""

from __future__ import annotations

import dataclasses

import torch

from splitflash.models.dflash import DFlashDrafter, load_dflash
from splitflash.training.recipe import drafter_config
from splitflash.training.trainer import TrainConfig, Trainer
from tests.conftest import tiny_model

CFG = TrainConfig(steps=6, batch=3, seq_len=32, anchors=4, lr=3e-3, ckpt_every=3, log_every=1)


def _seqs(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, 90, (5,), generator=g).tolist()
        out.append((([1, 2, 3, 4] + motif * 6)[:30], 4))  # a repeated motif: learnable
    return out


def _trainer(model, tmp_path, cfg=CFG):
    dcfg = drafter_config(
        model.cfg,
        layers=2,
        window=8,
        block_size=4,
        target_layer_ids=(0, 2),
        mask_token_id=96,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg, model.embed_tokens, model.lm_head.weight)
    return Trainer(model, drafter, _seqs(), cfg, tmp_path, "cpu")


def test_resume_gives_the_same_weights_as_one_run(tmp_path):
    model = tiny_model()
    straight = _trainer(model, tmp_path / "a")
    straight.fit(log=lambda s: None)
    first = _trainer(model, tmp_path / "b")
    first.fit(log=lambda s: None, stop_at=3)  # as an interrupted run would
    resumed = _trainer(model, tmp_path / "b")
    assert resumed.load_state() and resumed.step == 3
    resumed.fit(log=lambda s: None)
    for (name, a), b in zip(
        straight.drafter.state_dict().items(), resumed.drafter.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)


def test_training_lowers_the_loss_and_exports(tmp_path):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, tmp_path, dataclasses.replace(CFG, steps=40, log_every=10))
    summary = trainer.fit(log=lambda s: None)
    losses = [h["loss"] for h in trainer.history]
    assert summary["steps"] == 40 and losses[-1] < 0.7 * losses[0]
    for name, w in model.state_dict().items():  # the shared embedding/head stay frozen
        assert torch.equal(w, before[name]), name
    trainer.export(tmp_path / "out")
    loaded = load_dflash(
        tmp_path / "out",
        model.embed_tokens,
        model.lm_head.weight,
        model.cfg.num_layers,
        dtype=torch.float32,
    )
    assert loaded.config == trainer.drafter.config
    for name, w in trainer.drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], w.bfloat16().float(), msg=name)
    assert next(trainer.drafter.parameters()).dtype == torch.float32  # master copy kept


def test_time_budget_plans_steps_that_fit():
    from splitflash.training.trainer import plan_total

    assert plan_total(30, 10.0, 0.1, 100.0, 4000) == 30 + 900
    assert plan_total(30, 10.0, 0.01, 100.0, 4000) == 4000  # never past --steps
    assert plan_total(30, 120.0, 0.1, 100.0, 4000) == 31  # over budget: stop next step
