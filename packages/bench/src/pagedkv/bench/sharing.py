"""`pagedkv bench sharing` (or `python -m pagedkv.bench.sharing`): how many KV blocks sharing
saves, measured on a real engine.

For parallel sampling (n in {2, 4, 6}) and beam search (width in {2, 4, 6}) the engine runs a
set of requests; after every step the blocks actually in use are compared with the blocks the
same live sequences would hold if none were shared (the sum of their block-table lengths) —
the PagedAttention paper's memory-saving measurement (its Fig. 15), here on our engine. The
saving depends on how long prompts are against outputs, so the requests come from a workload:

* ``--dataset sharegpt``: real ShareGPT V3 prompts and reply lengths (needs
  `pagedkv-bench[sharegpt]`; :mod:`pagedkv.bench.sharegpt`);
* ``--dataset alpaca``: Alpaca-like lengths (synthetic, :mod:`pagedkv.bench.workloads`), prompts
  of random token ids;
* ``--dataset builtin`` (default): four built-in prompts of 17-32 tokens and ``--max-tokens``
  each, a quick smoke run whose saving is *not* any dataset's.

Every request runs to its own output length (``ignore_eos``; ``--max-tokens`` caps it, 0 = no
cap). ``--prefix-shots 1,5`` adds the paper's shared-prefix experiment (its Fig. 16-17): a
translation prompt with a 1-shot or 5-shot example prefix shared by every request, run with
the prefix cache on and off: blocks in use and throughput.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
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

# Few-shot translation examples (English -> German), written for this benchmark in the style
# of the paper's WMT16 prompts (its Fig. 16). Shots 1 and 5 give the paper's two prefixes.
TRANSLATION_EXAMPLES = [
    ("The committee will publish its final report on the new railway line next spring, after "
     "consulting the residents of every town along the planned route.",
     "Der Ausschuss wird seinen Abschlussbericht über die neue Bahnstrecke im nächsten Frühjahr "
     "veröffentlichen, nachdem er die Einwohner aller Orte entlang der geplanten Strecke "
     "befragt hat."),
    ("Despite the heavy rain, thousands of people gathered in the old market square to "
     "celebrate the reopening of the restored cathedral.",
     "Trotz des starken Regens versammelten sich Tausende von Menschen auf dem alten Marktplatz, "
     "um die Wiedereröffnung der restaurierten Kathedrale zu feiern."),
    ("The company announced that it would invest two billion euros in renewable energy over "
     "the next five years and create several thousand new jobs.",
     "Das Unternehmen kündigte an, in den nächsten fünf Jahren zwei Milliarden Euro in "
     "erneuerbare Energien zu investieren und mehrere tausend neue Arbeitsplätze zu schaffen."),
    ("Scientists at the university have developed a new method for detecting small amounts of "
     "pollution in drinking water within a few minutes.",
     "Wissenschaftler der Universität haben eine neue Methode entwickelt, mit der sich geringe "
     "Mengen an Verschmutzung im Trinkwasser innerhalb weniger Minuten nachweisen lassen."),
    ("The minister said that the government would not raise taxes this year, but warned that "
     "difficult decisions about public spending lay ahead.",
     "Der Minister sagte, die Regierung werde in diesem Jahr die Steuern nicht erhöhen, warnte "
     "jedoch, dass schwierige Entscheidungen über die öffentlichen Ausgaben bevorstünden."),
]

#: Token counts of the 1- and 5-shot prefixes with the embedded model's tokenizer (a test
#: checks them), and a typical query's: models without a tokenizer (bundled shapes with random
#: weights, the GPU runs) get random token ids of these lengths.
PREFIX_TOKENS = {1: 111, 2: 196, 3: 293, 4: 381, 5: 479}
QUERY_TOKENS = 19

TRANSLATION_QUERIES = [
    "The museum will remain closed for renovation until the end of the summer.",
    "Our train was delayed by almost two hours because of a signal failure near the border.",
    "The new library offers free language courses for adults every Tuesday evening.",
    "Farmers in the region are worried about the long period of dry weather.",
    "The orchestra played a programme of works by young composers from across Europe.",
    "Several streets in the city centre will be closed to cars during the festival.",
    "The hospital has hired forty additional nurses to reduce waiting times.",
    "The football club confirmed that its coach will stay for another two seasons.",
    "Researchers found that regular walks improve both sleep and concentration.",
    "The airport plans to build a third runway despite protests from local residents.",
    "A small bakery in the village has won a national prize for its bread.",
    "The bridge across the river will be repaired over the next six months.",
    "Students can now borrow laptops from the school for their homework.",
    "The exhibition shows photographs of the city taken over the last hundred years.",
    "Prices for fruit and vegetables rose sharply after the late frost in April.",
    "The mayor opened a new playground in the park on Saturday morning.",
]


def translation_prefix(shots: int) -> str:
    """The shared prefix of a ``shots``-shot English-to-German translation prompt."""
    if not 1 <= shots <= len(TRANSLATION_EXAMPLES):
        raise ValueError(f"--prefix-shots: 1 to {len(TRANSLATION_EXAMPLES)} shots, got {shots}")
    lines = ["Translate English to German.", ""]
    for en, de in TRANSLATION_EXAMPLES[:shots]:
        lines += [f"English: {en}", f"German: {de}", ""]
    return "\n".join(lines)


def add_sharing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharing report")
    g.add_argument("--widths", default="2,4,6", help="n / beam widths to measure")
    g.add_argument("--dataset", default="builtin",
                   help="builtin (default: 4 short prompts, --max-tokens each), sharegpt (real "
                        "ShareGPT V3), sharegpt-synthetic or alpaca (synthetic lengths, random "
                        "ids), or a JSON file of {prompt_token_ids, output_len} (as "
                        "`python -m pagedkv.bench.paper_gpu prepare` writes)")
    g.add_argument("--num-prompts", type=int, default=8,
                   help="requests per measurement for sharegpt/alpaca (default 8)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="cap on each request's output tokens (default: 48 for builtin, none "
                        "for the datasets)")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the sampled requests")
    g.add_argument("--prompts-file", default=None, help="prompts, one per line (builtin only)")
    g.add_argument("--skip-beam", action="store_true", help="only parallel sampling")
    g.add_argument("--skip-parallel", action="store_true", help="only beam search")
    g.add_argument("--prefix-shots", default="",
                   help="comma-separated shot counts (e.g. 1,5) for the shared-prefix "
                        "experiment: translation prompts, prefix cache on vs off")
    g.add_argument("--prefix-requests", type=int, default=16,
                   help="requests per shared-prefix run (default 16)")
    g.add_argument("--prefix-output-len", type=int, default=32,
                   help="output tokens per shared-prefix request (default 32)")


def _requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) of each request, from `--dataset`."""
    cap = args.max_tokens
    if args.dataset == "builtin":
        prompts = DEFAULT_PROMPTS
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts = [line.strip() for line in f if line.strip()]
        return [(p, cap if cap is not None else 48) for p in prompts]
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset == "sharegpt":
        from pagedkv.bench.sharegpt import sample_requests

        reqs = sample_requests(args.num_prompts, seed=args.dataset_seed)
        if any(max(r.prompt_token_ids) >= vocab_size for r in reqs):
            raise ValueError("--dataset sharegpt: the embedded tokenizer's ids go past this "
                             f"model's vocabulary of {vocab_size}")
        pairs = [(list(r.prompt_token_ids), r.output_len) for r in reqs]
    elif args.dataset in ("alpaca", "sharegpt-synthetic"):
        from pagedkv.bench.workloads import sample_lengths

        rng = random.Random(f"{args.dataset}-ids-{args.dataset_seed}")
        low = min(1000, vocab_size // 4)
        pairs = [([rng.randrange(low, vocab_size) for _ in range(p)], o)
                 for p, o in sample_lengths(args.dataset, args.num_prompts,
                                            seed=args.dataset_seed)]
    else:
        pairs = _file_requests(args.dataset, args.num_prompts, vocab_size)
    return [(p, min(o, cap) if cap else o) for p, o in pairs]


def _file_requests(path: str, num: int, vocab_size: int) -> list[tuple[list[int], int]]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset: not builtin/sharegpt/sharegpt-synthetic/alpaca and not a "
                         f"readable JSON file ({e})") from None
    if isinstance(rows, dict):
        rows = rows.get("requests", [])
    out = []
    for r in rows[:num]:
        ids = [int(t) for t in r["prompt_token_ids"]]
        if not ids or max(ids) >= vocab_size:
            raise ValueError(f"{path}: a prompt is empty or has ids past the vocabulary "
                             f"({vocab_size})")
        out.append((ids, int(r["output_len"])))
    if len(out) < num:
        raise ValueError(f"{path} holds {len(out)} requests; asked for {num}")
    return out


