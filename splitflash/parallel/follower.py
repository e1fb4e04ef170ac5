"""Keeping every tensor-parallel rank in the same forward as rank 0's engine.

Rank 0 runs the ordinary TargetEngine (scheduling, page allocation, acceptance) with its
model wrapped in BroadcastForward: each forward first broadcasts the ForwardBatch, then runs
the sharded model. Ranks > 0 run `follow`: receive, run the same forward on their own
cache, repeat until rank 0 sends stop. The collectives inside the forward (all_reduce,
all_gather) pair up because every rank runs the same layers on the same batch shape.

Page allocation happens only on rank 0. A follower's PagedKVCache has the same num_pages,
page_size and scratch_pages (and local_kv_heads(cfg, world) heads): the broadcast slots and
page tables address it directly, so the caches stay in step without an allocator there.
Rank 0's engine only writes the KV through forwards (chain verification keeps accepted
K/V in place and rolls back by length), so nothing else needs mirroring. Not covered:
VerifyGraphs (it calls the model itself, and a host-side broadcast cannot be captured in a
CUDA graph), so a tensor-parallel engine runs with graphs=None; and a KV move
(PagedKVCache.move, tree compaction) on rank 0 would have to be broadcast as well.

Wire format, two broadcasts per forward (all int64, so one collective carries everything):
  header  [8]: op, N, B, page-table width W, has anc_bits, R (-1: all rows), L, kv_bound
               (-1: None)
  payload [4N + (N if anc) + (B+1) + 4B + B*W + max(R,0) + L]:
          token_ids, positions, slots, cu_q, kv_lens, page_table, anc_bits?, q_lens,
          kv_lens_list, logits_rows?, hidden_layer_ids
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from splitflash.models.attention import AttentionMeta
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import ForwardBatch, ForwardOutput, TargetModel

OP_STOP, OP_FORWARD = 0, 1
HEADER_LEN = 8


def pack_forward(
    batch: ForwardBatch,
    logits_rows: torch.Tensor | None,
    hidden_layer_ids: tuple[int, ...],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> header [8], payload [P] int64 on `device` (the collective's device)."""
    meta = batch.meta
    n, b = batch.token_ids.numel(), len(meta.q_lens)
    width = meta.page_table.shape[1]
    ids = [int(i) for i in hidden_layer_ids]
    header = [
        OP_FORWARD, n, b, width, int(meta.anc_bits is not None),
        -1 if logits_rows is None else logits_rows.numel(), len(ids),
        -1 if meta.kv_bound is None else int(meta.kv_bound),
    ]  # fmt: skip

    def host(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    parts = [batch.token_ids, batch.positions, batch.slots, meta.cu_q, meta.kv_lens]
    parts.append(meta.page_table)
    if meta.anc_bits is not None:
        parts.append(meta.anc_bits)
    parts += [host(meta.q_lens), host(meta.kv_lens_list)]
    if logits_rows is not None:
        parts.append(logits_rows)
    parts.append(host(ids))
    payload = torch.cat([p.reshape(-1).to(device=device, dtype=torch.long) for p in parts])
    return host(header).to(device), payload


def payload_len(header: list[int]) -> int:
    _, n, b, width, has_anc, rows, n_ids, _ = header
    return 3 * n + (b + 1) + b + b * width + has_anc * n + 2 * b + max(rows, 0) + n_ids


def unpack_forward(
    header: list[int], payload: torch.Tensor, device: torch.device | str
) -> tuple[ForwardBatch, torch.Tensor | None, tuple[int, ...]]:
    """The inverse of pack_forward, tensors on the model's `device`."""
    _, n, b, width, has_anc, rows, n_ids, kv_bound = header
    if payload.numel() != payload_len(header):
        raise ValueError(f"payload of {payload.numel()} values, header says {header}")
    host = payload.cpu()  # the host lists come from here; one copy, not one per field
    pos = 0

    def take(count: int) -> torch.Tensor:
        nonlocal pos
        pos += count
        return payload[pos - count : pos]

    token_ids, positions, slots = take(n), take(n), take(n)  # [N] each
    cu_q = take(b + 1).to(torch.int32)  # [B+1]
    kv_lens = take(b).to(torch.int32)  # [B]
    page_table = take(b * width).to(torch.int32).view(b, width)  # [B, W]
    anc_bits = take(n) if has_anc else None  # [N] int64
    q_lens = host[pos : pos + b].tolist()
    kv_lens_list = host[pos + b : pos + 2 * b].tolist()
    take(2 * b)
    logits_rows = take(rows) if rows >= 0 else None  # [R]
    ids = tuple(host[pos : pos + n_ids].tolist())
    meta = AttentionMeta(
        cu_q=cu_q.to(device),
        kv_lens=kv_lens.to(device),
        page_table=page_table.to(device),
        anc_bits=None if anc_bits is None else anc_bits.to(device),
        q_lens=q_lens,
        kv_lens_list=kv_lens_list,
        kv_bound=None if kv_bound < 0 else kv_bound,
    )
    batch = ForwardBatch(
        token_ids=token_ids.to(device), positions=positions.to(device),
        slots=slots.to(device), meta=meta,
    )  # fmt: skip
    rows_t = None if logits_rows is None else logits_rows.to(device)
    return batch, rows_t, ids


def _comm_device(group, model_device: torch.device) -> torch.device:
    # NCCL moves only CUDA tensors; gloo (CPU runs, tests) only needs host ones.
    return model_device if dist.get_backend(group) == "nccl" else torch.device("cpu")


class BroadcastForward:
    """Rank 0's model for TargetEngine: broadcast the batch, then run the sharded model.

    Offers what the engine reads from a TargetModel (cfg, embed_tokens, the call). `src`
    is the global rank of the engine's process. Call stop() (or leave the `with` block)
    when the engine is done, so the followers return.
    """

    def __init__(self, model: TargetModel, group=None, src: int = 0) -> None:
        self.model = model
        self.cfg = model.cfg  # the global config: full vocab, every layer
        self.embed_tokens = model.embed_tokens  # the engine takes its device from here
        self.group = group
        self.src = src
        self.forwards = 0
        self.stopped = False

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def __call__(
        self,
        batch: ForwardBatch,
        cache: PagedKVCache,
        logits_rows: torch.Tensor | None = None,
        hidden_layer_ids: tuple[int, ...] = (),
    ) -> ForwardOutput:
        if self.stopped:
            raise RuntimeError("the followers were stopped: no more forwards")
        comm = _comm_device(self.group, self.device)
        header, payload = pack_forward(batch, logits_rows, hidden_layer_ids, comm)
        dist.broadcast(header, self.src, group=self.group)
        dist.broadcast(payload, self.src, group=self.group)
        self.forwards += 1
        return self.model(batch, cache, logits_rows, hidden_layer_ids)

    forward = __call__

    def stop(self) -> None:
        """Tell the followers to return (once; later calls do nothing)."""
        if self.stopped:
            return
        self.stopped = True
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0] = OP_STOP
        dist.broadcast(header.to(_comm_device(self.group, self.device)), self.src, self.group)

    def __enter__(self) -> BroadcastForward:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


