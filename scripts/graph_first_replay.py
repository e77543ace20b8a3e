"""What the first replay of each captured CUDA graph costs, against its second.

Why: a graph instantiated but not yet launched may have to be uploaded to the device on its
first launch. The throughput benchmark's warm-up replays only the decode graphs of up to 8
sequences, so a run meets every larger graph for the first time inside the timed window (the
first decode pass after the prompt passes of an fp8 run waited 57 ms on the H200). If first
replays cost more, the engine should replay each graph once after capturing it.

(It does since 2026-12-03: on the H200 the first replay cost 0.5-0.9 ms more host time and
0.1-0.6 ms more device time, ``gpu_runs/2026-12-03e/``. What this script now calls the first
replay of a decode graph is its second; the piecewise graphs are not replayed at capture.)

    python scripts/graph_first_replay.py --model meta-llama/Meta-Llama-3-8B --load-format dummy \\
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 1024 \\
        --max-num-batched-tokens 16384 [--quantization fp8 --kv-cache-dtype fp8]

Runs nothing but the replays, right after the engine is built: the decode graphs' inputs are
then all padding (length 0: no cache slot is written), and the piecewise graphs of prompt
passes write only their static buffers (their attention runs between them, eagerly, and is
left out here). Prints, per graph, the host time of ``replay()`` and the device time between
events around it, first and second; ``--output-json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from pagedkv.bench.throughput import _add_args
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine


def _timed(replay) -> tuple[float, float]:
    """Host ms of `replay()` and device ms between events around it (synchronized after)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    replay()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_args(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing is captured")
        return 1
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    runner = engine.runner
    rows = []
    graphs = runner.graphs.graphs if runner.graphs is not None else {}
    for b, (graph, _) in sorted(graphs.items()):
        first, second = _timed(graph.replay), _timed(graph.replay)
        rows.append({"kind": "decode", "size": b, "first": first, "second": second})
    chains = runner.piecewise.chains if runner.piecewise is not None else {}
    for t, (pieces, _, _) in sorted(chains.items()):

        def chain(pieces=pieces):
            for piece in pieces:
                piece.replay()

        first, second = _timed(chain), _timed(chain)
        rows.append({"kind": "piecewise", "size": t, "first": first, "second": second})
    print("graph       size   host ms first / second   device ms first / second")
    for r in rows:
        print(f"{r['kind']:10s} {r['size']:5d}   {r['first'][0]:8.2f} / {r['second'][0]:6.2f}"
              f"        {r['first'][1]:8.2f} / {r['second'][1]:6.2f}")
    for kind in ("decode", "piecewise"):
        mine = [r for r in rows if r["kind"] == kind]
        extra = sum(r["first"][1] - r["second"][1] for r in mine)
        host = sum(r["first"][0] - r["second"][0] for r in mine)
        print(f"{kind}: {len(mine)} graphs, first replays cost {extra:.1f} ms more device time"
              f" and {host:.1f} ms more host time than second ones in all")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
