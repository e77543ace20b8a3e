"""Where a served decode step's time goes, without the server: the offline engine fed requests
on a Poisson arrival clock, as the engine core is by the API process.

Issue 21's step trace (`PAGEDKV_STEP_TRACE`) showed, on an H200 at 40 req/s, decode steps of
~9 ms while the batch stays the same and ~16 ms when it changed (a request finished or
joined), and steps that carry a prefill at ~40 ms. This script reproduces that load on one
`LLMEngine` (asynchronous scheduling, CUDA graphs, the server's defaults), times the phases of
every step on the host (schedule ahead, launch: build the batch / replay the graph / logits
and argmax / copy, then wait, update, outputs), and profiles a window of steps with
torch.profiler to name the host calls that block (`cudaStreamSynchronize`, `cudaMalloc`,
`cudaHostAlloc`, a pageable `cudaMemcpyAsync`...). Prints tables and one JSON line.

    python scripts/step_profile.py --model meta-llama/Meta-Llama-3-8B --load-format dummy \\
        --dtype bfloat16 --skip-tokenizer-init --rate 40 --duration 20

CPU smoke run (the embedded model):  python scripts/step_profile.py --rate 4 --duration 2 \\
    --kv-cache-gb 0.25 --workload random
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import statistics
import time

import torch
from phase_clock import PhaseClock

from pagedkv.bench.workloads import make_requests
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.core.step_trace import profile_report
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.worker import model_runner as mr

logger = logging.getLogger("step_profile")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--vocab-size", type=int, default=128000)
    p.add_argument("--profile-at", type=float, default=0.5,
                   help="start the profiler window at this fraction of the arrivals")
    p.add_argument("--profile-steps", type=int, default=120)
    p.add_argument("--trace-out", default=None, help="write the profiler's chrome trace here")
    EngineArgs.add_cli_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    runner, sched = engine.runner, engine.scheduler
    clock = PhaseClock()
    for obj, name, phase in (
        (sched, "schedule_ahead", "schedule_ahead"), (sched, "schedule", "schedule"),
        (runner, "execute_async", "launch"), (runner, "execute", "execute_plain"),
        (runner.graphs, "replay", "launch.replay"), (mr, "build_inputs", "launch.build_inputs"),
        (runner, "greedy_tokens", "launch.logits_argmax"),
        (runner, "in_flight", "launch.in_flight"), (mr.InFlightStep, "result", "wait"),
        (sched, "update", "update"), (engine.outputs, "process", "outputs"),
    ):
        clock.wrap(obj, name, phase)

    specs = make_requests(args.workload, args.rate, duration=args.duration, seed=0,
                          max_total=int(engine.model_config.max_model_len))
    rng = random.Random(1)
    vocab = min(args.vocab_size, int(engine.model_config.vocab_size))
    # warm-up: every graph size and a prefill, outside the timed run
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    for i in range(min(256, int(engine.args.max_num_seqs))):
        engine.add_request(f"warm{i}", [rng.randrange(3, vocab) for _ in range(64)], warm)
    while engine.has_unfinished_requests():
        engine.step()
    clock.take()

    steps: list[dict] = []
    profile_from = args.profile_at * args.duration
    prof = None
    prof_steps = 0
    start = time.perf_counter()
    nxt = 0
    while nxt < len(specs) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        added = 0
        while nxt < len(specs) and specs[nxt].arrival_time <= now:
            s = specs[nxt]
            params = SamplingParams(max_tokens=max(s.output_len, 1), temperature=0.0, ignore_eos=True,
                                    detokenize=False)
            engine.add_request(f"r{nxt}", [rng.randrange(3, vocab) for _ in range(s.prompt_len)],
                               params)
            nxt += 1
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(0.0005)
            continue
        if prof is None and prof_steps == 0 and now >= profile_from and torch.cuda.is_available():
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        with torch.profiler.record_function("engine_step"):
            engine.step()
        t1 = time.perf_counter()
        row = {k: round(v * 1e3, 4) for k, v in clock.take().items()}
        row.update(t=t1 - start, step_ms=(t1 - t0) * 1e3, added=added,
                   running=sched.num_running, waiting=sched.num_waiting)
        steps.append(row)
        if prof is not None:
            prof_steps += 1
            if prof_steps >= args.profile_steps:
                prof.__exit__(None, None, None)
                report_profile(prof, args.trace_out)
                prof = None
    if prof is not None:
        prof.__exit__(None, None, None)
        report_profile(prof, args.trace_out)
    summarize(steps)


def report_profile(prof, trace_out: str | None) -> None:
    """The host calls that took longest, one by one, and the usual table."""
    print("\n== profiled window ==")
    print(profile_report(prof))
    if trace_out:
        prof.export_chrome_trace(trace_out)


def summarize(steps: list[dict]) -> None:
    steps = steps[2:]
    print("\n== host phases per step, median ms (decode-only steps by whether the batch changed) ==")
    keys = sorted({k for s in steps for k in s} - {"t", "running", "waiting", "added"})
    groups = collections.defaultdict(list)
    for i in range(1, len(steps)):
        s, prev = steps[i], steps[i - 1]
        kind = "prefill/plain" if s.get("launch.build_inputs") or s.get("execute_plain") else (
            "decode, batch changed" if s["running"] != prev["running"] or s["added"] else
            "decode, same batch")
        groups[kind].append(s)
    out = {}
    for kind, rows in groups.items():
        med = {k: round(statistics.median([r.get(k, 0.0) for r in rows]), 3) for k in keys}
        out[kind] = {"n": len(rows), **med}
        print(f"{kind:24s} n={len(rows):5d} " + "  ".join(f"{k}={v}" for k, v in med.items()))
    slow = sorted(steps, key=lambda s: s["step_ms"], reverse=True)[:15]
    print("\n== slowest steps ==")
    for s in slow:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items()})
    print(json.dumps({"step_profile": out}))


if __name__ == "__main__":
    main()
