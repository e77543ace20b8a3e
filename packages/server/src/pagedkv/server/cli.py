"""`pagedkv serve [MODEL]`: start the engine core and serve it over HTTP with uvicorn.

The engine's CLI finds this through the entry point group `pagedkv.subcommands`
(`serve = "pagedkv.server.cli:register"`); `python -m pagedkv.server` runs the same parser.

Two processes: this one (HTTP, tokenization, detokenization, SSE) and the engine core
(`python -m pagedkv.engine.core`: scheduler, model runner and step loop), which this one starts
and which never outlives it.

Shutdown: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and let the requests in
flight finish (the engine core keeps running them) for up to `--graceful-shutdown-timeout`
seconds; then the engine core is stopped and the process exits with status 0. uvicorn's own
signal handling re-raises the signal after its shutdown (exit status 143 for SIGTERM); we keep
the graceful part and drop the re-raise. If the engine core dies, /health answers 503, every
request in flight ends with an error at once, and the server stops with exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from pagedkv.server.app import DEFAULT_MAX_BODY_BYTES, build_app
from pagedkv.server.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("pagedkv.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pagedkv.engine import EngineArgs

    g = parser.add_argument_group("server options")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)",
    )
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the tokenizer endpoints "
        "(default: no key)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use in requests (default: the model's name)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest accepted request body; larger gets 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds to let in-flight requests finish on SIGTERM / Ctrl-C (default 5)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) replacing the model's",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (a Jinja template is code; default: 400)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="how tool calls are found in replies under tool_choice 'auto' (default: picked "
        "from the chat template: hermes, llama3_json, or smollm2 for templates without tools)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (access log at info)",
    )
    EngineArgs.add_cli_args(parser, model_positional=True)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to the `pagedkv` command (entry point group `pagedkv.subcommands`)."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /metrics, ...). "
        "No MODEL serves the embedded SmolLM2-135M-Instruct.",
    )
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


class _Server(uvicorn.Server):
    """uvicorn's server with signal handling that ends in a normal return (exit status 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for requests
            self.should_exit = True
            logger.info("received %s: shutting down", signal.Signals(sig).name)

        sigs = [signal.SIGINT, signal.SIGTERM]
        previous = {s: signal.signal(s, handle) for s in sigs}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if any(c in value for c in "{}\n") and not path.is_file():
        return value
    if not path.is_file():
        raise ValueError(
            f"--chat-template {value!r} is neither a file nor a Jinja template ({{...}})"
        )
    return path.read_text(encoding="utf-8")


def _model_name(engine: Any, args: argparse.Namespace) -> str:
    name = getattr(engine.model_config, "name", None)
    if name:
        return str(name)
    if args.model:
        return str(args.model)
    return DEFAULT_MODEL_NAME


async def _serve(args: argparse.Namespace) -> int:
    from pagedkv.engine import AsyncLLMEngine, EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    chat_template = load_chat_template(args.chat_template)  # a bad path fails before loading
    logger.info("loading the engine (model: %s)", engine_args.model or "embedded default")
    # Starts the engine core process and waits until it has loaded the model.
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    died: list[BaseException] = []
    try:
        names = args.served_model_name or [_model_name(engine, args)]
        app = build_app(
            engine,
            served_model_names=names,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            model_root=engine_args.model or _model_name(engine, args),
            chat_template=chat_template,
            tool_call_parser=args.tool_call_parser,
            trust_request_chat_template=args.trust_request_chat_template,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
            lifespan="off",
        )
        server = _Server(config)
        # What is alive now (the app, the tokenizer, imported modules) lives as long as the
        # server: frozen out of the cyclic GC, whose full passes would otherwise walk it while
        # hundreds of streams wait (the engine core does the same with its own objects).
        gc.collect()
        gc.freeze()

        def on_dead(exc: BaseException) -> None:
            died.append(exc)
            logger.error("stopping the server: %s", exc)
            server.should_exit = True

        engine.on_dead = on_dead
        shown = f"[{args.host}]" if ":" in args.host else args.host
        logger.info(
            "pagedkv server for %s on http://%s:%d (OpenAI API at http://%s:%d/v1%s)",
            ", ".join(names),
            shown,
            args.port,
            shown,
            args.port,
            "; API key required" if args.api_key else "",
        )
        await server.serve()
        if not server.started:
            logger.error("the server did not start (is port %d free?)", args.port)
            return 1
        return 1 if died else 0
    finally:
        logger.info("shutting the engine down")
        engine.shutdown()


def run_serve(args: argparse.Namespace) -> int:
    """The `serve` subcommand: blocks until SIGTERM / Ctrl-C, then returns 0."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedkv.server`: the same options as `pagedkv serve`."""
    parser = argparse.ArgumentParser(prog="python -m pagedkv.server", description="pagedkv serve")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_serve(args)
    except ValueError as exc:
        print(f"pagedkv serve: error: {exc}", file=sys.stderr)
        return 2
