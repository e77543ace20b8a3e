"""`AsyncLLMEngine`: the engine behind an asyncio server.

The engine loop runs in one background thread (a step is CPU or GPU bound and must not block
the event loop that serves HTTP). Requests and aborts reach the loop through a thread-safe
queue; each request's outputs come back to its own `asyncio.Queue`. Cancelling a request's
stream (for example when the HTTP client disconnects) aborts the request, which frees its
KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import EngineStats, LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped because of an error; the server should report unhealthy."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    """An `LLMEngine` driven by a background thread, with one async stream per request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stats = engine.get_stats()
        self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args))

    # ---- what the server uses ---------------------------------------------------------------
    @property
    def model_config(self):
        return self.engine.model_config

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def errored(self) -> bool:
        return self._error is not None or (not self._thread.is_alive() and not self._stop.is_set())

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")

    def get_stats(self) -> EngineStats:
        """The stats of the last step boundary (read without locking the engine)."""
        return self._stats

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; the last one has `finished=True`.

        Invalid input raises `ValueError` before anything is queued."""
        if self.errored:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        prepared = self.engine.prepare_request(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._inbox.put(("add", (request_id, prepared)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()  # tensor-parallel workers, if any

    # ---- the loop -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prepared = payload
                with self._lock:
                    live = request_id in self._streams
                if live:  # the client may have gone before the loop saw the request
                    self.engine.add_prepared_request(request_id, prepared)
            else:
                self.engine.abort_request(payload)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.get_stats()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._stats = self.engine.get_stats()
        except BaseException as exc:  # the loop must report, never vanish silently
            logger.exception("engine loop died")
            self._error = exc
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"the engine loop died: {exc!r}"))
