"""What captured graphs keep on the GPU: a capture at a new KV bucket adds its static inputs,
not a cuBLAS workspace. torch keeps one workspace per (cuBLAS handle, stream), 32 MiB on
Hopper, for as long as the process lives; captures that each warmed up on a new stream
grew the memory of a long-running service by one workspace per bucket (up to the 32
streams of torch's pool). Where earlier tests of the process already used every pooled
stream, the old code would pass too: run alone, it failed (33.6 MB a capture on an H100)."""

from __future__ import annotations

import pytest
import torch

from splitflash.models.dflash.graphs import DraftGraphs
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.verify.engine import VerifyInput
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_model
from tests.unit.kernel_env import CUDA, INTERPRET
from tests.unit.test_dflash_support import cfg_dict, make, shared
from tests.unit.test_draft_graphs import grow
from tests.unit.test_verify_graphs import _engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset"),
]
MIB = 1 << 20


def test_verify_captures_at_new_keys_add_kbs_not_a_cublas_workspace():
    engine = _engine(tiny_model().to("cuda"), graphs=True, capture=True, pages=128)
    for i, n in enumerate((40, 270)):  # KV buckets 256 and 512 (the model's context: 512)
        engine.prefill(f"r{i}", [(7 * i + j) % 97 for j in range(n)], Sampling(), (), 10_000)
    grown = []
    for rid, drafts in (("r0", [1, 2, 3]), ("r1", [1, 2, 3]), ("r0", []), ("r1", [])):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        item = VerifyInput(rid, len(engine.seqs[rid].tokens), drafts, 10_000)
        (rep,) = engine.verify([item])
        torch.cuda.synchronize()
        assert rep.error is None
        grown.append(torch.cuda.memory_allocated() - before)
    assert engine.graphs.captures == 4
    # The first capture may add the side stream's workspace; the others add their static
    # inputs and (the third) a row count's shared outputs: KBs for this tiny model.
    assert max(grown[1:]) < 2 * MIB, [g / MIB for g in grown]


def test_draft_captures_at_new_buckets_add_kbs_not_a_cublas_workspace():
    drafter = make(cfg_dict(window=64)).cuda()
    emb, head = shared(0)
    drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
    pool = DraftKVPool(drafter, slots=4, context=4096)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1,))
    states = [pool.new_state() for _ in range(4)]
    lengths = [20, 300, 700, 1500]  # context buckets 256, 512, 1024, 2048
    grow(drafter, states, lengths, [0] * 4)
    grown = []
    for i, n in enumerate(lengths):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        logits = graphs.run([states[i]], [3], [n], 6)
        del logits
        torch.cuda.synchronize()
        grown.append(torch.cuda.memory_allocated() - before)
    assert graphs.captures == 4 and not graphs.failed
    assert max(grown[1:]) < 2 * MIB, [g / MIB for g in grown]
