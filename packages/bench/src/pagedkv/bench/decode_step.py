"""The offline engine's decode step at given batch sizes (`python -m pagedkv.bench.decode_step`).

Issue 21 asks that below saturation a streamed token cost at most 1.3x what the engine alone
needs for one decode step of the batch the server ran at. This module measures that reference:
one `LLMEngine` with the engine options given (the server's), and for each batch size B, B
requests whose prompts put the decode context near `--context` tokens; after their prefills and
a few warm-up steps it times `--steps` decode steps (the CUDA-graph path on a GPU, as the
server decodes) and reports the mean wall time of a step (what a token's TPOT averages over),
the median and the minimum; then it aborts them and goes on to the next size. A sweep's
ratios use the median step: one slow step in the window (a first use of a shape outside the
CUDA graphs, say) moves the mean of 32 steps by tens of percent (measured on an H200: mean
41.8 ms against a median of 9.9 ms at 169 sequences), the median does not.

    python -m pagedkv.bench.decode_step --batch-sizes 1,64,256 --context 490 \\
        --model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16

`--prefill-prompt-len N` times prefill passes instead (or first): each a step's whole token
budget of fresh prompts of about N tokens (`measure_prefill`); with `--profile-steps` both
print the GPU time by kernel.

`--sweep-json PATH` takes the batch sizes from a `bench serve --request-rates` result (each
rate's `batch_size_median`) and the context from its requests (the mean context over every
generated token of the same seeded workload), and writes back into that file each rate's
`offline_decode_step_ms` (the median step) and `tpot_over_decode_step` and the sweep's
`tpot_over_decode_step_max_below_knee` (after each batch size, so a run cut short keeps what it
measured). `scripts/gpu_serve_sweep.sh` runs it after stopping the server, on the same GPU with
the same engine options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

#: Decode steps timed per batch size, and untimed ones before them.
DEFAULT_STEPS = 32
DEFAULT_WARMUP_STEPS = 8


def decode_context(specs: list[Any]) -> float:
    """Mean context length (prompt plus tokens generated so far) over every token the requests
    generate: the KV context a decode step of this workload attends over, on average."""
    tokens = sum(s.output_len for s in specs)
    if tokens == 0:
        raise ValueError("the requests generate no tokens: no decode context to measure")
    total = sum(len(s.prompt) * s.output_len + s.output_len * (s.output_len - 1) / 2
                for s in specs)
    return total / tokens


def _sync(device: Any) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


#: Kernel families of a decode step, by a substring of the kernel's name (first match wins).
KERNEL_FAMILIES = (
    ("attention", ("paged", "attention", "attn", "flash", "decode_kernel", "decode_reduce",
                   "prefill_kernel")),
    ("rotary and cache write", ("rotary_and_cache",)),
    ("cache write", ("reshape_and_cache", "cache")),
    ("rms norm", ("rms",)),
    ("rotary", ("rotary", "rope")),
    ("silu and mul", ("silu",)),
    ("fp8 quant", ("quant",)),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90", "sm80", "splitk", "matmul")),
    ("sampling", ("argmax", "max_", "softmax", "sample", "topk")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def _pdl_on(device: Any) -> bool:
    """Whether the kernels launch with programmatic dependent launch (Hopper and later)."""
    if not str(device).startswith("cuda"):
        return False
    import torch

    from pagedattn_kernels.common import use_pdl

    return use_pdl(torch.device(device))


def kernel_table(prof: Any, steps: int, top: int = 20) -> dict[str, Any]:
    """GPU time per step of a torch.profiler run over `steps` decode steps: by kernel family
    and the `top` kernels by name (kernels inside CUDA graph replays are traced one by one)."""
    import torch

    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = by_name.setdefault(e.name, [0.0, 0])
            row[0] += e.time_range.elapsed_us()
            row[1] += 1
    families: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        fam = kernel_family(name)
        families[fam] = families.get(fam, 0.0) + us / steps
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "gpu_us_per_step": sum(families.values()),
        "families_us_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n[:120], "us_per_step": us / steps, "calls_per_step": c / steps,
                         "family": kernel_family(n)} for n, (us, c) in kernels],
    }


def format_kernel_table(table: dict[str, Any]) -> str:
    total = table["gpu_us_per_step"]
    if not total:
        return "  (no GPU kernels traced)"
    lines = [f"  GPU time per step {total:.0f} us:"]
    lines += [f"    {fam:14s} {us:9.1f} us  {100 * us / total:5.1f}%"
              for fam, us in table["families_us_per_step"].items()]
    lines += [f"    {k['us_per_step']:9.1f} us  x{k['calls_per_step']:<6.1f} {k['family']:12s} "
              f"{k['name'][:90]}" for k in table["top_kernels"]]
    return "\n".join(lines)


def measure_batch(engine: Any, batch_size: int, context: int, steps: int,
                  warmup: int, profile_steps: int = 0) -> dict[str, Any]:
    """Time `steps` decode steps of `batch_size` sequences whose contexts are spread around
    `context` tokens (so that they cross block boundaries on different steps, as in a real
    run), then with `profile_steps` profile that many more under torch.profiler (the GPU
    time by kernel: `kernel_table`); the engine is left empty."""
    from pagedkv.engine.sampling_params import SamplingParams

    max_len = int(engine.model_config.max_model_len)
    room = warmup + steps + profile_steps + 2
    centre = max(min(context - (warmup + steps // 2), max_len - room - context // 2), 2)
    spread = centre // 2
    vocab = int(engine.model_config.vocab_size)
    rng = random.Random(batch_size)
    lengths = [rng.randint(max(centre - spread, 1), centre + spread) for _ in range(batch_size)]
    lengths = [min(n, max_len - room) for n in lengths]
    if min(lengths) < 1:
        raise ValueError(f"max_model_len {max_len} leaves no room for {room} decode steps")
    ids = [f"decode-{batch_size}-{i}" for i in range(batch_size)]
    for rid, n in zip(ids, lengths):
        # Room to the context's end, not just the timed steps: with large batches the prefills
        # take many steps, and the first sequences prefilled decode all through them (384 x 900
        # tokens: 21 chunks of 16,384); with a tight budget they finished before the timing.
        # They are aborted when it is done.
        params = SamplingParams(max_tokens=max_len - n, temperature=0.0, ignore_eos=True,
                                detokenize=False)
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(n)], params)
    try:
        # Prefills (chunked), until a step is a decode step of the whole batch: nothing waits
        # and every sequence got a token. (The stats' prompt_tokens counts prompts as they are
        # added, not as they are computed: it cannot tell when the prefills are done.)
        for _ in range(10 * batch_size + 100):
            before = engine.get_stats().generation_tokens
            engine.step()
            st = engine.get_stats()
            if (st.num_waiting == 0 and st.num_running == batch_size
                    and st.generation_tokens - before == batch_size):  # fmt: skip
                break
        else:
            raise RuntimeError(f"the prefills of {batch_size} requests did not finish")
        for _ in range(warmup):
            engine.step()
        times = []
        _sync(engine.device)
        clock = time.perf_counter
        tokens0 = engine.get_stats().generation_tokens
        for _ in range(steps):
            t0 = clock()
            engine.step()
            times.append(clock() - t0)
        _sync(engine.device)
        running = engine.get_stats().num_running
        # Every timed step a decode step of the whole batch: one token per sequence each.
        decode_only = engine.get_stats().generation_tokens - tokens0 == steps * batch_size
        kernels = None
        if profile_steps:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(profile_steps):
                    engine.step()
                _sync(engine.device)
            kernels = kernel_table(prof, profile_steps)
            if _pdl_on(engine.device):
                logger.warning("programmatic dependent launch is on: a kernel's time includes "
                               "its wait for the kernel before it, so the times overlap; run "
                               "with PAGEDATTN_PDL=0 for a per-kernel breakdown")  # fmt: skip
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    if running != batch_size:
        logger.warning("batch %d: %d sequences running at the end (preempted or finished): "
                       "not a steady decode state", batch_size, running)
    if not decode_only:
        logger.warning("batch %d: the timed steps were not all decode steps of the whole "
                       "batch (prefills or preemptions inside the window)", batch_size)
    return {
        "batch_size": batch_size,
        "decode_step_ms": 1e3 * sum(times) / len(times),
        "median_step_ms": 1e3 * statistics.median(times),
        "min_step_ms": 1e3 * min(times),
        "steps": steps,
        "context_mean": statistics.fmean(lengths) + warmup + steps / 2,
        "num_running": running,
        "decode_only": decode_only,
        **({"kernels": kernels} if kernels is not None else {}),
    }


@contextlib.contextmanager
def _profiled(events: list[Any] | None) -> Iterator[None]:
    """Run the block under torch.profiler and append its events to `events` (None: plain)."""
    if events is None:
        yield
        return
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield
    events.extend(prof.events())


def measure_prefill(engine: Any, prompt_len: int, passes: int,
                    profile_passes: int = 0) -> dict[str, Any]:
    """Time `passes` prefill passes, each a step's whole token budget (`max_num_batched_tokens`)
    of fresh prompts of `prompt_len` tokens on average (spread +-50%, the last one cut to fit),
    one output token each; one untimed pass first (Triton compiles, first-use allocations),
    then with `profile_passes` that many more under torch.profiler (`kernel_table`).

    Why: the run's first passes prefill the requests it was given all at once, 16,384 tokens
    each; there the matmuls are compute-bound, unlike a decode step's, so they have their own
    profile. The engine is left empty."""
    from pagedkv.engine.sampling_params import SamplingParams

    budget = int(engine.args.max_num_batched_tokens)
    max_seqs = int(engine.args.max_num_seqs)
    max_len = int(engine.model_config.max_model_len)
    vocab = int(engine.model_config.vocab_size)
    if not 1 <= prompt_len < max_len:
        raise ValueError(f"--prefill-prompt-len must be in [1, {max_len}) (max_model_len)")
    rng = random.Random(prompt_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def one_pass(tag: str, events: list[Any] | None = None) -> tuple[float, int]:
        lengths: list[int] = []
        total = 0
        while total < budget and len(lengths) < max_seqs:
            n = rng.randint(max(prompt_len // 2, 1), min(prompt_len * 3 // 2, max_len - 1))
            lengths.append(min(n, budget - total))
            total += lengths[-1]
        ids = [f"prefill-{tag}-{i}" for i in range(len(lengths))]
        for rid, n in zip(ids, lengths):
            engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(n)], params)
        _sync(engine.device)
        # Only the pass itself is timed and profiled: with asynchronous scheduling (CUDA) a
        # step launches its pass and hands back the outputs of the step before, so the steps
        # that finish these requests come after, untimed.
        with _profiled(events):
            t0 = time.perf_counter()
            engine.step()
            _sync(engine.device)
            elapsed = time.perf_counter() - t0
        scheduled_all = engine.get_stats().num_waiting == 0
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        if not scheduled_all:
            raise RuntimeError(f"{len(lengths)} prompts of {total} tokens did not prefill in "
                               "one pass: raise --max-num-seqs or lower the length")
        return elapsed, total

    one_pass("warmup")
    times, tokens = [], 0
    for i in range(passes):
        elapsed, tokens = one_pass(str(i))
        times.append(elapsed)
    kernels = None
    if profile_passes:
        events: list[Any] = []
        for i in range(profile_passes):
            one_pass(f"profile{i}", events)
        kernels = kernel_table(SimpleNamespace(events=lambda: events), profile_passes, top=30)
    return {
        "prompt_len": prompt_len,
        "tokens_per_pass": tokens,
        "prefill_pass_ms": 1e3 * sum(times) / len(times),
        "median_pass_ms": 1e3 * statistics.median(times),
        "min_pass_ms": 1e3 * min(times),
        "passes": passes,
        **({"kernels": kernels} if kernels is not None else {}),
    }


def measure_decode_steps(
    engine: Any,
    batch_sizes: list[int],
    context: int,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP_STEPS,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    profile_steps: int = 0,
) -> list[dict[str, Any]]:
    """`measure_batch` for each batch size, ascending; `on_result(result)` after each."""
    max_seqs = int(engine.args.max_num_seqs)
    results = []
    for b in sorted(set(batch_sizes)):
        if b > max_seqs:
            logger.warning("batch %d is above --max-num-seqs %d: skipped", b, max_seqs)
            continue
        r = measure_batch(engine, b, context, steps, warmup, profile_steps)
        results.append(r)
        logger.info("batch %d: decode step %.2f ms (median %.2f)", b, r["decode_step_ms"],
                    r["median_step_ms"])
        if on_result is not None:
            on_result(r)
    return results


def parse_sizes(text: str) -> list[int]:
    """`1,64,256` -> [1, 64, 256]; a clear error otherwise."""
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--batch-sizes: {text!r} is not a list of integers (e.g. 1,64,256)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes: give batch sizes >= 1 (got {text!r})")
    return sizes


def sweep_inputs(data: dict[str, Any]) -> tuple[list[int], float, float]:
    """From a sweep's JSON: (the rates' batch sizes, the decode context of its requests, the
    knee's latency growth bound)."""
    from pagedkv.bench.serve_requests import make_requests
    from pagedkv.bench.serve_saturation import DEFAULT_KNEE_LATENCY_GROWTH

    rates = data.get("rates") or []
    sizes = sorted({s["batch_size_median"] for s in rates if s.get("batch_size_median")})
    if not sizes:
        raise ValueError("the sweep has no batch sizes (no rate has batch_size_median: run it "
                         "with --metrics-period > 0 against a server with /metrics)")
    options = dict(data["setup"]["options"])
    specs = make_requests(argparse.Namespace(**options))
    bound = float(options.get("knee_latency_growth", DEFAULT_KNEE_LATENCY_GROWTH))
    return sizes, decode_context(specs), bound


