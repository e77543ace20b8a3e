"""NCCL's share of a tensor-parallel decode step (issue 17, item 3), measured on every rank.

    torchrun --standalone --nproc-per-node 2 scripts/tp_allreduce_share.py \
        --model meta-llama/Meta-Llama-3-8B --batch-sizes 1,16,64,256,512,1024 \
        --output "$OUT/tp_allreduce_8b.json"

Each rank builds its shard of the model (dummy bf16 weights of the named shape) and a KV cache
holding ``--context`` tokens per sequence, then times, for each decode batch size, three CUDA
graphs replayed back to back (the way the engine replays its decode passes):

* ``step``: the decode pass as the engine runs it, its all-reduces captured inside;
* ``compute``: the same pass with every all-reduce made a no-op (what the GPUs compute);
* ``all_reduce``: the pass's all-reduces alone, ``2 * layers + 1`` of ``[batch, hidden]``.

``nccl_share = 1 - compute / step`` is what the all-reduces add to a step (waiting for the
slower rank included); ``all_reduce / step`` is what they cost on their own. Rank 0 prints a
table and writes the JSON (the slower rank's times). With ``--device cpu`` (gloo, eager passes,
a small model) the same code runs in the tests, so that the GPU run does not fail on a typo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist


def _timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Median milliseconds of ``fn()`` over ``iters`` runs after warm-up (CUDA events on a
    GPU: device time, back to back)."""

    def cuda_time(fn: Callable[[], None], iters: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def cpu_time(fn: Callable[[], None], iters: int) -> float:
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cuda_time if device.type == "cuda" else cpu_time


@contextmanager
def _no_all_reduce():
    """The model's all-reduces as no-ops (the layers look the function up when they run)."""
    from pagedkv.engine.models import parallel_layers

    real = parallel_layers.all_reduce
    parallel_layers.all_reduce = lambda x, tp: x
    try:
        yield
    finally:
        parallel_layers.all_reduce = real


def _decode_pass(model, kv_caches, batch: int, context: int, block_size: int,
                 device: torch.device, vocab: int) -> Callable[[], None]:
    """One decode pass over ``batch`` sequences of ``context`` tokens: a CUDA graph replay on
    a GPU (captured now, so a patched all-reduce is what it captures), else eager."""
    from pagedkv.engine.worker.cuda_graphs import DecodeGraphs
    from pagedkv.engine.worker.inputs import StepBatch, build_inputs

    per_seq = math.ceil(context / block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [(7 * i) % vocab for i in range(batch)]
    positions = [context - 1] * batch
    if device.type == "cuda":
        graphs = DecodeGraphs(model, kv_caches, block_size=block_size, max_model_len=context,
                              max_blocks_per_seq=per_seq, max_num_seqs=batch, device=device)
        graphs.sizes = [batch]  # this batch size only
        graphs.capture()
        return lambda: graphs.replay(ids, positions, tables, batch)
    step = StepBatch([[t] for t in ids], positions, tables, list(range(batch)))
    inputs, _ = build_inputs(step, block_size, device)
    return lambda: model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)


def _all_reduces(count: int, batch: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> Callable[[], None]:
    """``count`` all-reduces of ``[batch, hidden]``, in a CUDA graph on a GPU."""
    x = torch.zeros((batch, hidden), dtype=dtype, device=device)

    def run() -> None:
        for _ in range(count):
            dist.all_reduce(x)

    if device.type != "cuda":
        return run
    run()  # warm up outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    parser.add_argument("--batch-sizes", default="1,16,64,256,512,1024")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", default=None, help="JSON file (rank 0)")
    args = parser.parse_args(argv)

    from pagedkv.engine.config import ModelConfig
    from pagedkv.engine.distributed.communication import TPInfo
    from pagedkv.engine.distributed.parallel_state import apply_nccl_env, rank_model_config
    from pagedkv.engine.model_loader import load_model

    apply_nccl_env()  # NVLink multicast stays off, as in the engine
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        dtype = getattr(torch, args.dtype)
        sizes = [int(b) for b in args.batch_sizes.split(",") if b]
        context = args.context
        config = ModelConfig.from_model(args.model, dtype=dtype, max_model_len=context,
                                        load_format="dummy", device=device)
        model = load_model(config, load_format="dummy", device=device, dtype=dtype,
                           tp=TPInfo(rank, world))
        mine = rank_model_config(config, world)
        per_seq = math.ceil(context / args.block_size)
        kv = torch.zeros((mine.num_layers, 2, max(sizes) * per_seq, args.block_size,
                          mine.num_kv_heads, mine.head_dim), dtype=dtype, device=device)
        kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(mine.num_layers)]
        timer = _timer(device)
        hidden = config.hidden_size
        rows = []
        with torch.inference_mode():
            for b in sizes:
                step_fn = _decode_pass(model, kv_caches, b, context, args.block_size, device,
                                       config.vocab_size)
                step = timer(step_fn, args.iters)
                with _no_all_reduce():
                    compute = timer(_decode_pass(model, kv_caches, b, context, args.block_size,
                                                 device, config.vocab_size), args.iters)
                reduce = timer(_all_reduces(2 * mine.num_layers + 1, b, hidden, dtype, device),
                               args.iters)
                mine_row = {"batch": b, "step_ms": step, "compute_ms": compute,
                            "all_reduce_ms": reduce}
                every = [None] * world if rank == 0 else None
                dist.gather_object(mine_row, every, dst=0)
                if rank == 0:  # the slower rank decides a step's time
                    row = {k: max(r[k] for r in every) for k in mine_row}
                    row["nccl_share"] = 1 - row["compute_ms"] / row["step_ms"]
                    row["all_reduce_share"] = row["all_reduce_ms"] / row["step_ms"]
                    rows.append(row)
                    print(f"batch {b:5d}: step {row['step_ms']:7.3f} ms, compute "
                          f"{row['compute_ms']:7.3f} ms, all-reduces alone "
                          f"{row['all_reduce_ms']:7.3f} ms -> NCCL share "
                          f"{row['nccl_share']:6.1%} (alone {row['all_reduce_share']:6.1%})",
                          flush=True)
                del step_fn
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            result = {
                "model": config.name, "tensor_parallel_size": world, "dtype": args.dtype,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "context_tokens": context, "all_reduces_per_step": 2 * mine.num_layers + 1,
                "commit": os.environ.get("PAGEDKV_COMMIT"), "rows": rows,
                "command": " ".join(["torchrun", "--nproc-per-node", str(world),
                                     "scripts/tp_allreduce_share.py", *sys.argv[1:]]),
            }
            if args.output:
                with open(args.output, "w") as f:
                    json.dump(result, f, indent=2)
            print(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
