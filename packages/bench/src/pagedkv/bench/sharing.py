"""`pagedkv bench sharing` (or `python -m pagedkv.bench.sharing`): how many KV blocks sharing
saves, measured on a real model.

For parallel sampling (n in {2, 4, 6}) and beam search (width in {2, 4, 6}) the engine runs a
set of prompts; after every step the blocks actually in use are compared with the blocks the
same live sequences would hold if none were shared (the sum of their block-table lengths) —
the PagedAttention paper's memory-saving measurement (its Fig. 15), here on our engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pagedkv.bench.common import (
    engine_benchmark_parser,
    print_json_line,
    print_table,
    run_engine_benchmark,
)
from pagedkv.bench.env import environment

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and the keeper's daily routine before the discovery.",
    "Explain, step by step, how a hash table handles collisions, and compare open addressing "
    "with separate chaining in terms of memory use and speed.",
    "List ten ideas for a weekend trip in the mountains, with one sentence about each.",
    "Summarize the main causes of the industrial revolution in Britain and its effects on "
    "cities, work and family life during the nineteenth century.",
]


def add_sharing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharing report")
    g.add_argument("--widths", default="2,4,6", help="n / beam widths to measure")
    g.add_argument("--max-tokens", type=int, default=48, help="tokens generated per sequence")
    g.add_argument("--prompts-file", default=None, help="prompts, one per line (default: built in)")
    g.add_argument("--skip-beam", action="store_true", help="only parallel sampling")


def measure(engine, prompts: list[str], params) -> dict[str, float]:
    """Run `prompts` with `params`; return mean and peak blocks used with and without sharing."""
    bm = engine.scheduler.block_manager
    for i, p in enumerate(prompts):
        engine.add_request(f"share-{i}", p, params)
    shared_sum = unshared_sum = 0
    peak_shared = peak_unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [s.seq_id for g in engine.scheduler.running for s in g.seqs]
        used = bm.stats().gpu_used
        alone = sum(len(bm.block_table_ref(sid)) for sid in live if bm.has_seq(sid))
        shared_sum += used
        unshared_sum += alone
        peak_shared = max(peak_shared, used)
        peak_unshared = max(peak_unshared, alone)
    saving = 1.0 - shared_sum / unshared_sum if unshared_sum else 0.0
    return {"blocks_with_sharing": shared_sum, "blocks_without_sharing": unshared_sum,
            "peak_with_sharing": peak_shared, "peak_without_sharing": peak_unshared,
            "saving_pct": 100.0 * saving}


def run_sharing_cli(args: argparse.Namespace) -> int:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams

    prompts = DEFAULT_PROMPTS
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    widths = [int(w) for w in args.widths.split(",") if w]
    print(f"model {engine.model_config.name} on {engine.device}, {len(prompts)} prompts, "
          f"{args.max_tokens} tokens per sequence, block size {args.block_size}; env {environment()}")
    rows = []
    for w in widths:
        sp = SamplingParams(n=w, temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
        rows.append({"mode": "parallel sampling", "width": w, **measure(engine, prompts, sp)})
    if not args.skip_beam:
        for w in widths:
            sp = SamplingParams(use_beam_search=True, best_of=w, n=1, temperature=0.0,
                                max_tokens=args.max_tokens, ignore_eos=True)
            rows.append({"mode": "beam search", "width": w, **measure(engine, prompts, sp)})
    print_table(rows, ["mode", "width", "blocks_with_sharing", "blocks_without_sharing",
                       "peak_with_sharing", "peak_without_sharing", "saving_pct"])
    print_json_line({f"{'parallel' if r['mode'].startswith('parallel') else 'beam'}_{r['width']}_saving_pct":
                     round(r["saving_pct"], 2) for r in rows})
    return 0


def _add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs

    add_sharing_args(p)
    EngineArgs.add_cli_args(p)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `sharing` under `pagedkv bench` (entry point group `pagedkv.bench_subcommands`)."""
    p = subparsers.add_parser(
        "sharing", help="KV blocks used with sharing vs without (parallel sampling, beam search)"
    )
    _add_args(p)
    p.set_defaults(func=run_sharing_cli)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedkv.bench.sharing`: the same options as `pagedkv bench sharing`."""
    p = engine_benchmark_parser("python -m pagedkv.bench.sharing", __doc__.split("\n\n")[0])
    _add_args(p)
    return run_engine_benchmark(p.parse_args(argv), run_sharing_cli, "pagedkv bench sharing")


if __name__ == "__main__":
    sys.exit(main())