def run(args: argparse.Namespace) -> int:
    from pagedkv.bench.env import environment
    from pagedkv.bench.serve_report import json_ready, write_json
    from pagedkv.bench.serve_saturation import (
        attach_decode_steps,
        format_saturation_table,
        saturation_record,
    )
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    data: dict[str, Any] | None = None
    if args.sweep_json:
        data = json.loads(Path(args.sweep_json).read_text())
        sizes, context, bound = sweep_inputs(data)
        if args.context is not None:
            context = args.context
    else:
        if not args.batch_sizes and not args.prefill_prompt_len:
            raise ValueError("give --batch-sizes, --sweep-json or --prefill-prompt-len")
        sizes = parse_sizes(args.batch_sizes) if args.batch_sizes else []
        context = args.context or 490
    if args.steps < 1 or args.warmup_steps < 0 or args.profile_steps < 0:
        raise ValueError("--steps must be >= 1, --warmup-steps and --profile-steps >= 0")
    if args.prefill_passes < 1:
        raise ValueError("--prefill-passes must be >= 1")
    engine_args = EngineArgs.from_cli_args(args)
    if sizes:
        print(f"decode step: batch sizes {sizes}, context ~{context:.0f} tokens, {args.steps} "
              f"timed steps each", flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    engine.emit_partial_outputs = False  # as the throughput benchmark and the engine core run
    print(f"engine ready in {time.perf_counter() - t0:.1f} s on {engine.device}", flush=True)
    measured: list[dict[str, Any]] = []
    env = environment()
    pre: dict[str, Any] | None = None

    def save(r: dict[str, Any]) -> None:
        measured.append(r)
        print(f"  batch {r['batch_size']:>5}: decode step {r['decode_step_ms']:.3f} ms "
              f"(median {r['median_step_ms']:.3f}, min {r['min_step_ms']:.3f})", flush=True)
        if "kernels" in r:
            print(format_kernel_table(r["kernels"]), flush=True)
        record = {"command": env["command"], "context": context,
                  "steps": args.steps, "device": str(engine.device), "commit": env["commit"],
                  "by_batch": list(measured), **({"prefill": pre} if pre else {})}
        if data is not None:
            attach_decode_steps(data["rates"],
                                {m["batch_size"]: m["median_step_ms"] for m in measured})
            data.update(saturation_record(data["rates"], bound))
            data["offline_decode"] = record
            write_json(args.sweep_json, data)
        elif args.output_json:
            write_json(args.output_json, record)

    if args.prefill_prompt_len:
        pre = measure_prefill(engine, args.prefill_prompt_len, args.prefill_passes,
                              args.profile_steps)
        print(f"  prefill pass of {pre['tokens_per_pass']} tokens (prompts of "
              f"~{pre['prompt_len']}): {pre['prefill_pass_ms']:.2f} ms (median "
              f"{pre['median_pass_ms']:.2f}, min {pre['min_pass_ms']:.2f})", flush=True)
        if "kernels" in pre:
            print(format_kernel_table(pre["kernels"]), flush=True)
        if not sizes:
            if args.output_json:
                write_json(args.output_json, {"command": env["command"],
                                              "commit": env["commit"], "prefill": pre})
            print(json.dumps({"prefill_pass_ms": pre["prefill_pass_ms"]}))
            return 0
    measure_decode_steps(engine, sizes, round(context), args.steps, args.warmup_steps,
                         on_result=save, profile_steps=args.profile_steps)
    if data is not None:
        print(format_saturation_table(data["rates"], bound))
        line = {k: data[k] for k in ("knee_rate", "tpot_over_decode_step_max_below_knee",
                                     "p99_itl_ms_max_below_knee")}
    else:
        line = {"decode_step_ms": {m["batch_size"]: m["decode_step_ms"] for m in measured}}
    print(json.dumps(json_ready(line)))
    return 0


def main(argv: list[str] | None = None) -> int:
    from pagedkv.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.decode_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                        help="batch sizes to time (or --sweep-json)")
    parser.add_argument("--sweep-json", default=None, metavar="PATH",
                        help="a bench serve --request-rates result: time its rates' batch sizes "
                        "and write the ratios into it")
    parser.add_argument("--context", type=float, default=None,
                        help="mean KV context in tokens (default: the sweep's workload, or 490, "
                        "that of 400 ShareGPT-like requests)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, profile this many more: GPU time per step "
                        "by kernel family and the top kernels")
    parser.add_argument("--prefill-prompt-len", type=int, default=0, metavar="TOKENS",
                        help="first time prefill passes of one step's whole token budget, of "
                        "prompts this long on average (with --profile-steps: by kernel too)")
    parser.add_argument("--prefill-passes", type=int, default=4,
                        help="timed prefill passes (after one untimed)")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="with --batch-sizes or --prefill-prompt-len: write the results "
                        "here")
    parser.add_argument("--log-level", default="INFO")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ValueError as exc:
        print(f"decode_step: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
