"""How much a large decode pass gains when two half batches run at once, on two streams.

Why: a decode pass of hundreds of sequences does two kinds of work that a roofline bound
counts as overlapping: matmuls that are compute-bound at these row counts, and attention that
is bound by reading the KV cache. Run one after the other, the pass costs their sum; the
bfloat16 run's passes of 257-1,024 sequences reach about half their bound. Splitting the batch
into two micro-batches and running them on two streams (NanoFlow's idea, much simplified) lets
the GPU run one half's attention next to the other half's matmuls, as far as its block
scheduler fills the SMs one kernel leaves free with the other's programs.

This probe measures that before any engine change: the engine's own decode graph of ``N``
sequences, against two graphs of ``N / 2`` (each with its own static inputs and memory pool)
replayed one after the other and then on two streams at once, over the same sequences.

    python scripts/overlap_probe.py --model meta-llama/Meta-Llama-3-8B --load-format dummy \\
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 1024 --gpu-memory-utilization 0.85 \\
        --batches 256,512,1024 --context 600 [--quantization fp8 --kv-cache-dtype fp8]

Prints, per batch, the device ms of a forward pass (the logits are left out) each way, and
the ratio of the two-stream pass to the whole batch's; ``--output-json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys

import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.worker.cuda_graphs import DecodeGraphs


def _batch(n: int, context: int, spread: float, block_size: int, seed: int):
    """Token ids, positions and disjoint block tables of `n` sequences of about `context`
    tokens (uniform within +-spread of it)."""
    rng = random.Random(seed)
    lens = [max(1, round(context * (1 + spread * (2 * rng.random() - 1)))) for _ in range(n)]
    tables, next_block = [], 0
    for length in lens:
        blocks = -(-(length + 1) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return [rng.randrange(1000) for _ in range(n)], lens, tables, next_block


def _graphs_of(runner, size: int) -> DecodeGraphs:
    """A DecodeGraphs of its own static inputs and pool, with one graph: `size` rows."""
    g = DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                     max_model_len=runner.max_model_len,
                     max_blocks_per_seq=runner.max_blocks_per_seq, max_num_seqs=size,
                     device=runner.device, planner=runner.planner)  # fmt: skip
    g.sizes = [size]
    g.capture()
    return g


def _time(fn, iters: int) -> float:
    """Mean device ms of `fn` over `iters` runs (after three untimed), on the current stream."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()
def _probe(runner, n: int, args, streams) -> dict | None:
    """One batch of `n` sequences timed three ways, interleaved, twice."""
    ids, lens, tables, blocks = _batch(n, args.context, args.spread, runner.block_size, n)
    if blocks > runner.num_gpu_blocks:
        print(f"batch {n}: needs {blocks} blocks, more than the cache's {runner.num_gpu_blocks}")
        return None
    pos = [length - 1 for length in lens]  # the token at the last position is the new one
    h = n // 2
    parts = ((_graphs_of(runner, h), slice(0, h), h), (_graphs_of(runner, n - h), slice(h, n), n - h))
    full_size = runner.graphs.size_for(n)
    main_stream = torch.cuda.current_stream()

    def whole():
        runner.graphs.replay(ids, pos, tables, full_size)

    def halves_in_turn():
        for g, s, b in parts:
            g.replay(ids[s], pos[s], tables[s], b)

    def halves_two_streams():
        ready = torch.cuda.Event()
        ready.record(main_stream)
        for (g, s, b), stream in zip(parts, streams):
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                g.replay(ids[s], pos[s], tables[s], b)
        for stream in streams:
            main_stream.wait_stream(stream)

    times = {f.__name__: [] for f in (whole, halves_in_turn, halves_two_streams)}
    for _ in range(2):  # interleaved: the machine's drift shows as a spread
        for f in (whole, halves_in_turn, halves_two_streams):
            times[f.__name__].append(_time(f, args.iters))
    row = {"batch": n, "graph_size": full_size, "context_mean": sum(lens) / n,
           **{k: min(v) for k, v in times.items()}, "runs": times}
    row["two_streams_vs_whole"] = row["whole"] / row["halves_two_streams"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(ap)
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--spread", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to overlap")
        return 1
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    runner = engine.runner
    if runner.graphs is None:
        print("the engine captured no decode graphs (--enforce-eager?)")
        return 1
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        row = _probe(runner, n, args, streams)
        torch.cuda.empty_cache()
        if row is None:
            continue
        rows.append(row)
        print(f"batch {n:5d} (graph {row['graph_size']}, context {row['context_mean']:.0f}): whole "
              f"{row['whole']:.2f} ms, halves in turn {row['halves_in_turn']:.2f}, on two "
              f"streams {row['halves_two_streams']:.2f} ({row['two_streams_vs_whole']:.3f}x)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
