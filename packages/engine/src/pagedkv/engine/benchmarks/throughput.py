"""`pagedkv bench throughput`: offline throughput of the engine, and of transformers on the
same requests in the same run.

Requests are random token ids with lengths from a named workload (the same seeded generator
the scheduler's simulator uses) or fixed `--input-len/--output-len`; every request runs to its
output length (`ignore_eos`), so every system does the same work. The transformers baseline is
`generate` with static, left-padded batches in arrival order at each batch size given; the best
one is the baseline. With `--baseline hf-cb` transformers' continuous-batching `generate_batch`
runs too.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.benchmarks.common import environment, print_json_line, print_table

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
    g.add_argument("--dataset", default=None, help="JSON list of {prompt_len, output_len} to replay")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of lengths and token ids")
    g.add_argument("--save-workload", default=None, help="write the requests to this JSON file")
    g.add_argument("--baseline", action="append", default=[], choices=("hf", "hf-cb"),
                   help="also run transformers: hf = static batches, hf-cb = generate_batch")
    g.add_argument("--hf-batch-sizes", default="8,16,32",
                   help="static batch sizes to try for the hf baseline; the best one counts")
    g.add_argument("--output-json", default=None, help="also write the JSON result to this file")


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    import random

    rng = random.Random(args.workload_seed)
    if args.dataset:
        rows = json.loads(Path(args.dataset).read_text())
        lengths = [(int(r["prompt_len"]), int(r["output_len"])) for r in rows][: args.num_prompts]
    elif args.workload:
        from pagedkv.scheduler.workloads import sample_lengths

        lengths = sample_lengths(args.workload, args.num_prompts, seed=args.workload_seed)
    else:
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    # Token ids avoid the first ids, where tokenizers keep their special tokens.
    low = min(1000, vocab_size // 4)
    reqs = [
        BenchRequest([rng.randrange(low, vocab_size) for _ in range(p)], o) for p, o in lengths
    ]
    if args.save_workload:
        Path(args.save_workload).write_text(
            json.dumps([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in reqs])
        )
    return reqs


def run_pagedkv(engine, reqs: list[BenchRequest]) -> float:
    """Seconds to run every request to completion through one engine."""
    from pagedkv.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(
            f"bench-{i}", r.prompt_token_ids,
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, detokenize=False),
        )
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


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


def run_hf_static(model, reqs: list[BenchRequest], batch_size: int, pad_id: int) -> float:
    """Seconds for transformers `generate` over static left-padded batches in arrival order."""
    import torch

    device = next(model.parameters()).device
    start = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=pad_id,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_hf_continuous(model, reqs: list[BenchRequest]) -> float:
    """Seconds for transformers' continuous batching (`generate_batch`)."""
    import torch
    from transformers import GenerationConfig

    max_new = max(r.output_len for r in reqs)
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate_batch(inputs=[r.prompt_token_ids for r in reqs], generation_config=cfg)
    return time.perf_counter() - start


def run_throughput_cli(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    engine.emit_partial_outputs = False
    mc = engine.model_config
    reqs = make_requests(args, mc.vocab_size)
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    env = environment()
    print(f"model {mc.name} ({mc.architecture}, {mc.num_layers} layers, dtype {mc.dtype}) on "
          f"{engine.device}; {len(reqs)} requests, {n_in} prompt and {n_out} output tokens; "
          f"env {env}")

    run_pagedkv(engine, reqs[: min(4, len(reqs))])  # warm-up: kernels, allocator, graphs
    secs = run_pagedkv(engine, reqs)
    rows = [{"system": "pagedkv", "seconds": secs, "requests_per_s": len(reqs) / secs,
             "total_tok_s": (n_in + n_out) / secs, "output_tok_s": n_out / secs}]
    result = {"output_tok_s": n_out / secs, "requests_per_s": len(reqs) / secs,
              "total_tok_s": (n_in + n_out) / secs, "num_prompts": len(reqs),
              "prompt_tokens": n_in, "output_tokens": n_out, "env": env}

    if args.baseline:
        device = engine.device
        dtype = mc.dtype
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        model = _hf_model(mc, device, dtype)
        pad_id = next(iter(mc.eos_token_ids), 0)
        if "hf" in args.baseline:
            best = None
            for bs in [int(x) for x in args.hf_batch_sizes.split(",") if x]:
                try:
                    s = run_hf_static(model, reqs, bs, pad_id)
                except torch.OutOfMemoryError:
                    logger.warning("hf static batch %d ran out of memory", bs)
                    torch.cuda.empty_cache()
                    continue
                rows.append({"system": f"hf generate (batch {bs})", "seconds": s,
                             "requests_per_s": len(reqs) / s, "total_tok_s": (n_in + n_out) / s,
                             "output_tok_s": n_out / s})
                if best is None or s < best[1]:
                    best = (bs, s)
            if best is not None:
                result["baseline_output_tok_s"] = n_out / best[1]
                result["baseline_batch_size"] = best[0]
                result["ratio"] = result["output_tok_s"] / result["baseline_output_tok_s"]
        if "hf-cb" in args.baseline:
            try:
                s = run_hf_continuous(model, reqs)
                rows.append({"system": "hf generate_batch", "seconds": s,
                             "requests_per_s": len(reqs) / s, "total_tok_s": (n_in + n_out) / s,
                             "output_tok_s": n_out / s})
                result["hf_cb_output_tok_s"] = n_out / s
                result["ratio_vs_hf_cb"] = result["output_tok_s"] / result["hf_cb_output_tok_s"]
            except Exception as exc:  # optional baseline: report, do not fail the run
                logger.warning("transformers generate_batch failed: %s", exc)
    print_table(rows, ["system", "seconds", "requests_per_s", "total_tok_s", "output_tok_s"])
    if "ratio" in result:
        print(f"pagedkv / best transformers static batch: {result['ratio']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print_json_line(result)
    return 0
