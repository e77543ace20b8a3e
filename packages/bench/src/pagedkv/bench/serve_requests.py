"""What `pagedkv bench serve` sends: the seeded request list (random token ids, a named workload's
lengths, or the real ShareGPT V3 prompts of `--dataset sharegpt`), and the two records every part
of the benchmark passes around, `RequestSpec` (a request to send) and `RequestResult` (what came
back, and when).

The records live here, below the client, the reports and the comparison with the offline
engine, so that each of those imports them without importing the others.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    streamed: bool = True  # False: a non-streaming request (no TPOT, no ITL)


def make_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The request list; the same `--seed` gives the same prompts and lengths.
    `args.vocab_size` must be known (given, or read from the server by
    `serve_client.model_name`)."""
    if args.vocab_size is None:
        raise ValueError("the vocabulary size is not known yet: give --vocab-size")
    if getattr(args, "dataset", None) == "sharegpt":  # the real ShareGPT V3 prompts
        return _sharegpt_requests(args)
    rng = random.Random(args.seed)
    if args.workload == "random":
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    else:
        # The named workloads (the simulator and the offline bench use the same).
        from pagedkv.bench.workloads import sample_lengths

        lengths = sample_lengths(
            args.workload, args.num_prompts, seed=args.seed, max_total=args.max_total_len
        )
    specs = []
    for in_len, out_len in lengths:
        prompt = [rng.randrange(args.min_token_id, args.vocab_size) for _ in range(in_len)]
        specs.append(RequestSpec(prompt, out_len))
    return specs


def check_vocab(args: argparse.Namespace) -> None:
    if not 0 <= args.min_token_id < args.vocab_size:
        raise ValueError(
            f"need 0 <= --min-token-id < the vocabulary size ({args.vocab_size})"
        )


def add_dataset_arg(parser: argparse.ArgumentParser) -> None:
    """`--dataset sharegpt`: the real ShareGPT V3 prompts (`pagedkv.bench.sharegpt`)."""
    parser.add_argument(
        "--dataset",
        default=None,
        choices=("sharegpt",),
        help="sharegpt: real ShareGPT V3 prompts (token ids of the embedded model's tokenizer) "
        "and reply lengths, sampled by vLLM's rules with --seed; replaces --workload (needs "
        "pagedkv-bench[sharegpt])",
    )


def check_dataset(args: argparse.Namespace) -> None:
    if getattr(args, "dataset", None) == "sharegpt":
        from pagedkv.bench.sharegpt import dataset_available, missing_dataset_message

        if not dataset_available():
            raise ValueError(f"--dataset sharegpt: {missing_dataset_message()}")


def _sharegpt_requests(args: argparse.Namespace) -> list[RequestSpec]:
    from pagedkv.bench.sharegpt import sample_requests

    specs = []
    for r in sample_requests(args.num_prompts, seed=args.seed):
        if max(r.prompt_token_ids) >= args.vocab_size:
            raise ValueError(
                f"--dataset sharegpt: token ids go past --vocab-size {args.vocab_size} (the "
                "embedded tokenizer has 49152)"
            )
        specs.append(RequestSpec(list(r.prompt_token_ids), r.output_len))
    return specs
