"""What `LLMEngine` drives: one `ModelRunner`, or a tensor-parallel group of them.

:func:`make_runner` returns the plain :class:`~pagedkv.engine.worker.model_runner.ModelRunner`
for ``tensor_parallel_size == 1`` (the engine's hot path is unchanged), else a
:class:`TensorParallelRunner` with the same interface (``execute``, ``execute_async``,
``num_gpu_blocks``, ``num_cpu_blocks``, ``max_num_batched_tokens``) that:

1. checks that the model can be split that way (a ``ValueError`` before anything starts);
2. spawns ``N - 1`` worker processes (or, under ``torchrun``, finds them started), joins them in
   one process group, and loads rank 0's shard beside theirs; the KV cache gets the smallest
   number of blocks that fits on every rank;
3. per step, broadcasts the batch to the workers as one int64 tensor (token ids, positions,
   block operations, and only the block-table entries that changed: `step_message`), then
   runs rank 0's share itself. A batch of plain greedy requests ends with the argmax computed
   alike on every rank from its vocabulary slice, so the tokens stay on every device and the
   next step can launch before the host has seen them (asynchronous scheduling,
   ``execute_async``); any other batch gathers the logits on rank 0, which samples;
4. watches the workers: a worker that exits, or a collective that fails or times out, ends the
   engine with a :class:`TensorParallelError` naming the rank and its exit code, and stops the
   other workers, instead of hanging; ``check_health`` says so at once, also between steps.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.distributed.heartbeat import SILENCE as HEARTBEAT_SILENCE
from pagedkv.engine.distributed.heartbeat import HeartbeatWatcher
from pagedkv.engine.distributed.parallel_state import (
    ParallelContext,
    apply_nccl_env,
    check_tensor_parallel,
    rank_device,
    torchrun_env,
)
from pagedkv.engine.distributed.step_message import (
    Kind,
    Mode,
    StepEncoder,
    StepMessage,
    control_message,
    send_message,
)
from pagedkv.engine.distributed.worker import (
    JOINED_KEY,
    build_rank_runner,
    run_torchrun_worker,
    spawned_worker_main,
)
from pagedkv.engine.outputs import RunnerOutput
from pagedkv.engine.worker.inputs import StepBatch, step_batch
from pagedkv.engine.worker.model_runner import (
    InFlightStep,
    ModelRunner,
    PendingTokens,
    sampling_seqs,
)
from pagedkv.engine.worker.sampling import BatchSampler

logger = logging.getLogger(__name__)

# Seconds to wait for a worker to exit after the stop message, then after SIGTERM.
_JOIN_TIMEOUT = 30.0
_KILL_TIMEOUT = 5.0


class TensorParallelError(RuntimeError):
    """The tensor-parallel engine cannot go on: a worker died, or a step failed partway so the
    ranks are no longer in step. Every later step raises it too; start a new engine."""


def make_runner(
    model_config: ModelConfig,
    args: EngineArgs,
    device: torch.device,
    model: torch.nn.Module | None = None,
) -> ModelRunner | TensorParallelRunner:
    """The runner for ``args.tensor_parallel_size`` (see the module docstring)."""
    if args.tensor_parallel_size == 1:
        return ModelRunner(model_config, args, device, model=model)
    if model is not None:
        raise ValueError(
            "a pre-loaded model cannot be split over tensor-parallel ranks; let the engine load "
            "it (model=None) or use tensor_parallel_size=1"
        )
    check_tensor_parallel(model_config, args.tensor_parallel_size, device)
    launch = torchrun_env()
    if launch is not None and launch.rank > 0:
        # A script run by torchrun on every rank: ranks > 0 serve rank 0's engine, then exit.
        raise SystemExit(run_torchrun_worker(args, model_config))
    return TensorParallelRunner(model_config, args, device)


class _Workers:
    """The spawned worker processes, and a thread that notices when one exits.

    Holds everything needed to stop the group, so that it can be stopped by a finalizer
    (without a reference to the runner) as well as explicitly."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}  # rank -> multiprocessing.Process
        self.ctx: ParallelContext | None = None
        self.release_graphs: Callable[[], None] | None = None  # the driver's runner's
        self.failure: tuple[int, int | None, int | None] | None = None  # rank, pid, exit code
        self.heartbeats: HeartbeatWatcher | None = None  # torchrun: ranks not our children
        self.stopping = threading.Event()
        self.closed = False
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None  # the only thread that reaps workers

    def spawn(
        self,
        world_size: int,
        port: int,
        device: torch.device,
        model_config: ModelConfig,
        args: EngineArgs,
    ) -> None:
        mp = torch.multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        threads = torch.get_num_threads()
        for rank in range(1, world_size):
            proc = mp.Process(
                target=spawned_worker_main,
                args=(
                    rank,
                    world_size,
                    "127.0.0.1",
                    port,
                    device.type,
                    model_config,
                    args,
                    level,
                    threads,
                ),
                name=f"pagedkv-tp-worker-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs[rank] = proc
        self._monitor = threading.Thread(target=self._watch, name="pagedkv-tp-monitor",
                                         daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        pending = {proc.sentinel: rank for rank, proc in self.procs.items()}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(sentinel)
                if self.stopping.is_set() or self.failure is not None:
                    # close() reaps the workers: two threads waiting on one child race, and
                    # the loser may see it as still running.
                    continue
                proc = self.procs[rank]
                proc.join(1.0)
                if self.stopping.is_set():
                    continue
                self.failure = (rank, proc.pid, proc.exitcode)
                logger.error("%s", self.describe_failure())
                self._unblock_driver()
                self._stop_survivors()

    def watch_heartbeats(self, world_size: int) -> None:
        """Ranks started by torchrun: watch their heartbeats (see `heartbeat`)."""
        try:
            self.heartbeats = HeartbeatWatcher(list(range(1, world_size)), self._silent)
        except Exception as exc:  # no store to watch: a failure will not name its rank
            logger.warning("cannot watch the workers' heartbeats: %s", exc)

    def _silent(self, rank: int) -> None:
        if self.stopping.is_set() or self.failure is not None:
            return
        self.failure = (rank, None, None)
        logger.error("%s", self.describe_failure())
        self._unblock_driver()

    def _unblock_driver(self) -> None:
        """A driver waiting in an NCCL collective for a dead rank would wait until the
        collective times out; aborting the communicators releases it at once."""
        ctx = self.ctx
        if ctx is None or ctx.device.type != "cuda":
            return  # gloo notices the closed connection by itself
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as exc:  # best effort: the collective timeout is the fallback
            logger.warning("could not abort the NCCL communicators: %s", exc)

    def _stop_survivors(self) -> None:
        """One rank gone breaks the group for good: stop the others now (they may wait for a
        message that never comes), without waiting for the driver's next step."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()

    def describe_failure(self) -> str:
        if self.failure is None:
            return ""
        rank, pid, code = self.failure
        if pid is None:
            return (
                f"tensor-parallel rank {rank} stopped responding (no heartbeat for "
                f"{HEARTBEAT_SILENCE:.0f} s: its process died or its machine is unreachable); "
                "the engine is stopped"
            )
        if code is None:
            how = "stopped responding"
        elif code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        hint = " (its error is in the log above)" if code is not None and code > 0 else ""
        return f"tensor-parallel worker rank {rank} (pid {pid}) {how}{hint}; the engine is stopped"

    def wait_for_failure(self, seconds: float) -> None:
        """Give the monitor up to ``seconds`` to see a worker exit (a collective usually
        fails a moment before the dead process is reaped)."""
        deadline = time.monotonic() + seconds
        while self.failure is None and time.monotonic() < deadline:
            # Not `proc.is_alive()`: it reaps the child, and then the monitor, which names the
            # dead rank, may lose the race and never see the exit.
            if self._monitor is not None and not self._monitor.is_alive():
                break  # every worker exited: the monitor has said what it will say
            if not self.procs and self.heartbeats is None:
                break  # nothing watches torchrun's ranks
            time.sleep(0.02)

    def while_watching(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, run in a helper thread while this one watches the workers: a worker that
        dies meanwhile raises `TensorParallelError` at once, leaving ``fn`` behind (it fails
        by its own timeout)."""
        box: list[Any] = []

        def call() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))

        thread = threading.Thread(target=call, name="pagedkv-tp-start", daemon=True)
        thread.start()
        while thread.is_alive():
            if self.failure is not None:
                raise TensorParallelError(self.describe_failure())
            thread.join(0.02)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def wait_joined(self, store: Any, timeout_s: float) -> None:
        """Wait until every worker has reached the rendezvous, failing fast if one dies first
        (before the process group exists, nothing else would notice)."""
        keys = [JOINED_KEY.format(rank=r) for r in self.procs]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if self.failure is not None:
                raise TensorParallelError(self.describe_failure())
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not start within {timeout_s:.0f} s "
                    "(--distributed-timeout)"
                )
            time.sleep(0.02)

    def close(self, *, graceful: bool = True) -> None:
        """Stop the workers (the stop message, then SIGTERM, then SIGKILL) and leave the
        process groups. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.stopping.set()
        if self.heartbeats is not None:
            self.heartbeats.stop()
        ctx = self.ctx
        if graceful and ctx is not None and self.failure is None:
            try:
                send_message(control_message(Kind.STOP), ctx.cpu_group)
                # Every rank leaves the groups at the same time: NCCL's teardown waits for the
                # peers, so the driver must not first wait for the workers to exit.
                if self.release_graphs is not None:
                    self.release_graphs()
                ctx.destroy()
            except Exception as exc:
                logger.warning("could not stop the workers cleanly: %s", exc)
        deadline = time.monotonic() + (_JOIN_TIMEOUT if graceful else 0.0)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(_KILL_TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(_KILL_TIMEOUT)
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s (pid %d) is still exiting", proc.name,
                               proc.pid)
        if ctx is not None:
            if self.failure is not None:
                self._unblock_driver()
            ctx.destroy()


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group: `ModelRunner`'s interface over all ranks."""

    def __init__(self, model_config: ModelConfig, args: EngineArgs, device: torch.device) -> None:
        tp = args.tensor_parallel_size
        check_tensor_parallel(model_config, tp, device)
        apply_nccl_env()
        self.args = args
        self.world_size = tp
        self._workers = _Workers()
        self._error: TensorParallelError | None = None
        self._encoder = StepEncoder()
        launch = torchrun_env()
        timeout_s = float(args.distributed_timeout)
        import torch.distributed as dist

        group_was_up = dist.is_available() and dist.is_initialized()
        try:
            if launch is None:
                if sys.platform.startswith("linux"):
                    # all ranks on this machine: gloo over loopback, whatever the host name
                    # resolves to (workers inherit the setting)
                    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                store = dist.TCPStore(
                    "127.0.0.1",
                    0,
                    tp,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s),
                )
                self._workers.spawn(tp, store.port, device, model_config, args)
                self._workers.wait_joined(store, timeout_s)
                rank0 = rank_device(device, 0)
                if rank0.type == "cuda":
                    torch.cuda.set_device(rank0)
                # A worker that dies now would leave the rendezvous waiting for it until the
                # timeout: wait for it in another thread, watching the workers meanwhile.
                ctx = self._workers.while_watching(lambda: ParallelContext.init(
                    0, tp, rank0, timeout_s=timeout_s, store=store
                ))
            else:
                ctx = ParallelContext.init(
                    launch.rank,
                    tp,
                    rank_device(device, launch.local_rank),
                    timeout_s=timeout_s,
                    init_method="env://",
                )
                self._workers.watch_heartbeats(tp)
            self._workers.ctx = ctx
            self.ctx = ctx
            self.local = build_rank_runner(ctx, model_config, args)
            self._workers.release_graphs = self.local.release_graphs
        except BaseException as exc:
            self._workers.wait_for_failure(2.0)
            failure = self._workers.describe_failure()
            self._workers.close(graceful=False)
            if self._workers.ctx is None and not group_was_up and dist.is_initialized():
                # A worker died after the default group came up but before the context was
                # complete: nothing else would leave the group this start joined.
                try:
                    dist.destroy_process_group()
                except Exception as destroy_exc:
                    logger.warning("could not leave the process group: %s", destroy_exc)
            if failure:
                raise TensorParallelError(failure) from exc
            raise
        self.device = self.local.device
        self._finalizer = weakref.finalize(self, self._workers.close)
        logger.info(
            "tensor parallelism over %d ranks (%s): %d KV blocks per rank",
            tp,
            "torchrun" if launch is not None else "spawned workers",
            self.local.num_gpu_blocks,
        )

    # ---- what the engine reads -------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.local.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.local.num_cpu_blocks

    @property
    def max_num_batched_tokens(self) -> int:
        return self.local.max_num_batched_tokens

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shard of the model."""
        return self.local.model

    @property
    def step_log(self) -> list | None:
        """Rank 0's per-pass log for benchmarks (every rank runs the same passes)."""
        return self.local.step_log

    @step_log.setter
    def step_log(self, value: list | None) -> None:
        self.local.step_log = value

    @property
    def step_gpu_events(self) -> list:
        """Rank 0's device time per pass (see `ModelRunner.step_gpu_events`)."""
        return self.local.step_gpu_events

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out) -> RunnerOutput:
        """Run one scheduled step on every rank. A batch of plain greedy requests ends with
        the argmax computed alike on every rank (`Mode.TOKENS`, no logits gathered); any
        other gathers the logits on rank 0, which samples."""
        batch = step_batch(out)
        plain, plan = self.local.plan_logits(out, batch)
        if plan is not None:  # refused when the request is prepared (see LLMEngine)
            raise ValueError("prompt_logprobs is not supported with tensor parallelism yet")
        if plain:
            seqs = sampling_seqs(out, batch)
            return self._guard(lambda: BatchSampler.argmax_output(
                seqs, self._launch(out, batch, Mode.TOKENS).tolist()))
        return self._guard(lambda: self.local.sample(
            out, batch.sample_idx, self._launch(out, batch, Mode.LOGITS), plain=False))

    @torch.inference_mode()
    def execute_async(self, out) -> InFlightStep:
        """Launch one plain greedy step on every rank without waiting for it (asynchronous
        scheduling, see `ModelRunner.execute_async`). Every rank computes the argmax alike
        and keeps it on its device, where the next step's pending tokens read it: the sampled
        tokens reach the workers without passing through the host."""
        batch = step_batch(out)
        pending = self.local.pending_tokens(batch)

        def launch() -> InFlightStep:
            tokens = self._launch(out, batch, Mode.TOKENS, pending)
            return self.local.in_flight(out, batch, tokens)

        return _CheckedInFlight(self, self._guard(launch))

    def _launch(
        self, out, batch: StepBatch, mode: Mode, pending: PendingTokens | None = None
    ) -> torch.Tensor | None:
        """Send the step to the workers, then run rank 0's share of it."""
        started = time.perf_counter()
        rows, sources = (pending.rows, pending.sources) if pending is not None else ([], [])
        seq_ids = [ss.seq_id for ss in out.scheduled]
        send_message(self._encoder.encode(batch, seq_ids, mode, rows, sources), self.ctx.cpu_group)
        return self.local.run_step(StepMessage(0, mode, batch, rows, sources), started=started)

    def rank_stats(self) -> list[dict[str, int]]:
        """What each rank has run, by rank (`RankRunner.stats`): steps, CUDA-graph replays,
        eager passes. Every rank runs every step the same way, so these agree."""

        def collect() -> list[dict[str, int]]:
            send_message(control_message(Kind.STATS), self.ctx.cpu_group)
            return self.ctx.gather_object(self.local.stats())

        return self._guard(collect)

    def rank_timings(self) -> list[dict[str, Any]]:
        """Per rank, by rank: where its steps went since the last call, per kind of pass and
        batch-size band (`step_timing`; format with `step_timing.format_rank_timings`). Empty
        dicts unless ``PAGEDKV_TP_DIAG`` was set when the engine started."""

        def collect() -> list[dict[str, Any]]:
            send_message(control_message(Kind.TIMINGS), self.ctx.cpu_group)
            return self.ctx.gather_object(self.local.timing_summary())

        return self._guard(collect)

    def __getattr__(self, name: str) -> Any:
        """Other `ModelRunner` attributes read rank 0's; a method would run on rank 0 only,
        leaving the workers behind, so it must be forwarded explicitly above."""
        local = self.__dict__.get("local")
        if local is None or name.startswith("__"):
            raise AttributeError(name)
        value = getattr(local, name)
        if callable(value):
            raise AttributeError(
                f"ModelRunner.{name} is not forwarded to the tensor-parallel workers; "
                "add it to TensorParallelRunner (and to the worker loop)"
            )
        return value

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (work that involves every rank) unless the group is broken; any failure
        in it breaks the group for good (see `_fail`)."""
        if self._workers.failure is not None:
            raise self._fail(None)
        self.check_health()
        try:
            result = fn()
        except BaseException as exc:  # Ctrl-C too: the workers cannot be left mid-step
            error = self._fail(exc)
            if isinstance(exc, Exception):
                raise error from exc
            raise
        if self._workers.failure is not None:
            # A collective with a dead peer may have returned garbage (NCCL aborted).
            raise self._fail(None)
        return result

    def _fail(self, exc: BaseException | None) -> TensorParallelError:
        """Stop every rank and remember why: the ranks can no longer be kept in step."""
        if self._error is not None:
            return self._error
        if exc is not None:
            self._workers.wait_for_failure(5.0)
        reason = self._workers.describe_failure()  # the monitor has logged it
        if not reason:
            reason = (
                f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); "
                "the ranks are out of step, so the engine is stopped"
            )
            logger.error("%s", reason)
        self._error = TensorParallelError(reason)
        self._workers.close(graceful=False)
        return self._error

    # ---- lifetime --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers and leave the process groups (also done at garbage collection and
        interpreter exit)."""
        self._finalizer()

    @property
    def is_alive(self) -> bool:
        """Whether every rank is there to run the next step (cheap: the monitor notices a
        worker's exit at once, also while the engine idles)."""
        return self._error is None and self._workers.failure is None and not self._workers.closed

    def check_health(self) -> None:
        """Raise `TensorParallelError` (naming the rank that died) when the group cannot run
        another step; return quietly otherwise. Safe to call from any thread."""
        if self._error is not None:
            raise self._error
        if self._workers.failure is not None:
            raise TensorParallelError(self._workers.describe_failure())
        if self._workers.closed:
            raise TensorParallelError("the tensor-parallel engine was shut down; start a new one")


class _CheckedInFlight:
    """An `InFlightStep` of a tensor-parallel step: waiting for its tokens also checks that
    every rank is still there (a dead peer can make an aborted collective finish early)."""

    __slots__ = ("_inner", "_runner")

    def __init__(self, runner: TensorParallelRunner, inner: InFlightStep) -> None:
        self._runner = runner
        self._inner = inner

    def finish(self) -> None:
        self._inner.finish()  # nothing to do: the tensor-parallel pass masks no rows

    def result(self) -> RunnerOutput:
        return self._runner._guard(self._inner.result)
