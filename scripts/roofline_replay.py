"""How much of a throughput run's gap to its roofline bound could faster kernels close? A
replay of the run's schedule on the CPU, no GPU needed.

The roofline bound of ``pagedkv.bench.throughput`` (``roofline.ModelCost.pass_bound``) is the
larger of all of a pass's bytes over the bandwidth and all of its products over the matmul
rate: it assumes that compute-bound work (the matmuls of a large decode batch) and
memory-bound work (its attention over the KV cache) overlap perfectly. An engine that runs
them one after the other, as pagedkv does (and vLLM, without NanoFlow-style nano-batches),
cannot beat the *serial* bound (``pass_serial_bound``): each at its own limit, summed.

The run's JSON keeps its totals, not its passes. The passes depend only on the scheduler,
the requests and the KV blocks, not on the model's numbers or the GPU's speed, so this script
replays the same scheduler (``pagedkv.scheduler.Scheduler``, the run's limits and block count)
on the same requests, records each pass as the model runner does, and sums both bounds at the
hardware rates the run measured. It checks the replay against the run (pass counts, and the
overlapped bound, which must come out as the run's ``roofline_bound_s``), then prints the
serial bound and what fraction of it the run reached, overall and per decode band, and the
bound of a pass split into 2-4 nano-batches that overlap perfectly (``nano_batch_bound``: each
nano-batch reads the weights again), the best an engine that overlaps that way could do.

    python scripts/roofline_replay.py docs/performance/throughput_llama3_8b_sharegpt_real.json \\
        docs/performance/throughput_llama3_8b_sharegpt_real_fp8.json --dataset .gpu_data/sharegpt_1000.json

A run with fp8 weights or an fp8 cache (its JSON's ``quantization`` and ``kv_cache_dtype``) is
costed as the benchmark costs it: the quantized layers at one byte a weight and the fp8
matmul rate the run measured, the cache at one byte an element.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from pagedkv.bench.roofline import Hardware, ModelCost
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models.quantization import quantize_model
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.request import RequestParams
from pagedkv.scheduler.scheduler import Scheduler

BANDS = ((1, 64), (65, 256), (257, 512), (513, 1024))


def replay(requests: list[dict], *, blocks: int, cpu_blocks: int, block_size: int,
           max_num_seqs: int, max_tokens: int, max_model_len: int) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """The passes (tokens, sequences, KV tokens attended, query-key pairs) of the schedule,
    as ``ModelRunner`` logs them for the roofline."""
    sched = Scheduler(SchedulerConfig(
        block_size=block_size, num_gpu_blocks=blocks, num_cpu_blocks=cpu_blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=True,
    ))  # fmt: skip
    for i, r in enumerate(requests):
        sched.add_request(f"r{i}", r["prompt_token_ids"],
                          RequestParams(max_tokens=r["output_len"], ignore_eos=True), 0.0)  # fmt: skip
    passes = []
    while sched.has_unfinished():
        out = sched.schedule()
        if not out.scheduled:
            break
        qlens = [s.num_tokens for s in out.scheduled]
        starts = [s.start for s in out.scheduled]
        total = sum(qlens)
        pairs = sum(q * s + q * (q + 1) // 2 for q, s in zip(qlens, starts, strict=True))
        passes.append((total, len(qlens), sum(starts) + total, pairs))
        sched.update(out, {s.seq_id: [1] for s in out.scheduled if s.do_sample})
    return passes


def nano_batch_bound(cost: ModelCost, hw: Hardware, n: int, p: tuple[int, int, int, int]) -> float:
    """A pass split into ``n`` nano-batches whose matmuls and attention overlap perfectly
    (NanoFlow's idea): every nano-batch reads all the weights again, so the bytes grow by
    ``(n - 1)`` weight reads while the products stay the same. At the decode batches of this
    workload the weights are a large share of the bytes, which is why splitting pays so
    little: the larger of the two totals, as ``pass_bound``, with ``n`` weight reads."""
    weights, matmul, kv, attention = cost.parts(hw, *p)
    return max(n * weights + kv, matmul + attention)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_json", nargs="+",
                    help="pagedkv.bench.throughput results with a roofline (each replayed)")
    ap.add_argument("--dataset", required=True, help="the run's requests (--dataset of the run)")
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cpu-blocks", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = {path: json.loads(Path(path).read_text()) for path in args.run_json}
    for path, run in runs.items():
        if "roofline_bound_s" not in run:
            raise SystemExit(f"{path}: no roofline in this run (a CPU run?)")
    for path, run in runs.items():
        if len(runs) > 1:
            print(f"== {path}")
        report(run, args)
    return 0


def report(run: dict, args: argparse.Namespace) -> None:
    """Replay one run and print its bounds (see the module docstring)."""
    requests = json.loads(Path(args.dataset).read_text())["requests"][: run["num_prompts"]]
    passes = replay(requests, blocks=run["num_gpu_blocks"], cpu_blocks=args.cpu_blocks,
                    block_size=args.block_size, max_num_seqs=run["max_num_seqs"],
                    max_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)  # fmt: skip
    cfg = ModelConfig.from_model(args.model, load_format="dummy", dtype="bfloat16", device="cpu")
    model = load_model(cfg, load_format="dummy", device="meta")
    if run.get("quantization", "none") != "none":  # the weights at their stored size
        quantize_model(model, run["quantization"], lm_head=run.get("quantize_lm_head", False))
    kv_dtype = torch.float8_e4m3fn if run.get("kv_cache_dtype") == "fp8" else None
    cost = ModelCost.of(model, cfg, cfg.kv_bytes_per_token(kv_dtype))
    fp8_rate = run.get("fp8_matmul_tflop_s")
    hw = Hardware(bandwidth=run["hbm_gb_s"] * 1e9, matmul_flops=run["matmul_tflop_s"] * 1e12,
                  fp8_matmul_flops=fp8_rate * 1e12 if fp8_rate else None)
    bound = [cost.pass_bound(hw, *p) for p in passes]
    serial = [cost.pass_serial_bound(hw, *p) for p in passes]
    decode = [i for i, p in enumerate(passes) if p[0] == p[1]]
    print(f"replay: {len(passes)} passes ({len(decode)} decode, {len(passes) - len(decode)} with "
          f"prompt tokens), {sum(p[0] for p in passes) - sum(len(r['prompt_token_ids']) for r in requests):,} "
          f"sampled tokens past the prompts; the run: {run['forward_passes']} passes "
          f"({run.get('decode_passes')} decode, {run.get('mixed_passes')} mixed)")
    print(f"overlapped bound: replay {sum(bound):.3f} s, the run {run['roofline_bound_s']:.3f} s")
    secs = run["seconds"]
    print(f"serial bound: {sum(serial):.3f} s; the run took {secs:.2f} s: {sum(bound) / secs:.1%} of "
          f"the overlapped bound, {sum(serial) / secs:.1%} of the serial one; a run at the serial "
          f"bound would be at {sum(bound) / sum(serial):.1%} of the overlapped one")
    nano = {n: sum(nano_batch_bound(cost, hw, n, p) for p in passes) for n in (2, 3, 4)}
    best = [min(serial[i], *(nano_batch_bound(cost, hw, n, passes[i]) for n in (2, 3, 4)))
            for i in range(len(passes))]  # fmt: skip
    print("split into nano-batches that overlap perfectly (each reads the weights): "
          + ", ".join(f"{n}: {v:.3f} s" for n, v in nano.items())
          + f"; the best of serial and 2-4 nano-batches, pass by pass: {sum(best):.3f} s "
          f"({sum(bound) / sum(best):.1%} of the overlapped bound)")
    bands = run.get("decode_host_gap_by_batch", {})
    for lo, hi in BANDS:
        idx = [i for i in decode if lo <= passes[i][1] <= hi]
        row = bands.get(f"{lo}-{hi}")
        if not idx or row is None:
            continue
        b, s = sum(bound[i] for i in idx), sum(serial[i] for i in idx)
        nb = sum(best[i] for i in idx)
        print(f"  decode {lo}-{hi}: {len(idx)} passes (run {row['passes']}), bound {b:.3f} s, "
              f"serial {s:.3f} s, run {row['seconds']:.3f} s: {b / row['seconds']:.1%} / "
              f"{s / row['seconds']:.1%}; at the serial bound {b / s:.1%}, with nano-batches "
              f"{b / nb:.1%}")
    mixed = [i for i in range(len(passes)) if i not in set(decode)]
    if mixed and run.get("mixed_seconds"):
        b, s = sum(bound[i] for i in mixed), sum(serial[i] for i in mixed)
        print(f"  prompt passes: bound {b:.3f} s, serial {s:.3f} s, run {run['mixed_seconds']:.3f} s: "
              f"{b / run['mixed_seconds']:.1%} / {s / run['mixed_seconds']:.1%}")


if __name__ == "__main__":
    sys.exit(main())
