"""Heartbeats of ranks started by `torchrun`: how rank 0 tells which rank is gone.

Spawned workers are the driver's children, so it sees one exit the moment it does. Ranks that
`torchrun` started, maybe on other machines, are not: a collective with a dead one fails (gloo)
or is aborted, but says nothing about which rank it was, and between steps nothing fails at
all. So each worker adds one to a counter in the rendezvous store (``MASTER_ADDR:MASTER_PORT``,
which lives on rank 0's machine) every :data:`INTERVAL` seconds, from a thread of its own, and
the driver watches the counters: a rank whose counter stands still for :data:`SILENCE` seconds
is reported gone. Both use a store connection of their own, never the process group's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

INTERVAL = 0.25  # seconds between a worker's beats
SILENCE = 3.0  # seconds without a beat after which a rank counts as gone
KEY = "pagedkv/heartbeat/{rank}"


def _connect(timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def start_beating(rank: int) -> threading.Event | None:
    """Beat for ``rank`` until the returned event is set (or the store goes away). None, with
    a warning, when the rendezvous store cannot be reached: then rank 0 can still tell that a
    rank failed, not which."""
    try:
        store = _connect()
    except Exception as exc:  # no store: beat nothing, but run
        logger.warning("rank %d: no heartbeat (cannot reach the rendezvous store: %s)", rank, exc)
        return None
    stop = threading.Event()
    key = KEY.format(rank=rank)

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception as exc:  # rank 0's machine is gone: nobody listens any more
                logger.debug("rank %d: heartbeat stopped: %s", rank, exc)
                return
            stop.wait(INTERVAL)

    threading.Thread(target=beat, name="pagedkv-tp-heartbeat", daemon=True).start()
    return stop


class HeartbeatWatcher:
    """The driver's side: calls ``on_silent(rank)`` once, from a thread of its own, for the
    first of ``ranks`` whose counter stands still for ``silence`` seconds."""

    def __init__(
        self,
        ranks: list[int],
        on_silent: Callable[[int], None],
        *,
        silence: float = SILENCE,
        store: dist.Store | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.on_silent = on_silent
        self.silence = silence
        self._store = store if store is not None else _connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pagedkv-tp-heartbeat-watch",
                                         daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        keys = {r: KEY.format(rank=r) for r in self.ranks}
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(INTERVAL):
            now = time.monotonic()
            for rank, key in keys.items():
                try:
                    count = self._store.add(key, 0)
                except Exception as exc:  # the store is rank 0's machine's: shutting down
                    logger.debug("heartbeat watch stopped: %s", exc)
                    return
                last = seen.get(rank)
                if last is None or last[0] != count:
                    seen[rank] = (count, now)
                elif now - last[1] > self.silence and not self._stop.is_set():
                    self.on_silent(rank)
                    return
