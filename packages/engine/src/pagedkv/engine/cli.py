"""The `pagedkv` command line: one command with subcommands.

`generate` and `chat` live here. Other distributions add subcommands through entry points, so
the engine never imports them: the group `pagedkv.subcommands` adds top-level commands (the
server's `serve`, pagedkv-bench's `simulate`), the group `pagedkv.bench_subcommands` adds
`pagedkv bench X` (pagedkv-bench's `throughput`, `sharing` and `serve`). Without pagedkv-bench,
`pagedkv bench` and `pagedkv simulate` say how to install it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

logger = logging.getLogger("pagedkv")

ENTRY_POINT_GROUP = "pagedkv.subcommands"  # register(subparsers): adds a top-level subcommand
BENCH_ENTRY_POINT_GROUP = "pagedkv.bench_subcommands"  # register(subparsers): adds `pagedkv bench X`
BENCH_INSTALL_HINT = (
    "needs the pagedkv-bench package, which is not installed: pip install pagedkv-bench "
    "(from a checkout: pip install packages/bench)"
)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from pagedkv.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm import LLM

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedkv generate: give prompts as arguments or with --prompts-file", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    outs = llm.generate(prompts, _sampling_params(args), use_tqdm=not args.quiet)
    for out in outs:
        for comp in out.outputs:
            print(f"--- prompt: {out.prompt!r}" + (f" [{comp.index}]" if len(out.outputs) > 1 else ""))
            print(comp.text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pagedkv chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _cmd_needs_bench(args: argparse.Namespace) -> int:
    print(f"pagedkv {args.command}: {BENCH_INSTALL_HINT}", file=sys.stderr)
    return 1


def _add_needs_bench(sub, name: str, help_text: str) -> None:
    """A stand-in for a subcommand of pagedkv-bench when that is not installed: whatever the
    arguments, it says what to install (see `main`, which lets it take any arguments)."""
    p = sub.add_parser(name, help=f"{help_text} (needs pagedkv-bench)", add_help=False)
    p.set_defaults(func=_cmd_needs_bench, needs_bench=True)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, with the subcommands other distributions contribute."""
    from pagedkv.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(
        prog="pagedkv", description="pagedkv: LLM serving with PagedAttention"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="*", help="prompts")
    gen.add_argument("--prompts-file", help="a text file with one prompt per line")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=_cmd_chat, max_tokens=256)

    bench_plugins = _entry_points(BENCH_ENTRY_POINT_GROUP)
    if bench_plugins:
        bench = sub.add_parser("bench", help="benchmarks (pagedkv-bench)")
        bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
        _load_plugins(bench_plugins, BENCH_ENTRY_POINT_GROUP, bench_sub)
    else:
        _add_needs_bench(sub, "bench", "benchmarks")

    _load_plugins(_entry_points(ENTRY_POINT_GROUP), ENTRY_POINT_GROUP, sub)
    if "simulate" not in sub.choices:
        _add_needs_bench(sub, "simulate", "scheduler simulation")
    return parser


def _entry_points(group: str) -> list:
    """The installed entry points of `group`, by name."""
    return sorted(entry_points(group=group), key=lambda e: e.name)


def _load_plugins(eps: list, group: str, subparsers) -> None:
    for ep in eps:
        try:
            ep.load()(subparsers)
        except Exception as exc:  # a broken plugin must not take the whole CLI down
            logger.warning("could not load pagedkv subcommand %r from %s: %s", ep.name, group, exc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "needs_bench", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "tensor_parallel_size", 1) > 1 and int(os.environ.get("RANK", "0") or 0) > 0:
        # torchrun rank > 0: serve rank 0's engine instead of running the command
        from pagedkv.engine.distributed.worker import run_torchrun_worker_cli

        return run_torchrun_worker_cli(args)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        from pagedkv.engine.distributed.executor import TensorParallelError

        if not isinstance(exc, TensorParallelError):
            raise
        # a tensor-parallel rank died: say which, and exit non-zero (the workers are stopped)
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
