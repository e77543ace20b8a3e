"""Where an engine step makes the host wait for the GPU: torch's CUDA sync debug mode over the
steps of a throughput workload, each synchronizing call counted by the place in our code that
made it.

Why: under asynchronous scheduling the host prepares pass N+1 while the GPU runs pass N. A
call in that preparation that synchronizes (``.item()``, ``.tolist()`` of a device tensor, a
copy from pageable memory, ``nonzero``...) makes the host wait for pass N, and the GPU then
waits for the rest of the preparation: the fp8 real-ShareGPT runs on the H200 show 0.02-0.36 s
of such host time in their 16 prompt passes (``mixed_host_gap_seconds``), run to run. The
engine's own wait for the pass in flight (an event) is not a torch sync and is not counted.

    python scripts/sync_audit.py --model meta-llama/Meta-Llama-3-8B --load-format dummy \\
        --dtype bfloat16 --dataset .gpu_data/sharegpt_1000.json --num-prompts 256 \\
        --max-num-batched-tokens 16384 [--quantization fp8 --kv-cache-dtype fp8]

Prints, per place (file:line of the innermost frame under ``pagedkv``/``pagedattn_kernels``),
how many synchronizing calls it made in decode-only steps and in steps with prompt tokens,
and the stack of its first one; the first ``--trace-steps`` steps' phases (schedule, launch,
wait, update, output: the engine's step observer); and the CUDA caching allocator's
``cudaMalloc``/``cudaFree``/retries by step kind, which the debug mode does not see though a
``cudaFree`` synchronizes the device. ``--output-json`` writes the same.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import traceback
import warnings

import torch

from pagedkv.bench.common import ALLOCATOR_COUNTERS, allocator_calls
from pagedkv.bench.throughput import _add_args, add_requests, make_requests
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine

logger = logging.getLogger("sync_audit")
OURS = ("/pagedkv/", "/pagedattn_kernels/")


def _our_frame(stack: list[traceback.FrameSummary]) -> str:
    """file:line of the innermost frame in our packages (the call that synchronized)."""
    for frame in reversed(stack):
        if any(p in frame.filename for p in OURS):
            return f"{frame.filename.split('/src/')[-1]}:{frame.lineno} ({frame.name})"
    return "outside pagedkv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_args(ap)
    ap.set_defaults(num_prompts=256)
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="steps before the audit starts (first launches, allocator)")
    ap.add_argument("--trace-steps", type=int, default=24,
                    help="print the phases of this many first steps")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    cuda = engine.device.type == "cuda"
    if not cuda:  # a smoke run of the script itself: nothing here can synchronize
        logger.warning("no CUDA device: the steps run, but no call can synchronize")
    engine.emit_partial_outputs = False
    reqs = make_requests(args, engine.model_config.vocab_size)
    add_requests(engine, reqs, "audit")
    runner = engine.runner
    runner.step_log = []  # (tokens, seqs, kv_tokens, pairs) of each pass, as the benchmark's
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    steps_by_kind: collections.Counter = collections.Counter()
    first: dict[str, str] = {}
    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # torch's notice on turning the mode on
            return
        stack = traceback.extract_stack()[:-1]
        place = _our_frame(stack)
        found.append(place)
        first.setdefault(place, f"{message}\n" + "".join(traceback.format_list(stack[-12:])))

    # The caching allocator's calls to the driver, which torch's sync debug mode does not see
    # (a cudaFree synchronizes the device).
    allocator: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    # The first steps' phases (asynchronous scheduling: the pass it schedules and launches is
    # the one after the pass it waits for and applies): a launch that waits shows here.
    phases: list[dict[str, float]] = []

    def observe(rec) -> None:
        if len(phases) < args.trace_steps:
            phases.append({"prompt_tokens": rec.num_prefill_tokens, "seqs": len(rec.scheduled),
                           **{k: round(v * 1e3, 2) for k, v in rec.timings.items()}})

    engine.add_step_observer(observe)
    steps = 0
    warnings.showwarning = record
    warnings.simplefilter("always")
    while engine.has_unfinished_requests():
        if steps == args.warmup_steps and cuda:
            torch.cuda.set_sync_debug_mode("warn")
        found.clear()
        with allocator_calls(engine.device) as calls:
            engine.step()
        steps += 1
        passes, runner.step_log = runner.step_log, []
        if steps <= args.warmup_steps:
            continue
        kind = "prompt" if any(p[0] != p[1] for p in passes) else "decode"
        for place in found:
            counts[place][kind] += 1
        steps_by_kind[kind] += 1
        for key, n in calls.items():
            allocator[key][kind] += n
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    print(f"{steps} steps ({dict(steps_by_kind)} audited); synchronizing calls by place:")
    for place, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {dict(c)}  {place}")
    for place, stack in first.items():
        print(f"\n--- first at {place}:\n{stack}")
    if not counts:
        print("  none")
    print(f"the first {len(phases)} steps' phases in ms (applied pass: prompt tokens, seqs):")
    for row in phases:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    print("caching allocator calls during the audited steps, by step kind:")
    for key in ALLOCATOR_COUNTERS:
        print(f"  {key}: {dict(allocator[key])}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"steps": steps, "audited": dict(steps_by_kind),
                       "places": {p: dict(c) for p, c in counts.items()}, "first": first,
                       "allocator": {k: dict(c) for k, c in allocator.items()},
                       "phases": phases,
                       "argv": sys.argv[1:]}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