def measure(engine, requests: list[tuple[str | list[int], Any]]) -> dict[str, float]:
    """Run `requests` (prompt, SamplingParams) together; the KV blocks in use after every step
    with sharing against the blocks the live sequences' block tables add up to, and the time."""
    bm = engine.scheduler.block_manager
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"share-{i}", prompt, params)
    shared_sum = unshared_sum = 0
    peak_shared = peak_unshared = 0
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens += sum(len(c.token_ids) for c in o.outputs)
        live = [s.seq_id for g in engine.scheduler.running for s in g.seqs]
        used = bm.stats().gpu_used
        alone = sum(len(bm.block_table_ref(sid)) for sid in live if bm.has_seq(sid))
        shared_sum += used
        unshared_sum += alone
        peak_shared = max(peak_shared, used)
        peak_unshared = max(peak_unshared, alone)
    secs = time.perf_counter() - start
    saving = 1.0 - shared_sum / unshared_sum if unshared_sum else 0.0
    return {"blocks_with_sharing": shared_sum, "blocks_without_sharing": unshared_sum,
            "peak_with_sharing": peak_shared, "peak_without_sharing": peak_unshared,
            "saving_pct": 100.0 * saving, "seconds": secs, "output_tokens": tokens}


def _prefix_runs(args: argparse.Namespace, engine_args, shots_list: list[int]) -> list[dict]:
    """The shared-prefix experiment: the same translation requests with the prefix cache off
    and on (a fresh engine each), blocks in use and output throughput."""
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams

    rows = []
    sp = SamplingParams(max_tokens=args.prefix_output_len, temperature=0.0, ignore_eos=True)
    for cached in (False, True):  # one engine each, for every shot count
        engine = LLMEngine.from_engine_args(replace(engine_args, enable_prefix_caching=cached))
        for shots in shots_list:
            prefix = translation_prefix(shots)
            if engine.model_config.is_bundled_shape:  # random weights, no tokenizer: token ids
                n_prefix = PREFIX_TOKENS[shots]
                rng = random.Random(shots)
                ids = [rng.randrange(1000, 32000) for _ in range(n_prefix)]
                prompts: list[str | list[int]] = [
                    ids + [rng.randrange(1000, 32000) for _ in range(QUERY_TOKENS)]
                    for _ in range(args.prefix_requests)
                ]
            else:
                n_prefix = len(engine.get_tokenizer()(prefix).input_ids)
                prompts = [
                    f"{prefix}English: {TRANSLATION_QUERIES[i % len(TRANSLATION_QUERIES)]}\nGerman:"
                    for i in range(args.prefix_requests)
                ]
            # warm-up (kernels, graphs); with the cache on it also primes the prefix, as a
            # server that has seen the prompt before would be
            measure(engine, [(prompts[0], sp)])
            m = measure(engine, [(p, sp) for p in prompts])
            rows.append({"mode": f"{shots}-shot prefix, cache {'on' if cached else 'off'}",
                         "shots": shots, "prefix_cache": cached, "prefix_tokens": n_prefix,
                         **m, "output_tok_s": m["output_tokens"] / m["seconds"]})
        del engine
    return rows


