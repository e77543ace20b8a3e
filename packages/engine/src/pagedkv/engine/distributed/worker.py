"""One tensor-parallel rank: its shard of the model, its heads' KV cache, and the worker loop.

Every rank, the driver included, builds a :class:`RankRunner` (a `ModelRunner` over its shard,
whose KV cache holds its share of the KV heads). Ranks > 0 then run :func:`serve`: receive the
driver's message for each step over the CPU group (a flat int64 tensor, see `step_message`),
and run it (`RankRunner.run_step`: block swaps and copies, the forward pass with its
collectives), until the driver says stop. A step either gathers its logits on the driver, which
samples, or (plain greedy requests) ends with the argmax computed alike on every rank, which
keeps the tokens on the device for the next step (asynchronous scheduling).

Workers start in one of two ways:

* spawned by the driver (`--tensor-parallel-size N` on one machine): :func:`spawned_worker_main`;
* by `torchrun`, on one or several machines: every process runs the same command; the
  `pagedkv` command line turns ranks > 0 into workers (:func:`run_torchrun_worker`), or run
  `python -m pagedkv.engine.distributed.worker <engine options>` on those ranks.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.distributed.communication import argmax_over_ranks
from pagedkv.engine.distributed.heartbeat import start_beating
from pagedkv.engine.distributed.parallel_state import (
    ParallelContext,
    check_tensor_parallel,
    rank_device,
    rank_model_config,
    torchrun_env,
)
from pagedkv.engine.distributed.step_message import (
    Kind,
    Mode,
    StepDecoder,
    StepMessage,
    message_kind,
    recv_message,
)
from pagedkv.engine.distributed.step_timing import StepTimings, diag_enabled
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.worker.model_runner import ModelRunner, PendingTokens, resolve_device

logger = logging.getLogger(__name__)

JOINED_KEY = "pagedkv/worker_joined/{rank}"


class RankRunner(ModelRunner):
    """A `ModelRunner` over one rank's shard. Its KV cache has the same number of blocks on
    every rank: the smallest number that fits on any of them."""

    def __init__(self, ctx: ParallelContext, *args: Any, **kwargs: Any) -> None:
        self.ctx = ctx
        self.steps = 0
        self.steps_with_pending = 0  # steps whose input tokens came from the device
        super().__init__(*args, **kwargs)
        head = getattr(self.model, "lm_head", None)
        self._head = self.model.embed_tokens if head is None else head
        if self.device.type == "cuda" and ctx.world_size > 1:
            self._load_logits_kernels(self.args.max_num_seqs)  # its slice: no collective
        # per-step timings with PAGEDKV_TP_DIAG=1 (`step_timing`); None: nothing recorded
        self.timings = StepTimings(self.device) if diag_enabled() else None

    def _num_blocks_that_fit(self) -> int:
        return self.ctx.min_int(super()._num_blocks_that_fit())

    def run_step(
        self, msg: StepMessage, *, started: float | None = None, waited: float = 0.0
    ) -> torch.Tensor | None:
        """Run one step as every rank runs it (the driver too). `Mode.LOGITS`: the logits of
        the sampling rows on the driver, None elsewhere. `Mode.TOKENS`: their argmax ids on
        every rank, kept for the pending tokens of the next step.

        `started` (`time.perf_counter()` when the rank began this step: the driver before
        encoding it, a worker once the message arrived) and `waited` (a worker's time blocked
        for the message) feed the per-step timings, when they are on."""
        timings = self.timings
        if timings is None:
            return self._run_step(msg)
        if started is None:
            started = time.perf_counter()
        replays = self.graph_replays
        probe = timings.start()
        result = self._run_step(msg)
        host = time.perf_counter() - started
        batch = msg.batch
        kind = ("decode-graph" if self.graph_replays > replays else
                "decode-eager" if batch.is_decode else "prefill/mixed")
        timings.finish(probe, kind, batch.num_seqs, waited, host)
        return result

    def _run_step(self, msg: StepMessage) -> torch.Tensor | None:
        pending = None
        if msg.pending_rows:
            pending = PendingTokens(msg.pending_rows, msg.pending_sources, self._last_tokens)
            self.steps_with_pending += 1
        self.steps += 1
        if msg.mode == Mode.TOKENS:
            tokens = self.run(msg.batch, pending, greedy=True)
            self._last_tokens = tokens
            return tokens
        if pending is not None:
            raise RuntimeError("pending tokens need a step of greedy tokens before them")
        return self.run(msg.batch)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the whole vocabulary on every rank, from this rank's vocabulary slice
        of the logits (`communication.argmax_over_ranks`): no rank gathers the logits."""
        if self.ctx.world_size == 1:
            return super().greedy_tokens(hidden)
        head = self._head
        local = self.greedy_logits(hidden)
        valid = head.vocab_end - head.vocab_start
        if valid < local.shape[-1]:
            local[:, valid:] = float("-inf")  # the padding rows of the last slice
        return argmax_over_ranks(local, head.vocab_start, self.ctx.tp)

    def greedy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits (the whole vocabulary on one rank)."""
        if self.ctx.world_size == 1:
            return super().greedy_logits(hidden)
        return F.linear(hidden, self._head.weight)

    def timing_summary(self) -> dict[str, Any]:
        """This rank's per-step timings since the last call (`StepTimings.summary`); empty
        unless ``PAGEDKV_TP_DIAG`` is set."""
        return self.timings.summary() if self.timings is not None else {}

    def stats(self) -> dict[str, int]:
        """What this rank ran: steps (and those that read pending tokens on the device),
        CUDA-graph replays and eager passes, captured graphs, KV blocks."""
        return {"rank": self.ctx.rank, "steps": self.steps,
                "steps_with_pending": self.steps_with_pending,
                "graph_replays": self.graph_replays, "eager_passes": self.eager_passes,
                "num_graphs": len(self.graphs.graphs) if self.graphs is not None else 0,
                "num_gpu_blocks": self.num_gpu_blocks}


def build_rank_runner(
    ctx: ParallelContext, model_config: ModelConfig, args: EngineArgs
) -> RankRunner:
    """Load this rank's shard and size its KV cache (collective: every rank calls it)."""
    model = load_model(
        model_config,
        load_format=args.load_format,
        device=ctx.device,
        dtype=model_config.dtype,
        seed=args.seed,
        tp=ctx.tp,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
    )
    runner = RankRunner(
        ctx, rank_model_config(model_config, ctx.world_size), args, ctx.device, model=model
    )
    for what, n in (("KV", runner.num_gpu_blocks), ("swap", runner.num_cpu_blocks)):
        low, high = ctx.min_int(n), ctx.max_int(n)
        if low != high:
            raise RuntimeError(
                f"tensor-parallel ranks disagree on the number of {what} blocks ({low} to {high}); "
                "this is a bug: please report it"
            )
    return runner


