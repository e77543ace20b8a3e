"""How many streams the API process keeps up with, measured without a model.

The real API process (`AsyncLLMEngine` over `MPClient`, the FastAPI app, uvicorn) serves a
stand-in engine core that speaks the real wire messages: it takes requests, and every
`--step-ms` milliseconds sends one step message with one new token for each running request
(at most `--max-num-seqs`), as a GPU decode step of that batch would. `pagedkv bench serve`,
in a process of its own, sends the requests. The stand-in never waits for the API process, as
the real core does not, so its own time (steps x step time) is what the engine would need, and

    served / engine = (tokens / the client's duration) / (tokens / the stand-in's busy time)

says how close the serving path comes to engine speed at that step rate: 1.0 means the API
process kept up with every step. It also prints the CPU time the API process used.

    python scripts/serve_frontend_load.py --num-prompts 1000 --step-ms 7.4 --workload sharegpt

(7.4 ms: the median decode step of Llama-3-8B at ~1,000 sequences on an H200.) The client,
the API process and the stand-in share this machine's cores: on a small machine the figure is
a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE_FLAG = "--fake-core"


# ---- the stand-in engine core (a process of its own) --------------------------------------------
def fake_core(argv: list[str]) -> int:
    import zmq

    from pagedkv.engine.core.messages import (
        KIND_ABORT,
        KIND_ADD,
        KIND_OUTPUTS,
        KIND_READY,
        KIND_SHUTDOWN,
        CoreStats,
        Encoder,
        EngineCoreOutputs,
        EngineCoreReady,
        EngineCoreRequest,
        FinishedRequest,
        SeqFinish,
        decoder,
    )  # fmt: skip

    p = argparse.ArgumentParser()
    for name in ("--engine-args", "--input", "--output", "--log-level"):
        p.add_argument(name)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--pdeathsig", action="store_true")
    ns = p.parse_args(argv)
    from pagedkv.engine.core.process import die_with_parent

    die_with_parent(ns.parent_pid, ns.pdeathsig)
    opts = json.loads(ns.engine_args)
    step_s = float(os.environ["FAKE_STEP_MS"]) / 1000
    gate = int(os.environ.get("FAKE_GATE", "0"))  # wait for this many requests, then step
    max_seqs = int(opts["max_num_seqs"])
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(ns.output)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(ns.input)
    enc = Encoder()
    out.send_multipart((KIND_READY, enc.encode(EngineCoreReady(
        "stand-in", 4096, 128000, [0], 10**9, max_seqs, 16, 10**6, 0, "none", os.getpid()))))
    dec_req, dec_ids = decoder(EngineCoreRequest), decoder(list[str])
    waiting: collections.deque = collections.deque()
    running: dict[str, list] = {}
    rng = random.Random(0)
    tokens = steps = max_batch = 0
    first = last = None
    first_wall = 0.0
    next_t = time.perf_counter()
    while True:
        if not running and not waiting:
            if first is not None:  # idle again: report the busy period
                Path(os.environ["FAKE_REPORT"]).write_text(json.dumps({
                    "stand_in_tokens": tokens, "stand_in_steps": steps,
                    "stand_in_busy_s": last - first, "stand_in_first_step_wall": first_wall,
                    "stand_in_max_batch": max_batch}))
                tokens = steps = max_batch = 0
                first = last = None
            inp.poll(1000)
        while inp.poll(0):
            kind, payload = inp.recv_multipart()
            if kind == KIND_ADD:
                req = dec_req.decode(payload)
                waiting.append([req.request_id, req.sampling_params().max_tokens, time.time()])
            elif kind == KIND_ABORT:
                gone = set(dec_ids.decode(payload))
                for rid in gone & running.keys():
                    del running[rid]
                waiting = collections.deque(w for w in waiting if w[0] not in gone)
            elif kind == KIND_SHUTDOWN:
                return 0
        if gate and first is None and len(waiting) < gate:
            inp.poll(10)
            continue
        while waiting and len(running) < max_seqs:
            w = waiting.popleft()
            running[w[0]] = w
        if not running:
            continue
        now = time.perf_counter()
        if now < next_t:
            time.sleep(next_t - now)
        next_t = max(next_t + step_s, time.perf_counter())
        if first is None:
            first = time.perf_counter()
            first_wall = time.time()
        max_batch = max(max_batch, len(running))
        rids = list(running)
        msg = EngineCoreOutputs(request_ids=rids, seq_indices=[0] * len(rids),
                                token_ids=[rng.randrange(1000, 128000) for _ in rids])
        finished = []
        for rid in rids:
            w = running[rid]
            w[1] -= 1
            if w[1] <= 0:
                del running[rid]
                finished.append(FinishedRequest(rid, False, [(0, "length", None)], w[2], w[2],
                                                w[2]))
        if finished:
            msg.finished = finished
            index = {rid: i for i, rid in enumerate(rids)}
            msg.seq_finishes = [SeqFinish(index[f.request_id], "length") for f in finished]
        msg.stats = CoreStats(num_running=len(running), num_waiting=len(waiting))
        msg.timestamp = time.time()
        out.send_multipart((KIND_OUTPUTS, enc.encode(msg)), copy=False)
        tokens += len(rids)
        steps += 1
        last = time.perf_counter()


# ---- the API process and the client ---------------------------------------------------------
def _hist_mean(hist) -> float:
    """Mean of a prometheus_client histogram child (sum / count)."""
    total = count = 0.0
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return total / count if count else float("nan")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == FAKE_FLAG:
        return fake_core(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--step-ms", type=float, default=7.4)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8019)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--gate", action="store_true",
                    help="the stand-in starts stepping once every request has arrived (as the "
                    "offline engine starts with all of them): every stream runs at once")
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--bench-args", default="", help="more `bench serve` options")
    ap.add_argument("--result-json", default=None, help="also write the result to this file")
    ns = ap.parse_args()

    import uvicorn

    from pagedkv.engine import AsyncLLMEngine, EngineArgs
    from pagedkv.engine.core.client import MPClient
    from pagedkv.server.app import build_app

    os.environ["FAKE_STEP_MS"] = str(ns.step_ms)
    os.environ["FAKE_GATE"] = str(ns.num_prompts if ns.gate else 0)
    report = Path(tempfile.mkdtemp(prefix="pagedkv-load-")) / "stand_in.json"
    os.environ["FAKE_REPORT"] = str(report)
    client = MPClient(EngineArgs(max_num_seqs=ns.max_num_seqs),
                      core_command=[sys.executable, str(Path(__file__).resolve()), FAKE_FLAG])
    client.wait_ready(timeout=60)
    result: dict = {}

    async def serve() -> None:
        engine = AsyncLLMEngine(client=client, tokenizer=None)
        app = build_app(engine, served_model_names=["stand-in"])
        config = uvicorn.Config(app, host="127.0.0.1", port=ns.port, log_level="warning",
                                lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        cpu0 = time.process_time()
        cmd = [sys.executable, "-m", "pagedkv.bench.serve", "--base-url",
               f"http://127.0.0.1:{ns.port}", "--workload", ns.workload, "--num-prompts",
               str(ns.num_prompts), "--request-rate", ns.request_rate, "--vocab-size", "128000"]
        if ns.no_stream:
            cmd.append("--no-stream")
        cmd += shlex.split(ns.bench_args)
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
        stdout, _ = await proc.communicate()
        result["client_end_wall"] = time.time()
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        lines = stdout.decode().strip().splitlines()
        print("\n".join(lines[:-1]))
        result.update(json.loads(lines[-1]))
        result["api_cpu_s"] = time.process_time() - cpu0
        result["client_cpu_s"] = (children1.ru_utime + children1.ru_stime
                                  - children0.ru_utime - children0.ru_stime)
        # the server's own view: arrival at the engine to first token (no HTTP, no client)
        result["server_mean_ttft_ms"] = _hist_mean(app.state.metrics.ttft) * 1000
        result["step_messages"] = engine.num_step_messages
        result["api_output_handling_s"] = engine.output_seconds
        await asyncio.sleep(1.5)  # the stand-in reports its busy time once idle
        server.should_exit = True
        await task

    asyncio.run(serve())
    client.shutdown(timeout=5)
    if report.exists():
        result.update(json.loads(report.read_text()))
        engine_tok_s = result["stand_in_tokens"] / result["stand_in_busy_s"]
        result["engine_output_tok_s"] = engine_tok_s
        # From the stand-in's first step to the client's last token: what the API process
        # delivered in the time the engine took (with --gate, every stream runs from step 1).
        window = result.pop("client_end_wall") - result["stand_in_first_step_wall"]
        result["delivery_window_s"] = window
        result["served_over_engine"] = result["stand_in_busy_s"] / window
        result["api_cpu_fraction"] = result["api_cpu_s"] / result["duration_s"]
        print(f"stand-in engine: {engine_tok_s:,.0f} tok/s ({result['stand_in_steps']} steps of "
              f"{ns.step_ms} ms, up to {result['stand_in_max_batch']} streams a step); its "
              f"tokens reached the client in {result['delivery_window_s']:.1f} s from its first "
              f"step, {result['served_over_engine']:.3f} of engine speed; API process CPU "
              f"{result['api_cpu_fraction']:.2f} core, of which handling step messages "
              f"{result['api_output_handling_s']:.2f} s over {result['step_messages']} messages")
    from pagedkv.bench.env import environment, hardware

    env = environment()
    result = {"benchmark": "scripts/serve_frontend_load.py (stand-in engine core)",
              "workload": ns.workload, "num_prompts": ns.num_prompts, "step_ms": ns.step_ms,
              "max_num_seqs": ns.max_num_seqs, "stream": not ns.no_stream, **result,
              "hardware": hardware(), "commit": env["commit"], "command": env["command"]}
    if ns.result_json:
        Path(ns.result_json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
