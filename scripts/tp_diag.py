"""Does a tensor-parallel rank lag? Per-rank step timings of a throughput run (issue 17).

    PAGEDKV_TP_DIAG=1 python scripts/tp_diag.py --model meta-llama/Meta-Llama-3-8B \\
        --tensor-parallel-size 2 --load-format dummy --dtype bfloat16 --workload sharegpt \\
        --num-prompts 1000 --max-model-len 2048 --max-num-batched-tokens 16384 \\
        --max-num-seqs 1024 --output-json "$OUT/tp_diag.json"

Runs the same requests as `pagedkv bench throughput` (a warm-up of 8 first), then prints, per
rank and per kind of pass (decode replaying a CUDA graph, decode run eagerly, prefill/mixed) and
batch-size band, the medians (90th percentiles) in ms of:

* ``wait``: a worker's time blocked waiting for the driver's message;
* ``host``: the host time of the step up to its launch (driver: encode, send, launch; worker:
  decode, launch);
* ``sync``: the time this rank's device waited at the start of the step for the other rank
  (a one-element all-reduce before the pass, CUDA events);
* ``gpu``: the pass's device time once both ranks are in it.

Reading it: rank 0's ``sync`` large and rank 1's near 0 means rank 1 arrives late (its ``host``
and ``wait`` say whether it was busy or waiting for the driver); ``gpu`` close on both ranks and
close to the isolated step (``scripts/tp_allreduce_share.py``) means the pass itself is fine.
Also prints each rank's CUDA-graph replays and eager passes (`rank_stats`) and the output
tokens per second (lower than the bench's: the extra all-reduce and events cost a little).
Works on the CPU too (gloo, eager passes: no ``gpu`` column), as the tests run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PAGEDKV_TP_DIAG", "1")  # before the workers start: they inherit it
    from pagedkv.bench.throughput import add_throughput_args, make_requests, run_pagedkv
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.distributed.step_timing import format_rank_timings
    from pagedkv.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    EngineArgs.add_cli_args(parser)
    add_throughput_args(parser)
    args = parser.parse_args(argv)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        runner = engine.runner
        if not hasattr(runner, "rank_timings"):
            print("tp_diag: --tensor-parallel-size must be at least 2", file=sys.stderr)
            return 2
        engine.emit_partial_outputs = False
        reqs = make_requests(args, engine.model_config.vocab_size)
        run_pagedkv(engine, reqs[: min(8, len(reqs))])  # warm-up
        warmup_steps = runner.rank_stats()[0]["steps"]
        runner.rank_timings()  # forget the warm-up's steps
        start = time.perf_counter()
        run = run_pagedkv(engine, reqs)
        secs = time.perf_counter() - start
        timings = runner.rank_timings()
        stats = runner.rank_stats()
    finally:
        engine.shutdown()
    print(f"{len(reqs)} requests, {run.output_tokens} output tokens in {secs:.2f} s: "
          f"{run.output_tokens / secs:,.0f} output tok/s (with the diagnostic all-reduce)")
    print("per rank, medians (p90) in ms; wait: worker blocked for the message; host: up to "
          "the launch; sync: device waiting for the other rank at the step's start; gpu: the "
          "pass's device time after that")
    print(format_rank_timings(timings))
    for s in stats:
        print(f"rank {s['rank']}: {s['steps']} steps, {s['graph_replays']} CUDA-graph replays, "
              f"{s['eager_passes']} eager passes, {s['steps_with_pending']} with device tokens, "
              f"{s['num_graphs']} graphs")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"output_tok_s": run.output_tokens / secs, "seconds": secs,
                       "warmup_steps": warmup_steps, "rank_timings": timings,
                       "rank_stats": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
