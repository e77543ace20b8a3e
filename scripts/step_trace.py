"""Which host call keeps the device waiting between passes: a profiler trace of chosen steps of
a throughput run, the CUDA runtime calls that took longest, and the Python stack of each.

Why: the fp8 real-ShareGPT run on the H200 leaves the device idle 5-68 ms before most of its
16 prompt passes (0.22 s a run; bf16 0.38 s) and 0.1 s over its decode passes
(``*_device_wait_seconds``), although no torch call synchronizes (``scripts/sync_audit.py``)
and the scheduler runs ahead (``scripts/prompt_phase_host.py``). In those steps the host
spends the whole pass before in its launch phase: something there waits for the device. A
call that waits shows here as a long CUDA runtime call on the host (``cudaStreamSynchronize``,
``cudaEventSynchronize``, a ``cudaMemcpyAsync`` from pageable memory, ``cudaHostAlloc``,
``cudaMalloc``, or a launch blocked on a full queue).

What it found there (``gpu_runs/2026-12-03e/``): no runtime call took over 3.2 ms, but the
``aten::mm`` of the logits blocked the host 15-245 ms whenever cuBLAS chose a kernel it had not
used before, until the GPU had run everything queued: CUDA's lazy loading of that kernel. The
runner now runs the logits for every row count at start-up (``_load_logits_kernels``). To see
such a wait, look for an op that is long on the host with no long runtime call inside.

    python scripts/step_trace.py --model meta-llama/Meta-Llama-3-8B --load-format dummy \\
        --dtype bfloat16 --dataset .gpu_data/sharegpt_1000.json --num-prompts 1000 \\
        --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 16384 \\
        [--quantization fp8 --kv-cache-dtype fp8] --steps 3-6,17-24 --trace-dir OUT

Runs the benchmark's warm-up (8 requests), adds the requests, then steps to the end of the
last window (the run is not finished). Prints per window: the runtime calls by total host
time, the ``--top`` longest single calls with the step they fell in and their stacks;
``--trace-dir`` also writes each window's Chrome trace.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedkv.bench.throughput import _add_args, add_requests, make_requests, run_pagedkv
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine

logger = logging.getLogger("step_trace")
OURS = ("/pagedkv/", "/pagedattn_kernels/")


def parse_windows(text: str) -> list[tuple[int, int]]:
    """"3-6,17-24" -> [(3, 6), (17, 24)]: inclusive step numbers, counted from 1."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if not 1 <= first <= last:
            raise ValueError(f"--steps: {part!r} is not FIRST-LAST with 1 <= FIRST <= LAST")
        out.append((first, last))
    return sorted(out)


def _our_stack(event, depth: int = 6) -> list[str]:
    """The innermost frames in our packages of the stack of `event`, or of its nearest
    parent op with one (runtime calls carry none; the op that made them does)."""
    while event is not None and not event.stack:
        event = event.cpu_parent
    stack = list(event.stack) if event is not None else []
    return [f for f in stack if any(p in f for p in OURS)][:depth]


def summarize(prof, step_starts: list[tuple[int, float]], top: int) -> dict:
    """Runtime calls by name (count, total and longest ms) and the `top` longest calls, each
    with its step (by host start time), the op that made it and our frames of its stack."""
    runtime = [e for e in prof.events() if e.name.startswith(("cuda", "cu")) and e.device_type
               == torch.autograd.DeviceType.CPU]  # fmt: skip
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in runtime:
        by_name[e.name].append(e.cpu_time_total / 1e3)
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    origin = min((e.time_range.start for e in prof.events()), default=0)

    def step_of(e) -> int:
        at = (e.time_range.start - origin) / 1e6  # profiler microseconds -> seconds
        return max((s for s, t in step_starts if t <= at), default=0)

    longest = sorted(runtime, key=lambda e: -e.cpu_time_total)[:top]
    return {
        "by_name": {n: {"count": len(v), "total_ms": round(sum(v), 3), "max_ms": round(max(v), 3)}
                    for n, v in names},
        "longest": [{"name": e.name, "ms": round(e.cpu_time_total / 1e3, 3), "step": step_of(e),
                     "parent": e.cpu_parent.name if e.cpu_parent is not None else None,
                     "stack": _our_stack(e)} for e in longest],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_args(ap)
    ap.set_defaults(num_prompts=1000)
    ap.add_argument("--steps", default="2-5,16-24", help="windows of steps to trace, FIRST-LAST,...")
    ap.add_argument("--top", type=int, default=15, help="longest single calls to print per window")
    ap.add_argument("--trace-dir", default=None, help="write each window's Chrome trace here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    windows = parse_windows(args.steps)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    cuda = engine.device.type == "cuda"
    reqs = make_requests(args, engine.model_config.vocab_size)
    run_pagedkv(engine, reqs[: min(8, len(reqs))])  # the benchmark's warm-up
    add_requests(engine, reqs, "trace")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    results = []
    step = 0
    for first, last in windows:
        while step < first - 1 and engine.has_unfinished_requests():
            engine.step()
            step += 1
        if not engine.has_unfinished_requests():
            break
        starts: list[tuple[int, float]] = []
        with profile(activities=activities, with_stack=True) as prof:
            t0 = time.perf_counter()
            while step < last and engine.has_unfinished_requests():
                step += 1
                starts.append((step, time.perf_counter() - t0))
                engine.step()
        summary = summarize(prof, starts, args.top)
        summary["steps"] = [first, step]
        results.append(summary)
        print(f"\n=== steps {first}-{step}: runtime calls by total host ms")
        for name, row in list(summary["by_name"].items())[:12]:
            print(f"  {row['total_ms']:9.2f} ms  x{row['count']:<6d} max {row['max_ms']:8.2f}  {name}")
        print(f"--- the {len(summary['longest'])} longest single calls")
        for row in summary["longest"]:
            print(f"  {row['ms']:8.2f} ms  step {row['step']}  {row['name']} (in {row['parent']})")
            for frame in row["stack"]:
                print(f"        {frame}")
        if args.trace_dir:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"steps_{first}_{step}.json"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"windows": results, "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
