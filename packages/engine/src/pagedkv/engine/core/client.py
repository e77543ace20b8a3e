"""How the API process reaches the engine core: `MPClient` (its own process, over ZMQ) or
`InprocClient` (a thread of this process, for tests and notebooks). Both take requests and
aborts and deliver each step's `EngineCoreOutputs` to a callback on the event loop, so the
frontend (`AsyncLLMEngine`) does not know which one it has.

The sockets are ZMQ `ipc://` endpoints in a fresh private directory (mode 0700): only this
user's processes can connect, which matters because requests carry pickled `SamplingParams`.
The API process binds both; the core connects. Only the event loop's thread uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pagedkv.engine.core.messages import (
    KIND_ABORT,
    KIND_ADD,
    KIND_FATAL,
    KIND_OUTPUTS,
    KIND_READY,
    KIND_SHUTDOWN,
    CoreFatal,
    Encoder,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    decoder,
)

logger = logging.getLogger(__name__)

OnOutputs = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died, or its loop raised); the server reports
    unhealthy and ends every request in flight with this error."""


class CoreClient:
    """The interface both clients share."""

    ready: EngineCoreReady

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
              on_dead: OnDead) -> None:
        """Start delivering step messages to `on_outputs` and the core's death to `on_dead`
        (once), both called on `loop`."""
        raise NotImplementedError

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    arrival_time: float) -> None:
        """Queue a checked request; `params` are the `SamplingParams` the core samples with."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


# ---- its own process ---------------------------------------------------------------------------
def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM after `timeout` seconds of waiting, then SIGKILL."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _finalize(proc: subprocess.Popen, folder: str) -> None:
    """Last resort at garbage collection or interpreter exit: no orphan, no leftover folder."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # pragma: no cover
            proc.wait(5)
    shutil.rmtree(folder, ignore_errors=True)


