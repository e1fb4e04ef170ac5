"""DFlash drafter adapter in a local loop: lossless vs target-only greedy, and the drafter's
context length equals the target's KV length at every step; desyncs are loud."""

from __future__ import annotations

import pytest
import torch

from bench.drafter import generate_dflash, measure_commit_len
from splitflash.models.dflash import DFlashDesyncError, DFlashDrafter
from splitflash.services.draft.dflash_drafter import DFlashProposer
from splitflash.training.recipe import drafter_config
from tests.conftest import tiny_engine, tiny_model

LAYER_IDS = (0, 2)


def _setup(seed=0, window=4, block=6):
    model = tiny_model(seed=seed)
    cfg = drafter_config(
        model.cfg,
        layers=2,
        window=window,
        block_size=block,
        target_layer_ids=LAYER_IDS,
        mask_token_id=96,
        intermediate_size=64,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, model.embed_tokens, model.lm_head.weight).eval()
    engine = tiny_engine(model, pages=128)
    engine.feature_layer_ids = LAYER_IDS
    return model, engine, DFlashProposer(drafter)


class CheckingProposer(DFlashProposer):
    """Records (drafter context, target KV length) before every proposal."""

    def __init__(self, drafter, engine):
        super().__init__(drafter)
        self.engine, self.seen = engine, []

    def propose(self, request_id, k):
        self.seen.append((self.context_len(request_id), self.engine.cache.seq(request_id).length))
        return super().propose(request_id, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block", [2, 4, 6])
def test_dflash_local_loop_is_lossless_and_in_step(seed, block):
    model, engine, base = _setup(seed)
    proposer = CheckingProposer(base.drafter, engine)
    g = torch.Generator().manual_seed(seed)
    for n in (3, 11):
        prompt = torch.randint(3, 97, (n,), generator=g).tolist()
        want, _ = generate_dflash(tiny_engine(model), None, prompt, 30, block, stop_ids={2})
        got, stats = generate_dflash(engine, proposer, prompt, 30, block, stop_ids={2})
        assert got == want
        assert stats.committed == len(got) - 1  # the prefill token is no verify step
        # Every step drafts a full chain except where the token budget leaves less room.
        assert stats.steps >= 1 and stats.draft_tokens <= stats.steps * (block - 1)
    assert proposer.seen and all(ctx == kv for ctx, kv in proposer.seen)
    assert not proposer.requests  # released


def test_partly_right_drafts_stay_lossless_and_in_step():
    """Drafts right up to a random depth, then wrong: accepted prefixes of every length, so
    the kept feature rows (anchor + accepted) of every size go through the drafter."""
    model, engine, base = _setup(1)
    prompt = [4, 8, 15, 16, 23, 42]
    want, _ = generate_dflash(tiny_engine(model), None, prompt, 40, 6)
    g = torch.Generator().manual_seed(0)

    class Partial(CheckingProposer):
        def propose(self, rid, k):
            drafts = super().propose(rid, k)
            done = len(self.requests[rid].tokens) - len(prompt)
            right = want[done : done + len(drafts)]
            cut = int(torch.randint(0, len(right) + 1, (1,), generator=g))
            return right[:cut] + [(t + 1) % 97 for t in right[cut:]]

    proposer = Partial(base.drafter, engine)
    got, stats = generate_dflash(engine, proposer, prompt, 40, 6)
    assert got == want
    assert 0 < stats.accepted_drafts < stats.draft_tokens
    assert all(ctx == kv for ctx, kv in proposer.seen)


def test_drafter_that_copies_the_target_is_accepted_fully():
    """Oracle for the bookkeeping: a proposer that drafts the target's own greedy chain
    must give commit_len == block on every full step (so pooled acceptance is 1.0)."""
    model, engine, proposer = _setup(0)
    prompt = [5, 9, 14, 3, 7]
    want, _ = generate_dflash(tiny_engine(model), None, prompt, 25, 4)

    class Oracle(DFlashProposer):
        def propose(self, rid, k):
            drafts = super().propose(rid, k)  # still runs the real drafter path
            done = len(self.requests[rid].tokens) - len(prompt)
            return want[done : done + len(drafts)]

    result = measure_commit_len(engine, Oracle(proposer.drafter), [prompt], 25, 4)
    assert result["acceptance_rate"] == 1.0
    assert result["tokens"] == 25


def test_desyncs_are_errors():
    _, engine, proposer = _setup(0)
    feats = torch.randn(5, proposer.drafter.config.feature_dim)
    proposer.open("r", [1, 2, 3, 4, 5])
    with pytest.raises(DFlashDesyncError, match="committed length"):
        proposer.extend("r", [6], 7)
    proposer.extend("r", [6], 6)
    with pytest.raises(DFlashDesyncError, match="features of 0 tokens"):
        proposer.propose("r", 3)  # no features yet
    with pytest.raises(DFlashDesyncError):
        proposer.add_features("r", 1, feats)  # must start at position 0
    proposer.add_features("r", 0, feats)
    assert len(proposer.propose("r", 3)) == 3
    assert len(proposer.propose("r", 50)) == proposer.max_drafts  # never past the block
    proposer.add_features("r", 5, feats[:1])  # the anchor's features before its extend
    with pytest.raises(DFlashDesyncError, match="holds features of 6 tokens"):
        proposer.propose("r", 3)
    with pytest.raises(ValueError, match="already open"):
        proposer.open("r", [1])
    proposer.release("r")
    proposer.release("r")  # idempotent
    with pytest.raises(DFlashDesyncError, match="unknown request"):
        proposer.propose("r", 3)


def test_batch_proposals_equal_single_and_keys_read_are_counted():
    _, _, proposer = _setup(0, window=3)
    g = torch.Generator().manual_seed(3)
    for rid, n in (("a", 4), ("b", 9)):
        proposer.open(rid, torch.randint(3, 97, (n + 1,), generator=g).tolist())
        proposer.add_features(
            rid, 0, torch.randn(n, proposer.drafter.config.feature_dim, generator=g)
        )
    batch = proposer.propose_batch(["a", "b"], 5)
    assert batch == [proposer.propose("a", 5), proposer.propose("b", 5)]
    reads = proposer.pop_keys_read()
    # Two calls each (batch + single); windowed: at most W - 1 = 2 context rows per request.
    assert reads["sliding"] == 2 * (2 + 2)
    assert reads["full"] == 2 * (4 + 9)
    assert proposer.pop_keys_read() == {}
    in_force, declared, source = proposer.attention_policy()
    assert in_force == declared == [("sliding", 3), ("full", None)] and source == "checkpoint"


@pytest.mark.parametrize("block", [3, 6])
def test_offline_figures_equal_the_step_loop(block):
    """bench's offline measurement (from the greedy output alone) equals the real loop."""
    from bench.drafter import offline_commit_len

    model, engine, proposer = _setup(2, block=6)
    prompts = [[5, 9, 14, 3, 7], [40, 41, 42, 43, 44, 45, 46, 47]]
    for max_tokens in (9, 30):
        online = measure_commit_len(engine, proposer, prompts, max_tokens, block, {2})
        offline = offline_commit_len(model, proposer.drafter, prompts, max_tokens, block, {2})
        for key in ("steps", "draft_tokens", "accepted_drafts", "mean_commit_len", "tokens"):
            assert offline[key] == online[key], key


def test_shipped_default_drafter_loads_strictly():
    from torch import nn

    from splitflash.models.dflash import load_dflash
    from splitflash.services.draft.dflash_loading import default_drafter_path

    path = default_drafter_path("smollm2-135m")
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20
    embed = nn.Embedding(49152, 576)  # SmolLM2-135M shapes: the real weights are not needed
    drafter = load_dflash(path, embed, embed.weight, 30)
    cfg = drafter.config
    assert cfg.block_size == 16 and cfg.target_layer_ids == (2, 8, 14, 21, 27)
    assert [p.kind for p in drafter.policy] == ["sliding", "sliding", "full"]
    with pytest.raises(ValueError, match="no shipped"):
        default_drafter_path("qwen3-8b")
