"""The `pagedkv` command line: one command with subcommands."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="pagedkv LLM serving system")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        print("pagedkv serve: the HTTP server is not built yet (see issue 6).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