@torch.inference_mode()
def follow(
    model: TargetModel,
    cache: PagedKVCache,
    group=None,
    src: int = 0,
    on_output: Callable[[ForwardOutput], None] | None = None,
) -> int:
    """Ranks > 0: run every forward rank `src` broadcasts until stop; -> forwards run.

    The outputs go to `on_output` if given (tests, debugging) and are dropped otherwise:
    rank 0 holds the same logits. The forward must run all the same: its collectives pair
    with rank 0's, and it writes this rank's kv heads into `cache`.
    """
    device = model.embed_tokens.weight.device
    comm = _comm_device(group, device)
    count = 0
    while True:
        header_t = torch.empty(HEADER_LEN, dtype=torch.long, device=comm)
        dist.broadcast(header_t, src, group=group)
        header = header_t.tolist()
        if header[0] == OP_STOP:
            return count
        if header[0] != OP_FORWARD:
            raise RuntimeError(f"unknown tensor-parallel op {header[0]} from rank {src}")
        payload = torch.empty(payload_len(header), dtype=torch.long, device=comm)
        dist.broadcast(payload, src, group=group)
        batch, rows, ids = unpack_forward(header, payload, device)
        out = model(batch, cache, rows, ids)
        if on_output is not None:
            on_output(out)
        count += 1