def run_sharing_cli(args: argparse.Namespace) -> int:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    widths = [int(w) for w in args.widths.split(",") if w]
    shots_list = [int(s) for s in args.prefix_shots.split(",") if s.strip()]
    for s in shots_list:
        translation_prefix(s)  # a clear error before any run
    rows = []
    if args.skip_parallel and args.skip_beam:
        if not shots_list:
            raise ValueError("nothing to measure: --skip-parallel, --skip-beam and no "
                             "--prefix-shots")
        widths = []
    engine = LLMEngine.from_engine_args(engine_args) if widths else None
    vocab = engine.model_config.hf_config.vocab_size if engine else 0
    reqs = _requests(args, vocab) if engine else []
    if engine is not None:
        n_in = sum(len(p) if isinstance(p, list) else 0 for p, _ in reqs)
        print(f"model {engine.model_config.name} on {engine.device}, dataset {args.dataset}: "
              f"{len(reqs)} requests"
              + (f", mean prompt {n_in / len(reqs):.0f} tokens" if n_in else "")
              + f", mean output {sum(o for _, o in reqs) / len(reqs):.0f} tokens; block size "
              f"{args.block_size}; env {environment()}")
    if not args.skip_parallel and engine is not None:
        for w in widths:
            rs = [(p, SamplingParams(n=w, temperature=0.8, seed=0, max_tokens=o, ignore_eos=True))
                  for p, o in reqs]
            rows.append({"mode": "parallel sampling", "width": w, **measure(engine, rs)})
    if not args.skip_beam and engine is not None:
        for w in widths:
            rs = [(p, SamplingParams(use_beam_search=True, best_of=w, n=1, temperature=0.0,
                                     max_tokens=o, ignore_eos=True)) for p, o in reqs]
            rows.append({"mode": "beam search", "width": w, **measure(engine, rs)})
    del engine
    cols = ["mode", "width", "blocks_with_sharing", "blocks_without_sharing",
            "peak_with_sharing", "peak_without_sharing", "saving_pct"]
    if rows:
        print_table(rows, cols)
    result: dict[str, Any] = {
        f"{'parallel' if r['mode'].startswith('parallel') else 'beam'}_{r['width']}_saving_pct":
        round(r["saving_pct"], 2) for r in rows
    }
    if args.dataset != "builtin" and rows:
        result["dataset"] = args.dataset
        result["num_prompts"] = len(reqs)
    if shots_list:
        prows = _prefix_runs(args, engine_args, shots_list)
        print_table(prows, ["mode", "prefix_tokens", "blocks_with_sharing",
                            "blocks_without_sharing", "peak_with_sharing", "saving_pct",
                            "seconds", "output_tok_s"])
        for shots in shots_list:
            off, on = (r for r in prows if r["shots"] == shots)
            result[f"prefix_{shots}shot_tokens"] = on["prefix_tokens"]
            # with the cache off nothing is shared: blocks in use are the tables' sum
            result[f"prefix_{shots}shot_block_saving_pct"] = round(
                100.0 * (1 - on["blocks_with_sharing"] / off["blocks_with_sharing"]), 2)
            result[f"prefix_{shots}shot_throughput_ratio"] = round(
                on["output_tok_s"] / off["output_tok_s"], 3)
    print_json_line(result)
    return 0


def _add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs

    add_sharing_args(p)
    EngineArgs.add_cli_args(p)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `sharing` under `pagedkv bench` (entry point group `pagedkv.bench_subcommands`)."""
    p = subparsers.add_parser(
        "sharing", help="KV blocks used with sharing vs without (parallel sampling, beam search, "
        "shared prefix)"
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
