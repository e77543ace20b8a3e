"""How much fp8 changes what a model says: greedy token agreement of an fp8 KV cache
(``--kv-cache-dtype fp8``) and of fp8 weights (``--quantization fp8``, and with
``--quantize-lm-head`` the LM head's too) with the default cache and weights (the model
dtype), on the same prompts in the same batches.

    python -m pagedkv.bench.fp8_accuracy                      # embedded model, 64 x 64 tokens
    python -m pagedkv.bench.fp8_accuracy --dtype bfloat16 --device cuda

Each variant runs the same ``--num-prompts`` Alpaca-like instructions
(:mod:`pagedkv.bench.instructions`, in the model's chat template), all at once, greedy,
``--max-tokens`` tokens each (``ignore_eos``: every sequence has the same length), and its
tokens are compared with the reference run's, sequence by sequence:

- ``first_divergence``: the position of the first token that differs (``max_tokens`` when none
  does); its mean over the sequences is ``mean_first_divergence``;
- ``agreement_before_divergence``: the tokens before each sequence's first divergence over all
  tokens (1.0: every sequence identical); after a divergence the two runs continue different
  texts, so later positions say nothing about fp8 any more;
- ``sequences_equal``: the fraction of sequences identical to the end;
- ``prefix_equal_at``: per position p, the fraction of sequences identical up to p (a survival
  curve), and ``token_equal_at``: the fraction whose token p is the same (whatever came before).

The variants share the reference's scheduling (no preemption, one prefill pass: the check says
so in the output), so a difference comes from fp8 alone; ``control`` re-runs the reference to
show that a run agrees with itself (1.0 on the CPU, where float32 runs are deterministic).
On the CPU the model runs in float32, so there the figure is fp8 against a float32 cache (and
float32 weights); on a GPU with ``--dtype bfloat16`` it is fp8 against bf16. fp8 weights run a
dequantizing matmul on the CPU (the same products as ``torch._scaled_mm``, slower): its time
here is not a speed figure.

``--save-prompts FILE`` writes the prompts' token ids; ``--prompts-file FILE`` reads them back,
so a machine without the tokenizer (``--skip-tokenizer-init``) runs the same prompts. The last
line of output is the JSON result (``--output-json`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.common import (
    engine_benchmark_parser,
    print_json_line,
    print_table,
    run_engine_benchmark,
)
from pagedkv.bench.env import environment, hardware

logger = logging.getLogger(__name__)

PROG = "python -m pagedkv.bench.fp8_accuracy"

#: Variant name -> the engine options it changes from the reference.
VARIANTS: dict[str, dict[str, Any]] = {
    "control": {},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
    "weights_fp8": {"quantization": "fp8"},
    "kv_and_weights_fp8": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
    # --quantize-lm-head: the LM head's matrix in fp8 as well (off by default, as in vLLM)
    "weights_lm_head_fp8": {"quantization": "fp8", "quantize_lm_head": True},
    "kv_weights_lm_head_fp8": {"kv_cache_dtype": "fp8", "quantization": "fp8",
                               "quantize_lm_head": True},
    # Context for the figures: the whole model (weights, activations, cache) in bfloat16
    # against a float32 reference (the CPU's); on a bf16 reference it is the control.
    "model_bf16": {"dtype": "bfloat16"},
}
DEFAULT_VARIANTS = ("control", "kv_fp8", "weights_fp8")


def compare(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Agreement of ``other``'s greedy tokens with ``reference``'s (same prompts, same order,
    sequences of equal length); see the module docstring for each figure."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"compare needs the same non-zero number of sequences "
                         f"({len(reference)} vs {len(other)})")
    length = len(reference[0])
    if length == 0 or any(len(r) != length or len(o) != length
                          for r, o in zip(reference, other)):
        raise ValueError("compare needs sequences of one non-zero length on both sides")
    firsts = []
    for ref, got in zip(reference, other):
        first = next((p for p, (a, b) in enumerate(zip(ref, got)) if a != b), length)
        firsts.append(first)
    n = len(reference)
    diverged = [f for f in firsts if f < length]
    return {
        "sequences": n,
        "tokens_per_sequence": length,
        "agreement_before_divergence": sum(firsts) / (n * length),
        "sequences_equal": sum(f == length for f in firsts) / n,
        "mean_first_divergence": sum(firsts) / n,
        "mean_first_divergence_of_diverged": (sum(diverged) / len(diverged)
                                              if diverged else None),
        "median_first_divergence": sorted(firsts)[n // 2],
        "first_divergence": firsts,
        "prefix_equal_at": [sum(f > p for f in firsts) / n for p in range(length)],
        "token_equal_at": [sum(r[p] == o[p] for r, o in zip(reference, other)) / n
                           for p in range(length)],
    }


def add_accuracy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("accuracy run")
    g.add_argument("--num-prompts", type=int, default=64, help="instructions (1 to 64)")
    g.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    g.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    g.add_argument("--prompts-file", default=None,
                   help="read the prompts' token ids from this JSON file (as --save-prompts "
                        "writes it) instead of tokenizing the instructions")
    g.add_argument("--save-prompts", default=None, help="write the prompts' token ids here")
    g.add_argument("--output-json", default=None, help="also write the JSON result here")


def _prompts(args: argparse.Namespace, tokenizer: Any) -> tuple[list[list[int]], str]:
    if args.prompts_file:
        data = json.loads(Path(args.prompts_file).read_text())
        prompts = [[int(t) for t in p] for p in data["prompts"]][: args.num_prompts]
        if len(prompts) < args.num_prompts:
            raise ValueError(f"{args.prompts_file} holds {len(prompts)} prompts; asked for "
                             f"{args.num_prompts}")
        return prompts, str(data.get("source", args.prompts_file))
    if tokenizer is None:
        raise ValueError("no tokenizer (--skip-tokenizer-init): give --prompts-file")
    from pagedkv.bench.instructions import alpaca_like_instructions

    texts = alpaca_like_instructions(args.num_prompts)
    if getattr(tokenizer, "chat_template", None):
        # As `LLM.chat` prompts the engine: the template's text, tokenized as a text prompt is.
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
        prompts = [list(tokenizer(c).input_ids) for c in chats]
        how = "in the model's chat template"
    else:
        prompts = [list(tokenizer(t).input_ids) for t in texts]
        how = "plain text"
    return prompts, f"{len(texts)} Alpaca-like instructions (pagedkv.bench.instructions), {how}"


def _greedy_run(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    from pagedkv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"acc-{i}", ids, params)
    finals: dict[str, Any] = {}
    passes = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        passes += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    tokens = [list(finals[f"acc-{i}"].outputs[0].token_ids) for i in range(len(prompts))]
    info = {"seconds": seconds, "steps": passes, "preemptions": stats.num_preemptions,
            "num_gpu_blocks": engine.runner.num_gpu_blocks,
            "kv_cache_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch.")}
    return tokens, info


def _free_memory() -> None:
    """Give a deleted engine's KV cache and graphs back (its model may live on in the next)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def teacher_forced(engine: Any, prompts: list[list[int]], reference: list[list[int]],
                   chunk: int = 16) -> dict[str, Any]:
    """Top-1 agreement with the reference *given the reference's own history*: each prompt
    followed by the reference's tokens is scored in one prefill (``prompt_logprobs=0``), and a
    position agrees when the reference's token is this engine's most likely one there (rank
    1). Unlike the free-running figures, a disagreement does not change what comes after, so
    every position says something about the variant. Requests go in chunks of ``chunk`` (the
    prompt logprobs of a pass cover the whole vocabulary for every token)."""
    from pagedkv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    length = len(reference[0])
    hits = [0] * length
    for lo in range(0, len(prompts), chunk):
        ids = range(lo, min(lo + chunk, len(prompts)))
        for i in ids:
            engine.add_request(f"tf-{i}", prompts[i] + reference[i], params)
        finals: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        for i in ids:
            scored = finals[f"tf-{i}"].prompt_logprobs[len(prompts[i]):]
            for p, (tok, lp) in enumerate(zip(reference[i], scored, strict=True)):
                hits[p] += lp[tok].rank == 1
    n = len(prompts)
    return {"teacher_forced_top1": sum(hits) / (n * length),
            "teacher_forced_top1_at": [h / n for h in hits]}


