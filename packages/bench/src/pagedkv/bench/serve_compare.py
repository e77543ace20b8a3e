"""`pagedkv bench serve --compare-offline --engine-args "..."`: the server against the engine
itself, same requests, same options.

Both run in one call, on the same requests and engine options: each repeat runs the offline
engine (`python -m pagedkv.bench.throughput --dataset` on these requests), then starts the
server (`python -m pagedkv.server`) with the same options, sends every request at once streaming
and then non-streaming, and stops it (the order alternates between repeats). It reports the
median output tok/s of each and their ratio, the spread over repeats, TPOT and ITL percentiles,
where the time to first token went (the server's queue and prefill histograms), and the CPU
share the API process and the engine core used (whether more API processes could help).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pagedkv.bench.env import environment, hardware
from pagedkv.bench.serve_client import http_client, model_name, run_benchmark, warm_up
from pagedkv.bench.serve_requests import RequestSpec, check_vocab, make_requests

#: Server-side histograms read from /metrics around each run (sum and count of each).
_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def split_engine_args(text: str) -> tuple[str | None, list[str]]:
    """`--engine-args`: (the model, the other engine options), checked with the engine's own
    parser; a clear `ValueError` for anything it does not take."""
    from pagedkv.engine.arg_utils import EngineArgs

    tokens = shlex.split(text)
    parser = argparse.ArgumentParser(prog="--engine-args", add_help=False, exit_on_error=False)
    EngineArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(tokens)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"--engine-args {text!r}: {exc}") from None
    if unknown:
        raise ValueError(
            f"--engine-args: {' '.join(unknown)} is not an engine option "
            "(see pagedkv serve --help, 'engine options')"
        )
    EngineArgs.from_cli_args(ns)  # every value checked here, before anything starts
    rest: list[str] = []
    skip = False
    for i, tok in enumerate(tokens):
        if skip:
            skip = False
            continue
        if tok == "--model":
            skip = i + 1 < len(tokens)
            continue
        if tok.startswith("--model="):
            continue
        rest.append(tok)
    return ns.model, rest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _scrape(url: str) -> dict[str, float]:
    """The _sum and _count of each of `_HISTOGRAMS` on the server's /metrics."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{")[0]
        for key, metric in _HISTOGRAMS.items():
            for part in ("sum", "count"):
                if name == f"{metric}_{part}":
                    out[f"{key}_{part}"] = out.get(f"{key}_{part}", 0.0) + float(value)
    return out


class _Server:
    """`python -m pagedkv.server` with the engine options, on a free port, logging to a file."""

    def __init__(self, model: str | None, rest: list[str], log_path: Path,
                 start_timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "pagedkv.server", *([model] if model else []), *rest,
            "--host", "127.0.0.1", "--port", str(self.port), "--uvicorn-log-level", "warning",
        ]
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes it for its life
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} while starting:\n"
                    + self.log()[-3000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy after {start_timeout:g} s:\n"
                                   + self.log()[-3000:])
            time.sleep(0.5)
        m = re.search(r"engine core process started \(pid (\d+)\)", self.log())
        self.core_pid = int(m.group(1)) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _run_offline(model: str | None, rest: list[str], dataset: Path, num_prompts: int,
                 folder: Path, k: int, timeout: float) -> dict[str, Any]:
    """The offline engine on the same requests (`pagedkv bench throughput --dataset`), in a
    process of its own, so that only one engine holds the device at a time."""
    out = folder / f"offline_{k}.json"
    log = folder / f"offline_{k}.log"
    cmd = [
        sys.executable, "-m", "pagedkv.bench.throughput", *(["--model", model] if model else []),
        *rest, "--dataset", str(dataset), "--num-prompts", str(num_prompts),
        "--output-json", str(out), "--log-level", "WARNING",
    ]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the offline run failed (exit {done.returncode}):\n"
                           + log.read_text(errors="replace")[-3000:])
    return json.loads(out.read_text())


