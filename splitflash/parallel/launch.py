"""Start one process per tensor-parallel rank on this machine and collect their results.

`run_tp(world, fn, *args)` spawns `world` processes (spawn, never fork: CUDA and threads
do not survive a fork), joins them into one process group over loopback, calls
fn(rank, world, *args) in each and returns the per-rank results in rank order. A rank that
raises, dies or outlives the deadline stops every rank and raises here: nothing hangs.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on loopback now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_backend(world: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _to_bytes(value: Any) -> bytes:
    # torch.save, not the queue's own pickling: tensors put on a torch.multiprocessing
    # queue travel as shared-memory handles that die with the process that made them.
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _rank_main(rank, world, port, backend, timeout_s, results, fn, args) -> None:
    # Keep NVLink multicast (NVLS) off: the GPU machines' documentation requires it.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if backend == "gloo" and sys.platform.startswith("linux"):
        # Loopback only: the rendezvous is on 127.0.0.1, keep the data there too.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        value = _to_bytes(fn(rank, world, *args))
    except BaseException:
        # Report before the group is torn down: the teardown makes the other ranks fail
        # too, and the root cause should be on its way first.
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, True, value))


GRACE_S = 2.0  # for messages still in the pipe when a rank failed or exited


def _collect(procs, results, timeout_s: float) -> dict[int, bytes]:
    """Per-rank results; raises on a failed or silent rank, or past the deadline."""
    world = len(procs)
    got: dict[int, bytes] = {}
    errors: dict[int, str] = {}  # in arrival order: the first is most likely the cause
    deadline = time.monotonic() + timeout_s
    trouble_at: float | None = None  # first failure or silent exit seen
    while len(got) + len(errors) < world:
        now = time.monotonic()
        if trouble_at is not None and now > trouble_at + GRACE_S:
            break
        if now > deadline:
            raise TimeoutError(
                f"tensor-parallel run of {world} ranks exceeded {timeout_s:.0f} s "
                f"(results from ranks {sorted(got)})"
            )
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            silent = [r for r, p in enumerate(procs) if p.exitcode is not None]
            silent = [r for r in silent if r not in got and r not in errors]
            if silent and trouble_at is None:
                trouble_at = time.monotonic()
            continue
        if ok:
            got[rank] = value
        else:
            errors[rank] = value
            trouble_at = trouble_at or time.monotonic()
    # Ranks that died without a word (os._exit, a signal, a segfault): exit code None
    # means still running, e.g. stuck in a collective with a failed peer.
    silent = {r: p.exitcode for r, p in enumerate(procs) if r not in got and r not in errors}
    if errors or silent:
        lines = [f"rank {r} of {world} failed:\n{tb}" for r, tb in errors.items()]
        if silent:
            lines.append(f"ranks without a result (exit codes): {silent}")
        raise RuntimeError("\n".join(lines))
    return got


def _stop_all(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_tp(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    backend: str | None = None,
) -> list[Any]:
    """fn(rank, world, *args) in `world` spawned ranks -> [result of rank 0, 1, ...].

    fn and args must be picklable (a module-level function); results travel through
    torch.save. backend: "nccl" when there is a CUDA device per rank, else "gloo" (pass
    "gloo" for CPU tensors on a GPU machine: NCCL moves only CUDA tensors). Rank r uses
    cuda:r under NCCL. Raises RuntimeError with the ranks' tracebacks if one fails,
    TimeoutError past `timeout_s` (collectives time out at the same bound in the ranks).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, backend = free_port(), backend or pick_backend(world)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world, port, backend, timeout_s, results, fn, args),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        got = _collect(procs, results, timeout_s)
        for proc in procs:
            proc.join(GRACE_S)
    finally:
        _stop_all(procs)
    return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]