@torch.inference_mode()
def serve(ctx: ParallelContext, runner: RankRunner) -> None:
    """Execute the driver's steps until it says stop."""
    decoder = StepDecoder()
    # As the driver's engine does: a full collection walks every object torch and the model
    # created, a stall of the whole group; what lives now lives as long as the loop.
    gc.collect()
    gc.freeze()
    clock = time.perf_counter
    while True:
        idle = clock()
        header, payload = recv_message(ctx.cpu_group)
        kind = message_kind(header)
        if kind == Kind.STEP:
            arrived = clock()
            runner.run_step(decoder.decode(header, payload), started=arrived,
                            waited=arrived - idle)
        elif kind == Kind.STATS:
            ctx.gather_object(runner.stats())
        elif kind == Kind.TIMINGS:
            ctx.gather_object(runner.timing_summary())
        elif kind == Kind.STOP:
            logger.info("rank %d: the driver stopped the engine after %d steps", ctx.rank,
                        runner.steps)
            runner.release_graphs()
            return


def _setup_logging(rank: int, level: int) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s",
        force=True,
    )


def spawned_worker_main(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    device_type: str,
    model_config: ModelConfig,
    args: EngineArgs,
    log_level: int,
    num_threads: int,
) -> None:
    """Entry point of a worker spawned by the driver (a `multiprocessing` spawn target).

    Exits with code 0 when the driver stops the engine, 1 on any error (logged). Ctrl-C is
    left to the driver, which stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_logging(rank, log_level)
    _exit_with_parent(rank)
    torch.set_num_threads(max(1, num_threads))
    ctx = None
    try:
        import torch.distributed as dist

        timeout = timedelta(seconds=args.distributed_timeout)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        store.set(JOINED_KEY.format(rank=rank), "1")
        device = rank_device(torch.device(device_type), rank)
        ctx = ParallelContext.init(
            rank, world_size, device, timeout_s=args.distributed_timeout, store=store
        )
        serve(ctx, build_rank_runner(ctx, model_config, args))
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        sys.exit(1)
    finally:
        if ctx is not None:
            ctx.destroy()


def _exit_with_parent(rank: int) -> None:
    """Exit when the driver process is gone, even while blocked in a collective that would
    otherwise wait for its timeout (the driver killed by SIGKILL, say)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.error("tensor-parallel worker rank %d: the driver process exited; exiting", rank)
        os._exit(1)

    threading.Thread(target=watch, name="pagedkv-tp-parent-watch", daemon=True).start()