def _serve_run(server: _Server, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    """Every request at once against `server`; the summary plus CPU shares and the server's
    TTFT split (means over this run, from its histograms)."""
    ns = argparse.Namespace(**{**vars(args), "base_url": server.url, "request_rate": None,
                               "stream": stream})
    cpu0 = (_cpu_seconds(server.proc.pid), _cpu_seconds(server.core_pid))
    before = _scrape(server.url)
    summary = asyncio.run(run_benchmark(ns))
    after = _scrape(server.url)
    cpu1 = (_cpu_seconds(server.proc.pid), _cpu_seconds(server.core_pid))
    wall = summary["duration_s"]
    for name, a, b in (("frontend", cpu0[0], cpu1[0]), ("core", cpu0[1], cpu1[1])):
        if a is not None and b is not None and wall > 0:
            summary[f"{name}_cpu_fraction"] = (b - a) / wall
    for key in _HISTOGRAMS:
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if n > 0:
            total = after.get(f"{key}_sum", 0.0) - before.get(f"{key}_sum", 0.0)
            summary[f"server_mean_{key}_ms"] = total / n * 1000
    return summary


def _warm_server(server: _Server, args: argparse.Namespace) -> None:
    async def go() -> None:
        async with http_client(args) as client:
            model = await model_name(client, server.url, args)
            await warm_up(client, server.url + args.endpoint, args, model, make_requests(args))

    asyncio.run(go())


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_compare_offline(
    args: argparse.Namespace, on_repeat: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """See the module docstring; returns the result. `on_repeat(result so far)` after each
    repeat."""
    model, rest = split_engine_args(args.engine_args)
    if args.vocab_size is None:  # no server yet: the model's own config says it
        from pagedkv.engine.config import ModelConfig

        args.vocab_size = ModelConfig.from_model(model, device="cpu").vocab_size
        check_vocab(args)
    specs = make_requests(args)
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-compare-"))
    dataset = folder / "requests.json"
    dataset.write_text(json.dumps(
        [{"prompt_token_ids": s.prompt, "output_len": s.output_len} for s in specs]
    ))
    offline: list[dict[str, Any]] = []
    streamed: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []

    def serve(k: int) -> None:
        server = _Server(model, rest, folder / f"server_{k}.log", args.server_start_timeout)
        try:
            if args.warmup_requests:
                _warm_server(server, args)
            for stream in ((True, False) if k % 2 == 0 else (False, True)):
                summary = _serve_run(server, args, stream)
                (streamed if stream else plain).append(summary)
                print(f"  repeat {k + 1}: server, {'streaming' if stream else 'non-streaming'}: "
                      f"{summary['output_throughput']:.1f} output tok/s "
                      f"({summary['completed']} ok, {summary['failed']} failed)", flush=True)
        finally:
            server.stop()

    result: dict[str, Any] = {}
    for k in range(args.repeats):
        steps = ("offline", "serve") if k % 2 == 0 else ("serve", "offline")
        for step in steps:
            if step == "serve":
                serve(k)
            else:
                run = _run_offline(model, rest, dataset, len(specs), folder, k,
                                   args.offline_timeout)
                offline.append(run)
                print(f"  repeat {k + 1}: offline engine: {run['output_tok_s']:.1f} output "
                      "tok/s", flush=True)
        result = _compare_result(args, specs, offline, streamed, plain)
        result["partial"] = k + 1 < args.repeats
        if on_repeat is not None:
            on_repeat(result)  # a run cut short keeps the repeats it finished
    return result


def _compare_result(args: argparse.Namespace, specs: list[RequestSpec],
                    offline: list[dict[str, Any]], streamed: list[dict[str, Any]],
                    plain: list[dict[str, Any]]) -> dict[str, Any]:
    off = [r["output_tok_s"] for r in offline]
    st = [r["output_throughput"] for r in streamed]
    ns_ = [r["output_throughput"] for r in plain]
    # The streaming run of median throughput gives the latency figures.
    mid = sorted(streamed, key=lambda r: r["output_throughput"])[len(streamed) // 2]
    result: dict[str, Any] = {
        "benchmark": "pagedkv bench serve --compare-offline",
        "model": mid["model"],
        "workload": args.workload,
        "num_prompts": len(specs),
        "total_input_tokens": sum(len(s.prompt) for s in specs),
        "total_output_tokens": sum(s.output_len for s in specs),
        "engine_args": args.engine_args,
        "repeats": len(off),
        "offline_output_tok_s": statistics.median(off),
        "serve_output_tok_s": statistics.median(st),
        "serve_over_offline": statistics.median(st) / statistics.median(off),
        "serve_nonstream_output_tok_s": statistics.median(ns_),
        "serve_nonstream_over_offline": statistics.median(ns_) / statistics.median(off),
        "spread": {
            "offline_output_tok_s": _spread(off),
            "serve_output_tok_s": _spread(st),
            "serve_nonstream_output_tok_s": _spread(ns_),
            "serve_over_offline_per_repeat": [s / o for s, o in zip(st, off)],
            "serve_nonstream_over_offline_per_repeat": [s / o for s, o in zip(ns_, off)],
        },
        "runs": {"offline": off, "serve": st, "serve_nonstream": ns_},
    }
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            result[f"{stat}_{key}_ms"] = mid[f"{stat}_{key}_ms"]
    result["failed"] = sum(r["failed"] for r in streamed + plain)
    split = {k: mid[f"server_mean_{k}_ms"] for k in _HISTOGRAMS if f"server_mean_{k}_ms" in mid}
    if {"ttft", "queue", "prefill"} <= split.keys():
        split["other_ms"] = split["ttft"] - split["queue"] - split["prefill"]
    result["ttft_split_ms"] = split
    for name in ("frontend", "core"):
        values = [r[f"{name}_cpu_fraction"] for r in streamed if f"{name}_cpu_fraction" in r]
        if values:
            result[f"{name}_cpu_fraction"] = statistics.median(values)
    for key in ("decode_step_ms", "decode_step_bound_ms", "num_gpu_blocks", "max_num_seqs"):
        if key in offline[0]:
            result[f"offline_{key}"] = statistics.median(r[key] for r in offline)
    env = environment()
    offline_env = offline[0].get("env") or {}
    result.update({"hardware": offline_env.get("gpu") or hardware(), "commit": env["commit"],
                   "command": env["command"], "env": env, "offline_env": offline_env})
    return result


def format_compare(r: dict[str, Any]) -> str:
    sp = r["spread"]
    lines = [
        "{s:{c}^72}".format(s=" Server vs offline engine (same requests, same options) ", c="="),
        f"{'':<28}{'median':>12}{'min':>12}{'max':>12}",
    ]
    for label, key in (("offline engine tok/s", "offline_output_tok_s"),
                       ("server, streaming tok/s", "serve_output_tok_s"),
                       ("server, non-streaming tok/s", "serve_nonstream_output_tok_s")):
        d = sp[key]
        lines.append(f"{label:<28}{d['median']:>12.1f}{d['min']:>12.1f}{d['max']:>12.1f}")
    lines.append(f"server / offline: streaming {r['serve_over_offline']:.3f}, non-streaming "
                 f"{r['serve_nonstream_over_offline']:.3f} (ratio of medians over "
                 f"{r['repeats']} interleaved repeats)")
    lines.append(f"streaming run of median throughput: TTFT mean {r['mean_ttft_ms']:.0f} ms, "
                 f"TPOT median {r['median_tpot_ms']:.1f} / P99 {r['p99_tpot_ms']:.1f} ms, "
                 f"ITL median {r['median_itl_ms']:.1f} / P99 {r['p99_itl_ms']:.1f} ms")
    split = r.get("ttft_split_ms") or {}
    if "other_ms" in split:
        lines.append(f"server TTFT {split['ttft']:.0f} ms = queued in the core "
                     f"{split['queue']:.0f} + prefill {split['prefill']:.0f} + intake and hops "
                     f"{split['other_ms']:.0f} (means)")
    if "frontend_cpu_fraction" in r:
        lines.append(f"CPU used while streaming: API process {r['frontend_cpu_fraction']:.2f} "
                     f"core(s), engine core {r.get('core_cpu_fraction', float('nan')):.2f}")
    lines.append("=" * 72)
    return "\n".join(lines)
