"""The verify service's target over SPLITFLASH_VERIFY_TP_SIZE tensor-parallel ranks, one host.

Rank 0 is the server's own process: the ordinary TargetEngine on its shard, wrapped in
BroadcastForward (parallel/follower.py). Ranks 1..N-1 are spawned here (never forked: CUDA and
the server's threads do not survive a fork); each loads the checkpoint, keeps its shard and
replays rank 0's forwards (`follow`) until close() sends stop. "cuda": rank r on cuda:r, NCCL;
"cpu": every rank on the CPU, gloo on loopback. No CUDA graphs: a broadcast cannot be captured.
Failure: rank 0 checks its followers before each forward and its collectives time out after
tp_timeout_s, so a dead or stuck rank makes the step (and every later one) raise, logged once
and naming the rank, instead of hanging. Followers wait for rank 0 without a practical bound
(the server may idle for days) and exit if rank 0's process goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitflash.models.config import TargetConfig
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.loading import checkpoint_config, load_target
from splitflash.models.target import TargetModel
from splitflash.parallel import BroadcastForward, follow, free_port
from splitflash.parallel.tp import check_world, local_kv_heads, shard_target
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine

log = logging.getLogger(__name__)

# A follower blocks in a broadcast for as long as the server idles: a bound far past any idle
# spell (and still far from overflowing a clock's nanoseconds once added to now()).
FOLLOWER_TIMEOUT = timedelta(days=365)
# A follower's start-up: interpreter and imports, then loading its copy of the checkpoint
# (minutes for a large one). Kept apart from tp_timeout_s, which bounds one collective.
START_S = 300.0
JOIN_S = 10.0  # close(): followers' time to return after the stop message, then SIGTERM


def check_tp(settings: VerifySettings, cfg: TargetConfig) -> str:
    """Refuse a split that cannot run, before any process starts; -> the backend."""
    world = settings.tp_size
    try:
        check_world(cfg, world)
    except ValueError as exc:  # name the setting and the model, not just "size 3"
        raise ValueError(f"SPLITFLASH_VERIFY_TP_SIZE={world}, {settings.target}: {exc}") from None
    if settings.device == "cpu":
        return "gloo"
    if settings.device != "cuda":
        raise ValueError(
            f"tp_size {world} needs device 'cuda' (rank r on cuda:r) or 'cpu', "
            f"got {settings.device!r}"
        )
    if (found := torch.cuda.device_count()) < world:
        raise ValueError(f"tp_size {world} needs {world} CUDA devices, found {found}")
    return "nccl"


def _build_rank(settings: VerifySettings, path: Path, rank: int):
    """-> rank `rank`'s shard and its cache: every rank's pages, this rank's kv heads."""
    world = settings.tp_size
    device = f"cuda:{rank}" if settings.device == "cuda" else "cpu"
    dtype = getattr(torch, settings.torch_dtype_name)
    model = shard_target(load_target(path, device=device, dtype=dtype), rank, world)
    cfg = model.cfg
    # The same num_pages / page_size / scratch_pages on every rank: rank 0's slots and page
    # tables address each cache. No scratch pages: they are for CUDA graphs, off under TP.
    cache = PagedKVCache(
        cfg.num_layers, settings.kv_pages, settings.page_size, local_kv_heads(cfg, world),
        cfg.head_dim, dtype=dtype, device=device, scratch_pages=0,
    )  # fmt: skip
    return model, cache


def _rank_env(settings: VerifySettings, backend: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: the GPU hosts require it
    if backend == "gloo" and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rendezvous and data on loopback
    if settings.device == "cpu":
        # CPU ranks share the host's cores: more threads than cores make OpenMP spin-wait
        # (seconds per step instead of milliseconds).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        torch.set_num_threads(max(1, (cores or os.cpu_count() or 1) // settings.tp_size))


def _join_group(backend: str, port: int, rank: int, world: int, timeout: timedelta) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)  # NCCL's collectives run on the current device
    url = f"tcp://127.0.0.1:{port}"  # rank 0 hosts the rendezvous store
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=world, timeout=timeout)


def _exit_with_parent() -> None:
    """Leave when rank 0's process is gone (killed before it could send stop): a follower
    blocked in a broadcast would otherwise wait out FOLLOWER_TIMEOUT."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def _follower_main(rank: int, settings: VerifySettings, path: Path, port: int, backend: str, q):
    """Ranks > 0: join the group, build this rank's shard, replay rank 0's forwards."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the process group: rank 0 ends
    _exit_with_parent()
    _rank_env(settings, backend)
    q.put((rank, "started", ""))  # imports done: rank 0 may now open the rendezvous
    try:
        _join_group(backend, port, rank, settings.tp_size, FOLLOWER_TIMEOUT)
        model, cache = _build_rank(settings, path, rank)
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise
    q.put((rank, "ready", ""))
    try:
        follow(model, cache)
    finally:
        dist.destroy_process_group()


