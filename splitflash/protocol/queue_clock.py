"""When a serve loop last saw its socket empty (serve_forever keeps it): how long a message
may have queued behind the loop's other work, which the services report to the gateway so
that waiting behind a long prompt's chunk does not read as slow transport."""

from __future__ import annotations

import time

import zmq


class QueueClock:
    """When a serve loop last saw its socket empty. A message the loop takes arrived after
    that moment, so `waited()` read at the start of its handler is an upper bound of the
    time it sat queued behind the loop's other work (a Deferred's slice, messages before
    it), and about 0 when it arrived while the loop waited. The loop looks before every
    receive and every Deferred slice, so the bound is loose only for a message that came
    late in a slice: at most that slice."""

    def __init__(self) -> None:
        self.empty_at = time.perf_counter()

    def waited(self) -> float:
        return max(0.0, time.perf_counter() - self.empty_at)

    def look(self, sock: zmq.Socket) -> bool:
        """Whether a message waits now; if none does, the socket was empty at this moment."""
        if sock.poll(0, zmq.POLLIN):
            return True
        self.empty_at = time.perf_counter()
        return False