class MPClient(CoreClient):
    """The engine core in its own process (`python -m pagedkv.engine.core`).

    The constructor starts the process and returns at once (the caller can load its tokenizer
    meanwhile); `wait_ready()` blocks until the core has loaded the model.
    """

    def __init__(self, args: Any, *, log_level: str | None = None,
                 core_command: list[str] | None = None) -> None:
        """`core_command`: what to run instead of `python -m pagedkv.engine.core` (a stand-in
        that speaks the same messages, e.g. `scripts/serve_frontend_load.py`'s); it gets the
        same options."""
        self._folder = tempfile.mkdtemp(prefix="pagedkv-core-")  # mode 0700
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(f"ipc://{self._folder}/in")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(f"ipc://{self._folder}/out")
        self._enc = Encoder()
        self._stopping = False
        self._dead_reported = False
        self._fatal: CoreFatal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_dead: OnDead | None = None
        self._recv_task: asyncio.Task | None = None
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        cmd = [
            *(core_command or [sys.executable, "-m", "pagedkv.engine.core"]),
            "--engine-args", json.dumps(dataclasses.asdict(args)),
            "--input", f"ipc://{self._folder}/in",
            "--output", f"ipc://{self._folder}/out",
            "--parent-pid", str(os.getpid()),
            "--log-level", str(level),
        ]
        if threading.current_thread() is threading.main_thread():
            cmd.append("--pdeathsig")
        self.proc = subprocess.Popen(cmd)
        self._finalizer = weakref.finalize(self, _finalize, self.proc, self._folder)
        logger.info("engine core process started (pid %d)", self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float | None = None) -> EngineCoreReady:
        """Block until the core is ready. Its start-up error is raised here: `ValueError` for a
        bad option (the user's to fix), `RuntimeError` otherwise, and the process is gone."""
        dec_ready = decoder(EngineCoreReady)
        dec_fatal = decoder(CoreFatal)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if self._out.poll(200):
                    kind, payload = self._out.recv_multipart()
                    if kind == KIND_READY:
                        self.ready = dec_ready.decode(payload)
                        return self.ready
                    if kind == KIND_FATAL:
                        fatal = dec_fatal.decode(payload)
                        if fatal.kind == "ValueError":
                            raise ValueError(fatal.message)
                        raise RuntimeError(f"the engine core failed to start: {fatal.kind}: "
                                           f"{fatal.message}")
                    continue
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(f"the engine core process {_describe_exit(code)} while "
                                       "starting (its log is above)")
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core was not ready after {timeout:g} s")
        except BaseException:
            self._stopping = True
            self.close()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
              on_dead: OnDead) -> None:
        self._loop = loop
        self._on_dead = on_dead
        self._recv_task = loop.create_task(self._receive(on_outputs))
        threading.Thread(target=self._watch, name="pagedkv-core-watch", daemon=True).start()

    async def _receive(self, on_outputs: OnOutputs) -> None:
        sock = zmq.asyncio.Socket.from_socket(self._out)
        dec_outputs = decoder(EngineCoreOutputs)
        dec_fatal = decoder(CoreFatal)
        try:
            while True:
                kind, payload = await sock.recv_multipart()
                if kind == KIND_OUTPUTS:
                    on_outputs(dec_outputs.decode(payload))
                elif kind == KIND_FATAL:
                    self._fatal = dec_fatal.decode(payload)
                    self._report_dead(None)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError:
            if not self._stopping:
                logger.exception("lost the engine core's socket")
                self._report_dead(None)
        except Exception as exc:  # a bug of the frontend: fail loudly rather than hang
            logger.exception("error while handling the engine core's outputs")
            self._report_dead(exc)

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._stopping and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                self._loop.call_soon_threadsafe(self._report_dead, None, code)

    def _report_dead(self, exc: BaseException | None, code: int | None = None) -> None:
        if self._dead_reported or self._stopping:
            return
        self._dead_reported = True
        if exc is None:
            if self._fatal is not None:
                why = f"its loop stopped on {self._fatal.kind}: {self._fatal.message}"
            else:
                why = _describe_exit(code if code is not None else self.proc.poll())
            exc = EngineDeadError(f"the engine core process (pid {self.proc.pid}) {why}")
        if self._on_dead is not None:
            self._on_dead(exc)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    arrival_time: float) -> None:
        req = EngineCoreRequest.of(request_id, prompt_token_ids, params, arrival_time)
        self._in.send_multipart((KIND_ADD, self._enc.encode(req)), copy=False)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._in.send_multipart((KIND_ABORT, self._enc.encode(request_ids)), copy=False)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait up to `timeout` s, then terminate it; close the sockets."""
        if self._stopping and self._ctx.closed:
            return
        self._stopping = True
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):  # pragma: no cover
                self._in.send_multipart((KIND_SHUTDOWN, b""))
            _stop_process(self.proc, timeout)
        self.close()

    def close(self) -> None:
        if self._recv_task is not None and not self._recv_task.done():
            self._recv_task.cancel()
        if not self._ctx.closed:
            self._in.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()
        self._finalizer()


# ---- a thread of this process ------------------------------------------------------------------
class InprocClient(CoreClient):
    """The engine core in a background thread of this process (tests, notebooks): the same
    messages as `MPClient`, handed over as objects, and the same GIL as the event loop."""

    def __init__(self, engine: Any) -> None:
        from pagedkv.engine.core.engine_core import EngineCore

        self.core = EngineCore(engine)
        self.ready = self.core.ready_message()
        self._inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OnOutputs | None = None
        self._on_dead: OnDead | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
              on_dead: OnDead) -> None:
        self._loop, self._on_outputs, self._on_dead = loop, on_outputs, on_dead
        self._thread.start()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    arrival_time: float) -> None:
        req = EngineCoreRequest(request_id, prompt_token_ids, b"", arrival_time)
        self._inbox.put(("add", req, params))
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.put(("abort", request_ids, None))
            self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.core.engine.shutdown()

    def _deliver(self, msg: EngineCoreOutputs) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_outputs, msg)
        except RuntimeError:  # the loop closed: nobody listens
            self._stop.set()

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before the inbox is read: a later put() wakes the wait
                while True:
                    try:
                        kind, payload, params = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "add":
                        core.add_request(payload, params)
                    else:
                        core.abort(payload)
                if core.has_work:
                    msg = core.step()
                    if not msg.is_empty:
                        self._deliver(msg)
                    continue
                msg = core.idle_message()
                if msg is not None:
                    self._deliver(msg)
                self._wake.wait(0.5)
        except BaseException as exc:  # the loop must report, never vanish silently
            logger.exception("engine loop died")
            dead = EngineDeadError(f"the engine loop died: {exc!r}")
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._on_dead, dead)
