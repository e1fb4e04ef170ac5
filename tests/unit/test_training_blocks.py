"""Training forward vs serving path: `block_logits` must equal `DFlashDrafter.draft` on the
same context for every anchor, several anchors in one pass, any window and causality."""

from __future__ import annotations

import math

import pytest
import torch

from splitflash.training.blocks import block_logits, block_loss, lr_at, sample_anchors
from tests.unit.test_dflash_support import TOL, V, cfg_dict, feats, make

LAYERS = {
    "sliding": ("sliding_attention", "sliding_attention", "full_attention"),
    "full": ("full_attention", "full_attention"),
}


def _serving_logits(drafter, f, ids, anchor, block):
    state = drafter.new_state()
    drafter.append_context(state, f[:anchor], 0)
    return drafter.draft(state, int(ids[anchor]), anchor, block)


@pytest.mark.parametrize("layers", ["sliding", "full"])
@pytest.mark.parametrize("causal", [None, True])
@pytest.mark.parametrize("window", [3, 8])
def test_training_forward_equals_serving_draft(layers, causal, window):
    block = 6
    drafter = make(cfg_dict(LAYERS[layers], window=window, block=block, causal=causal))
    t = 30
    f = feats(t, seed=3)  # positions past each anchor must stay invisible
    ids = torch.randint(0, V, (t,), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[1, 7, 12, 13, 27]])  # overlapping blocks, one past the end
    with torch.no_grad():
        got = block_logits(drafter, f[None], ids[None], anchors, block)
    assert got.shape == (1, 5, block - 1, V)
    for j, a in enumerate(anchors[0].tolist()):
        want = _serving_logits(drafter, f, ids, a, block)
        torch.testing.assert_close(got[0, j], want, **TOL)


def test_batched_rows_and_smaller_block_agree_with_serving():
    drafter = make(cfg_dict(window=5, block=8))
    g = torch.Generator().manual_seed(7)
    f = torch.randn(2, 20, drafter.config.feature_dim, generator=g)
    ids = torch.randint(0, V, (2, 20), generator=g)
    anchors = torch.tensor([[3, 15], [9, 10]])
    with torch.no_grad():
        got = block_logits(drafter, f, ids, anchors, 4)
    for r in range(2):
        for j in range(2):
            a = int(anchors[r, j])
            want = _serving_logits(drafter, f[r], ids[r], a, 4)
            torch.testing.assert_close(got[r, j], want, **TOL)


def test_loss_weights_and_masks_labels_past_end():
    n, a, b1 = 1, 2, 3
    ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0]])
    lengths = torch.tensor([5])
    anchors = torch.tensor([[1, 3]])
    valid = torch.tensor([[True, True]])
    logits = torch.zeros(n, a, b1, V)
    # Perfect prediction for every real label: only anchor 3's labels 4 (in) and 5, 6 (out).
    for j, anc in enumerate([1, 3]):
        for k in range(b1):
            p = anc + k + 1
            if p < 5:
                logits[0, j, k, int(ids[0, p])] = 50.0
    assert float(block_loss(logits, ids, lengths, anchors, valid, gamma=7.0)) < 1e-6
    logits[0, 1, 1, :] = 0.0  # label past the end: changing it must not matter
    assert float(block_loss(logits, ids, lengths, anchors, valid, gamma=7.0)) < 1e-6
    logits[0, 0, 2, :] = 0.0  # k = 3 wrong: loss = w3 * log V / sum(w)
    w = [math.exp(-k / 7.0) for k in range(3)]
    want = w[2] * math.log(V) / (sum(w) + w[0])
    got = float(block_loss(logits, ids, lengths, anchors, valid, gamma=7.0))
    assert got == pytest.approx(want, rel=1e-4)


def test_sample_anchors_bounds_and_padding():
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors([10, 6, 3], [4, 5, 5], 4, g)
    assert anchors.shape == valid.shape == (3, 4)
    row0 = anchors[0][valid[0]].tolist()
    assert len(set(row0)) == 4 and all(4 <= x <= 8 for x in row0)
    assert valid[1].tolist() == [False] * 4  # start 5, length 6: no anchor has a label
    assert valid[2].sum() == 0


def test_lr_schedule_warmup_then_cosine():
    peak, total = 6e-4, 100
    assert lr_at(0, total, peak) == pytest.approx(peak / 4)
    assert lr_at(3, total, peak) == pytest.approx(peak)
    assert lr_at(total, total, peak) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(50, total, peak) < lr_at(10, total, peak)
