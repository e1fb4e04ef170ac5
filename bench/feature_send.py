"""Verify -> draft feature transport of one verify step, over loopback (CPU only).

B requests' feature rows sent the way verify sent them before session 15 (one Features call
per request, each waiting for its ack) against one pipelined exchange
(`DraftLink.send_many`: every message sent, then every ack awaited). The peer is a minimal
acking drafter in another process: it decodes each Features frame and acks it, so the
figures are transport (encode, sockets, decode, ack), not the drafter's own work.

    python -m bench.feature_send --batches 1 8 32 --reps 300
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

FEATURE_WIDTH = 5 * 576  # the shipped DFlash drafter: 5 target layers of SmolLM2-135M


def _peer(endpoint_out, idle_s: float = 30.0) -> None:
    """Ack every Features until a Release arrives or nothing comes for idle_s (bounded)."""
    import zmq

    from splitflash.protocol import (
        DRAFT_REQUESTS,
        DRAFT_RESPONSES,
        Features,
        FeaturesAck,
        Hello,
        PeerTimeout,
        Release,
        ReleaseReply,
        answer_hello,
        bind,
        decode_tensor,
        make_socket,
        recv,
        router_send,
    )

    ctx = zmq.Context()
    sock = make_socket(ctx, "router", hwm=10_000, linger_ms=0)
    endpoint_out.send(bind(sock, "tcp://127.0.0.1:*"))
    while True:
        try:
            inc = recv(sock, DRAFT_REQUESTS, router=True, timeout_ms=int(idle_s * 1000))
        except PeerTimeout:
            break
        msg = inc.msg
        if isinstance(msg, Hello):
            reply = answer_hello(msg, service="draft", model="bench-peer")
        elif isinstance(msg, Features):
            rows = decode_tensor(msg, inc.frames[0])
            reply = FeaturesAck(request_id=msg.request_id, end_pos=msg.start_pos + rows.shape[0])
        else:
            assert isinstance(msg, Release)
            router_send(sock, inc.peer, inc.call_id, ReleaseReply(released=[]), DRAFT_RESPONSES)
            break
        router_send(sock, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)
    sock.close(0)
    ctx.term()


def run(batches: list[int], rows: int, reps: int) -> list[dict]:
    import torch
    import zmq

    from splitflash.protocol import Release
    from splitflash.services.verify.draft_link import DraftLink

    parent, child = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=_peer, args=(child,), daemon=True)
    peer.start()
    endpoint = parent.recv()
    failures: list[str] = []
    # Generous timeouts (they bound a failure, they do not time the exchange): a loaded
    # 2-core CI machine once starved the peer past 5 s and the run failed.
    link = DraftLink(zmq.Context.instance(), endpoint, peer_id="bench", timeout_s=30.0,
                     hello_timeout_s=30.0, retry_s=1.0, chunk_rows=2048,
                     on_failure=failures.append)  # fmt: skip
    layers = (2, 8, 14, 21, 27)
    out = []
    for b in batches:
        batch = [(f"r{i}", 0, torch.randn(rows, FEATURE_WIDTH).to(torch.bfloat16))
                 for i in range(b)]  # fmt: skip

        def one_by_one(batch=batch):  # each request's call waits for its ack (before)
            for item in batch:
                assert link.send_many([item], layers)[item[0]]

        def pipelined(batch=batch):  # every message sent, then every ack awaited
            assert all(link.send_many(batch, layers).values())

        times = {"one_by_one": [], "pipelined": []}
        for i in range(reps + 5):  # alternated, the first 5 of each are warm-up
            for name, fn in (("one_by_one", one_by_one), ("pipelined", pipelined)):
                t = time.perf_counter()
                fn()
                if i >= 5:
                    times[name].append((time.perf_counter() - t) * 1e3)
        row = dict(batch=b, rows=rows, width=FEATURE_WIDTH, reps=reps)
        for name, ts in times.items():
            row[f"{name}_ms"] = statistics.median(ts)
        out.append(row)
        print(f"B {b:3d}: one by one {row['one_by_one_ms']:.3f} ms, pipelined "
              f"{row['pipelined_ms']:.3f} ms (x{row['one_by_one_ms'] / row['pipelined_ms']:.2f})",
              flush=True)  # fmt: skip
    link._client.call(Release(request_ids=[]), timeout_s=30.0)
    link.close()
    peer.join(35)
    if failures:
        raise SystemExit(f"features not delivered: {failures}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.feature_send", description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rows", type=int, default=16, help="feature rows per request (block)")
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    run(args.batches, args.rows, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
