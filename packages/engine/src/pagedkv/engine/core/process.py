"""The engine-core process: `python -m pagedkv.engine.core ...`, started by `MPClient`.

It loads the engine, says `READY` (or `FATAL` with the reason), then runs the busy loop: no
asyncio, no thread on the hot path. Between steps it takes every request and abort that has
arrived; after each step it sends one `EngineCoreOutputs`. While nothing runs it blocks on
the input socket.

It never outlives the API process that started it: the kernel kills it when that process
dies (`PR_SET_PDEATHSIG`, Linux), and a watch thread ends it when its parent changes (any
system). Ctrl-C in a terminal reaches the whole process group: the core ignores SIGINT and
leaves the graceful part of shutting down to the API process, which drains its streams and
then sends `SHUTDOWN`. SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from pagedkv.engine.core.messages import (
    KIND_ABORT,
    KIND_ADD,
    KIND_FATAL,
    KIND_OUTPUTS,
    KIND_READY,
    KIND_SHUTDOWN,
    CoreFatal,
    Encoder,
    EngineCoreRequest,
    decoder,
)

logger = logging.getLogger("pagedkv.engine.core")

#: While idle the loop wakes this often (ms) with nothing to do (the parent watch is a thread).
IDLE_POLL_MS = 1000
#: How often the watch thread checks that the parent is still there.
PARENT_WATCH_S = 0.5
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    """End this process when `parent_pid` ends (see the module docstring).

    `pdeathsig`: ask the kernel for SIGKILL when the parent *thread* ends, which the parent
    asks for only when it started us from its main thread (a worker thread's end would
    otherwise kill us while the parent lives)."""
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the thread suffices
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent watch")
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(PARENT_WATCH_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="pagedkv-core-parent-watch", daemon=True).start()


def run_busy_loop(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, trace: Any = None,
                  profile: Any = None) -> None:
    """Step while there is work, read inputs between steps, block while idle; returns on
    `SHUTDOWN`. `trace`: a `StepTrace`, given the loop's own phases; `profile`: a
    `CoreProfile`, told of each iteration that stepped."""
    clock = time.perf_counter
    enc = Encoder()
    dec_request = decoder(EngineCoreRequest)
    dec_ids = decoder(list[str])
    send = out_sock.send_multipart
    poll = in_sock.poll
    recv = in_sock.recv_multipart
    while True:
        if not core.has_work:
            msg = core.idle_message()
            if msg is not None:
                send((KIND_OUTPUTS, enc.encode(msg)), copy=False)
            if not poll(IDLE_POLL_MS):
                continue
        t0 = clock()
        while poll(0):
            kind, payload = recv()
            if kind == KIND_ADD:
                core.add_request(dec_request.decode(payload))
            elif kind == KIND_ABORT:
                core.abort(dec_ids.decode(payload))
            elif kind == KIND_SHUTDOWN:
                return
            else:
                logger.error("unknown message kind %r from the API process; ignored", kind)
        if core.has_work:
            t1 = clock()
            msg = core.step()
            t2 = clock()
            if not msg.is_empty:
                send((KIND_OUTPUTS, enc.encode(msg)), copy=False)
            if trace is not None:
                trace.loop["inputs"] = round((t1 - t0) * 1e3, 4)
                trace.loop["send"] = round((clock() - t2) * 1e3, 4)
            if profile is not None:
                profile.tick()


def _fatal(out_sock: zmq.Socket, exc: BaseException) -> None:
    msg = CoreFatal(type(exc).__name__, str(exc), traceback.format_exc())
    with contextlib.suppress(zmq.ZMQError):  # the API process is gone already
        out_sock.send_multipart((KIND_FATAL, Encoder().encode(msg)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.engine.core",
                                     description="pagedkv engine core (started by the server)")
    parser.add_argument("--engine-args", required=True, help="EngineArgs fields as JSON")
    parser.add_argument("--input", required=True, help="ZMQ address to read requests from")
    parser.add_argument("--output", required=True, help="ZMQ address to send outputs to")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--pdeathsig", action="store_true")
    parser.add_argument("--log-level", default="INFO")
    ns = parser.parse_args(argv)
    die_with_parent(ns.parent_pid, ns.pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s",
    )
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    out_sock.setsockopt(zmq.LINGER, 2000)  # let a last FATAL reach the API process
    out_sock.connect(ns.output)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(ns.input)
    engine = trace = profile = None
    try:
        try:
            from pagedkv.engine.arg_utils import EngineArgs
            from pagedkv.engine.core.engine_core import EngineCore
            from pagedkv.engine.core.step_trace import profile_from_env, trace_from_env
            from pagedkv.engine.llm_engine import LLMEngine

            engine = LLMEngine(EngineArgs(**json.loads(ns.engine_args)))
            if engine.device.type == "cuda":
                # The host's tensors here are a step's small index lists. With torch's
                # intra-op threads a copy of a few hundred rows (`StagedTables`) wakes one
                # thread per core, and while the API process and its clients keep the other
                # cores busy it waits for the slowest to be scheduled: ~10 ms, once per step in
                # which the batch changed (measured on an H200 at 40 req/s).
                import torch

                torch.set_num_threads(1)
            core = EngineCore(engine)
            trace = trace_from_env(engine)
            profile = profile_from_env()
        except BaseException as exc:
            logger.exception("the engine core could not start")
            _fatal(out_sock, exc)
            return 1
        out_sock.send_multipart((KIND_READY, Encoder().encode(core.ready_message())))
        logger.info("engine core ready (pid %d)", os.getpid())
        try:
            run_busy_loop(core, in_sock, out_sock, trace, profile)
        except BaseException as exc:
            logger.exception("the engine core loop stopped on an error")
            _fatal(out_sock, exc)
            return 1
        logger.info("engine core shutting down")
        return 0
    finally:
        if trace is not None:
            trace.close()
        if profile is not None:
            profile.close()
        if engine is not None:
            engine.shutdown()
        in_sock.close(linger=0)
        out_sock.close()
        ctx.term()
