"""Output helpers shared by the engine benchmarks: a readable table, the closing JSON line, and
what stalls a timed run from outside our code: the caching allocator's calls to the driver
(Triton compiles: ``pagedattn_kernels.testing.compiled_kernels``). Nothing here imports torch
at module load, so ``pagedkv bench ... --help`` stays fast. (Their setup:
:mod:`pagedkv.bench.env`.)"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The CUDA caching allocator's counts of its calls to the driver (`torch.cuda.memory_stats`):
#: `cudaMalloc`s, `cudaFree`s, and retries (a failed `cudaMalloc` after which the allocator frees
#: its cached blocks and tries again). A `cudaFree` synchronizes the device, so inside a timed
#: run under asynchronous scheduling each one holds the host until the queued passes end.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_counts(device: Any) -> dict[str, int]:
    """`ALLOCATOR_COUNTERS` of `device` now ({} for a device that is not CUDA)."""
    if getattr(device, "type", None) != "cuda":
        return {}
    import torch

    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


@contextmanager
def allocator_calls(device: Any) -> Iterator[dict[str, int]]:
    """The caching allocator's driver calls inside the block (`ALLOCATOR_COUNTERS`), filled in
    when it ends; empty off CUDA."""
    calls: dict[str, int] = {}
    before = allocator_counts(device)
    try:
        yield calls
    finally:
        after = allocator_counts(device)
        calls.update({k: after[k] - before[k] for k in after})


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def print_json_line(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, sort_keys=True))


def engine_benchmark_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of `python -m pagedkv.bench.X` for an engine benchmark: `--log-level` as the
    `pagedkv` command has it; the caller adds the benchmark's and the engine's options."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    return parser


def run_engine_benchmark(
    args: argparse.Namespace, run: Callable[[argparse.Namespace], int], name: str
) -> int:
    """Run an engine benchmark from `python -m pagedkv.bench.X` as `pagedkv` runs its commands:
    logging set up, a torchrun rank > 0 serving as a tensor-parallel worker, a ValueError (a bad
    option) printed as one line with exit code 2."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "tensor_parallel_size", 1) > 1 and int(os.environ.get("RANK", "0") or 0) > 0:
        from pagedkv.engine.distributed.worker import run_torchrun_worker_cli

        return run_torchrun_worker_cli(args)
    try:
        return int(run(args) or 0)
    except ValueError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