def run_torchrun_worker(args: EngineArgs, model_config: ModelConfig | None = None) -> int:
    """Serve as the worker of a rank > 0 started by `torchrun` (rank 0 runs the engine with the
    same engine options) until rank 0 stops. Returns the exit code."""
    launch = torchrun_env()
    if launch is None or launch.rank == 0:
        raise ValueError(
            "run_torchrun_worker is for ranks > 0 of a torchrun launch (RANK and WORLD_SIZE unset "
            "or RANK=0); rank 0 runs the engine itself"
        )
    device = resolve_device(args.device)
    if model_config is None:
        model_config = ModelConfig.from_model(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            device=device,
        )
    check_tensor_parallel(model_config, args.tensor_parallel_size, device)
    ctx = ParallelContext.init(
        launch.rank,
        launch.world_size,
        rank_device(device, launch.local_rank),
        timeout_s=args.distributed_timeout,
        init_method="env://",
    )
    beating = start_beating(launch.rank)  # how rank 0 tells that this rank is gone
    try:
        serve(ctx, build_rank_runner(ctx, model_config, args))
    finally:
        if beating is not None:
            beating.set()
        ctx.destroy()
    return 0


def run_torchrun_worker_cli(ns: argparse.Namespace) -> int:
    """`pagedkv ...` on a torchrun rank > 0: serve as a worker with the command's engine
    options instead of running the command."""
    launch = torchrun_env()
    logger.info(
        "torchrun rank %s of %s: serving as a tensor-parallel worker of rank 0",
        launch.rank if launch else "?",
        launch.world_size if launch else "?",
    )
    try:
        return run_torchrun_worker(EngineArgs.from_cli_args(ns))
    except ValueError as exc:
        print(f"pagedkv worker: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedkv.engine.distributed.worker <engine options>` on torchrun ranks > 0."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.engine.distributed.worker",
        description="a tensor-parallel worker for torchrun ranks > 0 (rank 0 runs the engine "
        "with the same engine options)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    launch = torchrun_env()
    _setup_logging(
        launch.rank if launch else 0, getattr(logging, ns.log_level.upper(), logging.INFO)
    )
    return run_torchrun_worker_cli(ns)


if __name__ == "__main__":
    sys.exit(main())