class Followers:
    """Rank 0's handle on ranks 1..N-1: liveness, the failure message, shutdown."""

    def __init__(self, procs: dict) -> None:
        self.procs = procs  # rank -> spawned process
        self.error: str | None = None  # set once: the group is out of step for good
        self.closed = False

    def dead(self) -> dict[int, int]:
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def _describe(self, dead: dict[int, int]) -> str:
        pids = {r: self.procs[r].pid for r in dead}
        return ", ".join(
            f"rank {r} (pid {pids[r]}) died with exit code {c}" for r, c in dead.items()
        )

    def _fail(self, what: str) -> None:
        self.error = f"tensor-parallel verify engine unusable: {what}; restart the service"
        log.error("%s", self.error)

    def check(self) -> None:
        """Raise if a rank is gone or an earlier step broke the group: no collective then."""
        if self.error is None and (dead := self.dead()):
            self._fail(self._describe(dead))
        if self.error is not None:
            raise RuntimeError(self.error)

    def failed(self, exc: Exception) -> RuntimeError:
        """After a failed broadcast or forward on rank 0: the error to raise, naming the rank."""
        if self.error is None:
            # A rank killed mid-collective is reaped a moment after its peer notices.
            deadline = time.monotonic() + 2.0
            while not (dead := self.dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
            alive = sorted(set(self.procs) - set(dead))
            stuck = f"a collective failed with ranks {alive} alive (stuck?): {exc}"
            self._fail(self._describe(dead) if dead else stuck)
        return RuntimeError(self.error)

    def close(self, model: BroadcastForward | None) -> None:
        """Stop message (if the group is whole), join, then terminate stragglers."""
        if self.closed:
            return
        self.closed = True
        sent = False
        if model is not None and self.error is None and not self.dead():
            try:
                model.stop()
                sent = True
            except Exception as exc:  # a rank died since the last step
                log.warning("stop message to the tensor-parallel ranks failed: %s", exc)
        deadline = time.monotonic() + (JOIN_S if sent else 0.0)
        for rank, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("terminating tensor-parallel rank %d (pid %s)", rank, proc.pid)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():  # SIGTERM waits while a process is stopped; SIGKILL does not
                proc.kill()
                proc.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()

    def wait_for(self, q, stage: str, deadline: float) -> None:
        """Until every follower has sent `stage`; raise on one that failed, died or lags."""
        pending, dead = set(self.procs), {}
        while pending:
            with contextlib.suppress(queue.Empty):  # a dying rank's traceback: in by its exit
                rank, got, text = q.get(timeout=0.5 if dead else 0.2)
                if got == "error":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{text}")
                pending.discard(rank if got == stage else -1)
                continue
            if dead:  # and no traceback came: killed, or died in its imports
                raise RuntimeError(f"tensor-parallel start-up: {self._describe(dead)}")
            dead = {r: c for r, c in self.dead().items() if r in pending}
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending)} not {stage} in time")


class RankZeroModel(BroadcastForward):
    """BroadcastForward that never runs a collective past a dead or broken group, plus what
    the server reads from a TargetModel (parameters for weight bytes, the backend's name)."""

    def __init__(self, model: TargetModel, followers: Followers) -> None:
        super().__init__(model)
        self.followers = followers

    @property
    def backend(self):
        return self.model.backend

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)  # rank 0's shard: what this process reads

    def __call__(self, batch, cache, logits_rows=None, hidden_layer_ids=()):
        if self.stopped:
            raise RuntimeError("the tensor-parallel verify engine is closed")
        self.followers.check()
        try:
            return super().__call__(batch, cache, logits_rows, hidden_layer_ids)
        except Exception as exc:  # timeout or reset: followers are out of step from here on
            raise self.followers.failed(exc) from exc

    forward = __call__


class TPTargetEngine(TargetEngine):
    """TargetEngine on rank 0 of a tensor-parallel group; close() ends the other ranks."""

    def __init__(self, model: RankZeroModel, cache: PagedKVCache, max_context: int | None,
                 prefill_chunk: int) -> None:  # fmt: skip
        super().__init__(model, cache, max_context=max_context, graphs=None,
                         prefill_chunk=prefill_chunk)  # fmt: skip
        self.followers = model.followers

    def close(self) -> None:
        self.followers.close(self.model)


def load_tp_engine(settings: VerifySettings, path: Path) -> TPTargetEngine:
    """Validate, spawn ranks 1..N-1, build rank 0 here; any failure leaves no process."""
    world = settings.tp_size
    backend = check_tp(settings, checkpoint_config(path))
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group: one TP engine")
    _rank_env(settings, backend)
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    args = (settings, Path(path), port, backend, q)
    procs = {
        r: ctx.Process(target=_follower_main, args=(r, *args), daemon=True) for r in range(1, world)
    }
    followers = Followers(procs)
    try:
        for proc in procs.values():
            proc.start()
        followers.wait_for(q, "started", time.monotonic() + START_S)
        _join_group(backend, port, 0, world, timedelta(seconds=settings.tp_timeout_s))
        model, cache = _build_rank(settings, path, 0)
        followers.wait_for(q, "ready", time.monotonic() + START_S)
    except BaseException:
        followers.close(None)
        raise
    where = f"cuda:0..{world - 1}" if backend == "nccl" else "cpu"
    why = "CUDA graphs off: a host broadcast cannot be captured"
    log.info("tensor parallel: %d ranks on %s over %s; %s", world, where, backend, why)
    return TPTargetEngine(RankZeroModel(model, followers), cache, settings.max_context or None,
                          settings.prefill_chunk)  # fmt: skip