def run_accuracy(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    base = EngineArgs.from_cli_args(args)
    if base.kv_cache_dtype != "auto" or base.quantization is not None:
        raise ValueError("the reference runs the default cache and weights: leave "
                         "--kv-cache-dtype and --quantization out (the variants set them)")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if base.tensor_parallel_size != 1:
        raise ValueError("the accuracy run shares weights between engines: use one device "
                         "(--tensor-parallel-size 1)")
    load_before = os.getloadavg()

    ref_engine = LLMEngine(base)
    mc = ref_engine.model_config
    prompts, source = _prompts(args, ref_engine.tokenizer)
    if args.save_prompts:
        Path(args.save_prompts).write_text(json.dumps({"source": source, "prompts": prompts}))
    n_in = sum(map(len, prompts))
    print(f"model {mc.name}, {mc.dtype} on {ref_engine.device}; {len(prompts)} prompts "
          f"({n_in / len(prompts):.1f} tokens on average; {source}), {args.max_tokens} greedy "
          f"tokens each", flush=True)
    reference, ref_info = _greedy_run(ref_engine, prompts, args.max_tokens)
    device = ref_engine.device
    # Engines with the same weights share one loaded model; one KV cache lives at a time (on a
    # GPU each engine sizes its cache from the memory left free).
    models: dict[tuple[str | None, str | None, bool], Any] = {
        (None, None, False): ref_engine.runner.model}
    ref_engine.shutdown()
    del ref_engine
    _free_memory()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        opts = VARIANTS[name]
        key = (opts.get("quantization"), opts.get("dtype"), opts.get("quantize_lm_head", False))
        # Token ids in, token ids out: no tokenizer to load again (seconds for a GGUF's).
        engine = LLMEngine(base.replace(skip_tokenizer_init=True, **opts),
                           model=models.get(key))  # fmt: skip
        models.setdefault(key, engine.runner.model)
        tokens, info = _greedy_run(engine, prompts, args.max_tokens)
        info.update(teacher_forced(engine, prompts, reference))
        engine.shutdown()
        del engine
        _free_memory()
        results[name] = {**compare(reference, tokens), **info}
        r = results[name]
        print(f"{name:20s} agreement before divergence {r['agreement_before_divergence']:.3f}, "
              f"sequences equal {r['sequences_equal']:.3f}, mean first divergence "
              f"{r['mean_first_divergence']:.1f} of {args.max_tokens}, teacher-forced top-1 "
              f"{r['teacher_forced_top1']:.3f} ({info['seconds']:.1f} s, "
              f"{info['preemptions']} preemptions)", flush=True)
        if info["steps"] != ref_info["steps"] or info["preemptions"] or ref_info["preemptions"]:
            logger.warning("%s ran %d steps (%d preemptions) against the reference's %d (%d): "
                           "its batches differ from the reference's; give the cache more memory",
                           name, info["steps"], info["preemptions"], ref_info["steps"],
                           ref_info["preemptions"])
    del models

    columns = ["agreement_before_divergence", "sequences_equal", "mean_first_divergence",
               "teacher_forced_top1"]
    rows = [{"variant": k, **{c: v[c] for c in columns}} for k, v in results.items()]
    print_table(rows, ["variant", *columns])
    # Called as main(argv) from code: the command is that argv (else this process's own).
    env = environment(argv=getattr(args, "argv", None), prog=PROG)
    marks = [p for p in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256) if p <= args.max_tokens]
    result = {
        "benchmark": "fp8_accuracy",
        "title": f"fp8 accuracy: greedy agreement with {str(mc.dtype).removeprefix('torch.')}, "
                 f"{mc.name}",
        "command": env.get("command"),
        "commit": env.get("commit"),
        "hardware": hardware(device),
        "model": mc.name,
        "workload": f"{len(prompts)} prompts x {args.max_tokens} greedy tokens (ignore_eos); "
                    f"{source}",
        "setup": {"reference_dtype": str(mc.dtype).removeprefix("torch."),
                  "device": str(device),
                  "torch_threads": torch.get_num_threads(),
                  "load_average_1min_before_after": [round(load_before[0], 2),
                                                     round(os.getloadavg()[0], 2)],
                  "prompt_tokens_mean": n_in / len(prompts),
                  "reference_steps": ref_info["steps"],
                  "reference_seconds": ref_info["seconds"]},
        # Scalars per variant make the table; the lists beside them are the whole curves.
        "variants": {k: {c: v[c] for c in ("agreement_before_divergence", "sequences_equal",
                                           "mean_first_divergence",
                                           "mean_first_divergence_of_diverged",
                                           "median_first_divergence", "teacher_forced_top1",
                                           "preemptions", "kv_cache_dtype", "seconds",
                                           "first_divergence", "prefix_equal_at",
                                           "token_equal_at", "teacher_forced_top1_at")}
                     for k, v in results.items()},
        "prefix_equal_curve": [
            {"position": p, **{k: v["prefix_equal_at"][p - 1] for k, v in results.items()}}
            for p in marks
        ],
        "teacher_forced_curve": [
            {"position": p, **{k: v["teacher_forced_top1_at"][p - 1] for k, v in results.items()}}
            for p in marks
        ],
        "env": env,
    }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
    print_json_line(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    from pagedkv.engine.arg_utils import EngineArgs

    parser = engine_benchmark_parser(PROG, __doc__.split("\n")[0])
    add_accuracy_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(argv=argv)
    return run_engine_benchmark(parser.parse_args(argv), run_accuracy, "fp8_accuracy")


if __name__ == "__main__":
    sys.exit(main())
