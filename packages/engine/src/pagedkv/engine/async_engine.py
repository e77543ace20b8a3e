"""`AsyncLLMEngine`: the engine behind an asyncio server, with one async stream per request.

The engine's step loop runs apart from the event loop that serves HTTP:

* `AsyncLLMEngine.from_engine_args(args)` (the server's way) starts the **engine core in its
  own process** (`pagedkv.engine.core`): a busy loop with no asyncio that takes requests and
  aborts over ZMQ between steps and answers each step with one compact message. Per-token
  work for many streams (detokenization, stop strings, logprobs, JSON) never shares a GIL
  with the step loop.
* `AsyncLLMEngine(engine)` runs the same core in a thread of this process (tests,
  notebooks): the same messages, the same code on this side, no extra process.

This side (the *frontend*) checks and tokenizes each request (`InputProcessor`, with the
core's limits), sends it, and applies every step message to the live requests
(`pagedkv.engine.core.frontend`): detokenization, stop strings (a stop string aborts the
request in the core), logprobs. Cancelling a request's stream (for example when the HTTP
client disconnects) aborts the request, which frees its KV blocks at the core's next step.
When the core dies, every stream ends with `EngineDeadError`, `errored` turns true and
`on_dead` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.core.client import CoreClient, EngineDeadError, InprocClient, MPClient
from pagedkv.engine.core.engine_core import core_params
from pagedkv.engine.core.frontend import FrontendOutputs, OutputKind
from pagedkv.engine.core.messages import CoreStats, EngineCoreOutputs
from pagedkv.engine.input_processor import InputProcessor, PreparedRequest
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine"]


class AsyncLLMEngine:
    """Async streams over an engine core (its own process, or a thread; see the module
    docstring)."""

    def __init__(self, engine: Any = None, *, client: CoreClient | None = None,
                 tokenizer: Any = None) -> None:
        """`AsyncLLMEngine(engine)`: an `LLMEngine` stepped in a thread of this process.
        `client` and `tokenizer` are `from_engine_args`'s (the core in its own process)."""
        if (engine is None) == (client is None):
            raise ValueError("give an LLMEngine (in-process) or use from_engine_args(args)")
        if engine is not None:
            client = InprocClient(engine)
            shared = engine.get_tokenizer()
            # The engine thread may tokenize a text prompt of its own: never share a fast
            # tokenizer between two threads.
            tokenizer = copy.deepcopy(shared) if shared is not None else None
        self.engine = engine  # the in-process LLMEngine, or None
        self.client = client
        self.tokenizer = tokenizer
        ready = client.ready
        self.model_config = ready  # .name, .max_model_len, .vocab_size
        self.inputs = InputProcessor(
            tokenizer, vocab_size=ready.vocab_size, max_model_len=ready.max_model_len,
            kv_capacity=ready.kv_capacity, max_num_seqs=ready.max_num_seqs,
        )
        self.outputs = FrontendOutputs(tokenizer, ready.eos_token_ids)
        self._stats = CoreStats(num_gpu_blocks=ready.num_gpu_blocks,
                                num_cpu_blocks=ready.num_cpu_blocks)
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        #: Called once, on the event loop, when the engine core dies (the server stops then).
        self.on_dead: Callable[[BaseException], None] | None = None
        #: Called on the event loop with each step message (read-only: metrics).
        self.step_listeners: list[Callable[[EngineCoreOutputs], None]] = []
        #: Step messages handled, and the seconds spent handling them (where the time goes).
        self.num_step_messages = 0
        self.output_seconds = 0.0
        with contextlib.suppress(RuntimeError):  # no loop yet: attached at the first request
            self._attach(asyncio.get_running_loop())

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, multiprocess: bool = True) -> AsyncLLMEngine:
        """The engine for `args`. `multiprocess` (default): the core in its own process, which
        this call starts and waits for (a bad option raises `ValueError`); otherwise in a
        thread of this one."""
        if not multiprocess:
            from pagedkv.engine.llm_engine import LLMEngine

            return cls(LLMEngine.from_engine_args(args))
        from pagedkv.engine.config import ModelConfig
        from pagedkv.engine.llm_engine import load_tokenizer

        # Checked here first: a bad model or option fails before a process starts.
        mc = ModelConfig.from_model(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                    load_format=args.load_format, device="cpu")
        client = MPClient(args)
        try:
            tokenizer = load_tokenizer(args, mc)  # while the core loads the model
            client.wait_ready()
        except BaseException:
            client.shutdown(timeout=0)
            raise
        logger.info("engine core ready: %s on %s (pid %d), %d KV blocks of %d tokens",
                    client.ready.name, client.ready.device, client.ready.pid,
                    client.ready.num_gpu_blocks, client.ready.block_size)
        return cls(client=client, tokenizer=tokenizer)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop = loop
            self.client.start(loop, self._on_outputs, self._on_dead)

    # ---- what the server uses ---------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id (None when it runs in this process)."""
        return getattr(self.client, "pid", None)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopped

    @property
    def errored(self) -> bool:
        return self._dead is not None

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def get_stats(self) -> CoreStats:
        """The engine's counters as of its last message (sent at least every 0.5 s while it
        runs, and when it goes idle); the queue lengths as of its last step."""
        return self._stats

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> PreparedRequest:
        """Check and tokenize a request as `generate` would (raises `ValueError`); safe to call
        from a worker thread, so that a server keeps big prompts and grammar compilation off
        its event loop and then passes the result to `generate`."""
        return self.inputs.prepare(prompt, params)

    async def generate(
        self,
        prompt: str | list[int] | PreparedRequest,
        params: SamplingParams,
        request_id: str,
        *,
        output_kind: OutputKind = "cumulative",
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last one has `finished=True`.

        `output_kind`: "cumulative" (everything so far, each time), "delta" (what is new since
        the last output; needs best_of == n, no beam search) or "final" (only the finished
        output). Invalid input raises `ValueError` before anything is queued. `prompt` may be
        `prepare(prompt, params)`'s result (then it is not checked again)."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._attach(asyncio.get_running_loop())
        arrival = time.time()
        if isinstance(prompt, PreparedRequest):
            prep = prompt
        else:
            prep = self.inputs.prepare(prompt, params)
        st = self.outputs.add(request_id, prep, output_kind, arrival)
        self.client.add_request(request_id, prep.prompt_token_ids, core_params(prep.params),
                                arrival)
        take = self.outputs.take
        try:
            while True:
                st.event.clear()
                out = take(st)
                if out is not None:
                    yield out
                    if out.finished:
                        return
                    continue
                if st.error is not None:
                    raise st.error
                await st.event.wait()
        finally:
            self.outputs.pop(request_id)
            if not st.core_done and self._dead is None:
                self.client.abort([request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish reason "abort"."""
        self.client.abort([request_id])

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (its process or thread) and release its resources."""
        self._stopped = True
        self.client.shutdown(timeout)

    # ---- the core's messages ------------------------------------------------------------------
    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        t0 = time.perf_counter()
        to_abort = self.outputs.process(msg)
        if to_abort:
            self.client.abort(to_abort)
        if msg.stats is not None:
            self._stats = msg.stats
        elif msg.queues is not None:
            running, waiting, swapped = msg.queues
            self._stats = msgspec.structs.replace(
                self._stats, num_running=running, num_waiting=waiting, num_swapped=swapped)
        for listener in self.step_listeners:
            listener(msg)
        self.num_step_messages += 1
        self.output_seconds += time.perf_counter() - t0

    def _on_dead(self, exc: BaseException) -> None:
        if self._dead is not None or self._stopped:
            return
        self._dead = exc
        logger.error("%s", exc)
        self.outputs.fail_all(exc)
        if self.on_dead is not None:
            self.on_dead(exc)
