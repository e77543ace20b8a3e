"""Decode attention on an fp8 cache at the shapes a serving run decodes: tiles and splits.

In the real-ShareGPT run of Llama-3-8B on an H200 (fp8 weights and cache, 6d1d2a1), a decode
step's attention on the fp8 cache took nearly as long as on the bfloat16 cache, although it
reads half the bytes (profile at 7101138: 2.80 ms against 2.92 per step at 128 sequences of
~900 tokens, 0.69 against 0.72 ms at 16). The kernel benchmark's fp8 rows (64 x 4k and up) do
not show it: the engine decodes many short contexts, through CUDA graphs captured with
``max_seq_len = max_model_len`` (2,048 here), which sets the split count.

This script times ``paged_decode_attention`` as the engine calls it (``SHAPES``: batch x
context from 16 x 900 to 512 x 500, and 64 x 4k, 16 x 8k; ``--shapes`` for others): the
automatic configuration on the bfloat16 and the fp8 cache, then other tiles (``DecodeConfig``:
``BF16_CONFIGS``, ``CONFIGS``) and, for up to ``SPLIT_MAX_BATCH`` sequences, forced split counts
(``--splits``; ``--automatic-configs``: the automatic tiles only, with the forced splits).
Each is replayed from CUDA graphs over enough cache copies (> 256 MB) that the keys come from
HBM, not from the 50 MB L2. Per row: ``us``, ``bw_frac`` (the cache bytes read against the
copy bandwidth) and ``vs_bf16`` (the bfloat16 cache's time over this one: 2.0 would be the
bytes' ratio).

The CUDA errors of earlier runs ("operation not supported on global/shared address space",
"an illegal memory access", 2b5b50b to 7107b3a, each at the first run of a new shape) were this
script's own race, not a kernel's: ``triton.testing.do_bench_cudagraph`` runs ``fn`` on a
stream of its own, which does not wait for the default stream, where the new shape's caches
and block table were still being written. The decode kernel then read block ids from memory
the previous shape had freed. Each shape ran alone, or with ``CUDA_LAUNCH_BLOCKING=1``, without
error, and the error came also with ``PAGEDATTN_PDL=0`` (H200, 7107b3a). The inputs are now
complete (``torch.cuda.synchronize``) before any timing.

    python scripts/decode_fp8_engine_shapes.py --output-json OUT.json       # on a GPU
    TRITON_INTERPRET=1 python scripts/decode_fp8_engine_shapes.py --check   # CPU: outputs only
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
import time

import torch
import triton.testing
from variant_cli import start, write_result

from pagedattn_kernels.attention import plan as decode_plan
from pagedattn_kernels.attention import triton_launch as tl_launch

log = logging.getLogger("decode_fp8_engine_shapes")

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3-8B
MAX_MODEL_LEN = 2048
SHAPES = [(16, 900), (48, 900), (128, 500), (256, 500), (512, 500), (64, 4096), (16, 8192)]
D = tl_launch.DecodeConfig
CONFIGS = [D(128, 4, 3), D(64, 2, 3), D(64, 4, 3), D(128, 4, 2), D(64, 2, 3, per_sm=4),
           # the ragged last tile inside the pipelined loop (decode_kernel's ONE_LOOP)
           D(128, 4, 3, one_loop=True), D(64, 2, 3, one_loop=True), D(128, 4, 2, one_loop=True),
           D(64, 2, 3, per_sm=4, one_loop=True),
           # one warp: 32-token tiles (FP8_ONE_WARP; FP8_PLANNED_ONE_WARP, by plans, in two
           # stages) and 64 (FP8_LONG, without a plan)
           D(32, 1, 3, per_sm=8), D(32, 1, 2, per_sm=8), D(64, 1, 2, per_sm=8)]  # fmt: skip
# the bfloat16 cache: its default tiles with the ragged tile in the loop
BF16_CONFIGS = [D(128, 4, 2, one_loop=True), D(64, 4, 2, one_loop=True)]
# forced split counts, tried up to SPLIT_MAX_BATCH sequences (more: the automatic count); the
# bfloat16 cache gets the forced ones too: does a shorter chain of tiles per program pay at
# small batches, where each program walks its partition tile after tile?
SPLITS = [None, 1, 4, 8, 16]
SPLIT_MAX_BATCH = 64
ROTATE_BYTES = 256e6


def caches(lens: list[int], dtype: torch.dtype, gen: torch.Generator, copies: int):
    """``copies`` paged K/V caches in shuffled blocks, and the block table they share."""
    per_seq = [-(-n // BLOCK) for n in lens]
    shape = (sum(per_seq), BLOCK, KV_HEADS, HEAD_DIM)
    out = []
    for _ in range(copies):
        kc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        vc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        out.append((kc, vc))
    perm = torch.randperm(shape[0], generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), bound(max(lens)) // BLOCK, dtype=torch.int32, device="cuda")
    for i, piece in enumerate(perm.split(per_seq)):
        tables[i, : len(piece)] = piece
    return out, tables


def context_lengths(batch: int, context: int, how: str, seed: int) -> list[int]:
    """The batch's context lengths: ``fixed`` (all ``context``), ``spread`` (uniform over
    [context / 2, 3 context / 2], the spread of ``pagedkv.bench.decode_step``), or the path of
    a ShareGPT workload file (``pagedkv.bench.paper_gpu prepare``): the contexts of a batch of
    live requests in the middle of a run, each a request drawn with a weight of its output
    length (a request stays in the batch for as many steps as it generates), at a uniform
    point of its output (``context`` is then unused). Capped below ``MAX_MODEL_LEN``."""
    rng = random.Random(seed)
    if how == "fixed":
        return [context] * batch
    if how == "spread":
        return [rng.randint(max(1, context // 2), context * 3 // 2) for _ in range(batch)]
    with open(how) as f:
        reqs = json.load(f)["requests"]
    pairs = [(len(r["prompt_token_ids"]), int(r["output_len"])) for r in reqs]
    picks = rng.choices(pairs, weights=[max(o, 1) for _, o in pairs], k=batch)
    return [min(p + rng.randint(0, o), MAX_MODEL_LEN - 1) for p, o in picks]


def parse_configs(text: str) -> list:
    """``DecodeConfig``s from TILE_N/WARPS/STAGES[/PER_SM][+FIELD[=INT]...] items,
    comma-separated; each FIELD a field of ``DecodeConfig`` set true or to INT, e.g.
    ``128/4/2/3+one_loop+saturate_per_sm=2``."""
    configs = []
    for item in filter(None, text.split(",")):
        numbers, *flags = item.split("+")
        fields = {k: int(v) if v else True for k, _, v in (f.partition("=") for f in flags)}
        configs.append(D(*map(int, numbers.split("/")), **fields))
    return configs


def bound(context: int) -> int:
    """The engine's graphs pass max_model_len as max_seq_len: 2,048, or the context if longer."""
    return max(MAX_MODEL_LEN, context)


def attend(q, kv, tables, lens, out, config=None, splits=None, min_partition=None, plan=None):
    kc, vc = kv
    scales = {}
    if kc.dtype == FP8:
        one = torch.ones(1, dtype=torch.float32, device=q.device)
        scales = {"k_scale": one, "v_scale": one}
    return tl_launch.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM**-0.5,
                                            tables.shape[1] * BLOCK, out, num_splits=splits,
                                            config=config, min_partition=min_partition,
                                            plan=plan, **scales)  # fmt: skip


def graph_plan(host_lens: list[int], dtype: torch.dtype, config, spec: str):
    """The decode plan of these contexts as the engine's CUDA graphs stage it (padded to its
    capacity), for ``config`` (None: the automatic one), on the GPU. ``spec``: ``planM`` (M:
    the min chunk) or ``planMxK`` (and K times the lanes: chunks K times shorter); a final
    ``e``: exactly the plan's items, without the padding items of a graph's capacity."""
    exact = spec.endswith("e")  # the items alone, no capacity's padding items
    min_chunk, _, scale = spec.removeprefix("plan").removesuffix("e").partition("x")
    min_chunk, scale = int(min_chunk), int(scale or 1)
    batch = len(host_lens)
    cfg = config or tl_launch.decode_config(HEAD_DIM, torch.bfloat16, False, dtype,
                                            batch * KV_HEADS, planned=True)  # fmt: skip
    lanes = scale * max(1, cfg.per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                        // KV_HEADS)  # fmt: skip
    built = decode_plan.build_plan(host_lens, lanes, cfg.tile_n,
                                   size=None if exact else decode_plan.capacity(batch, lanes),
                                   min_chunk=min_chunk)  # fmt: skip
    log.info("plan B=%d min chunk %d: %d items, %d split rows, %d lanes", batch, min_chunk,
             built.num_items, int((built.merges[:, 0] >= 0).sum()), lanes)  # fmt: skip
    return built.to("cuda")


def check() -> int:
    """Every config and split on a small fp8 cache against the automatic one (CPU or GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, context = 3, 100
    per_seq = -(-context // BLOCK)
    shape = (batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, generator=gen, device=dev).to(FP8)
    vc = torch.randn(shape, generator=gen, device=dev).to(FP8)
    tables = torch.zeros(batch, MAX_MODEL_LEN // BLOCK, dtype=torch.int32, device=dev)
    tables[:, :per_seq] = torch.arange(batch * per_seq, device=dev).view(batch, per_seq)
    lens = torch.tensor([context, 37, 64], dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    ref = tl_launch.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM**-0.5, context,
                                           torch.empty_like(q), k_scale=one, v_scale=one)  # fmt: skip
    bad = 0
    for cfg, splits in itertools.product(CONFIGS, (None, 2)):
        got = tl_launch.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM**-0.5,
                                               context, torch.empty_like(q), num_splits=splits,
                                               config=cfg, k_scale=one, v_scale=one)  # fmt: skip
        err = float((got.double() - ref.double()).abs().max())
        bad += not err < 2e-2
        log.info("%s splits=%s: max |diff| %.1e %s", cfg, splits, err, "ok" if err < 2e-2 else "WRONG")
    for cfg in CONFIGS:  # plans, as graph_plan builds them, with chunks of one tile allowed
        lanes = max(1, cfg.per_sm * 4 // KV_HEADS)
        plan = decode_plan.build_plan(lens.tolist(), lanes, cfg.tile_n,
                                      size=decode_plan.capacity(batch, lanes),
                                      min_chunk=cfg.tile_n).to(dev)  # fmt: skip
        got = tl_launch.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM**-0.5,
                                               context, torch.empty_like(q), config=cfg,
                                               k_scale=one, v_scale=one, plan=plan)  # fmt: skip
        err = float((got.double() - ref.double()).abs().max())
        bad += not err < 2e-2
        log.info("%s plan: max |diff| %.1e %s", cfg, err, "ok" if err < 2e-2 else "WRONG")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="batch x context pairs to time instead of "
                    "SHAPES, e.g. 64x4096,16x8192")
    ap.add_argument("--bf16-only", action="store_true", help="the bfloat16 cache only")
    ap.add_argument("--splits", default="", help="forced split counts to try instead of "
                    "SPLITS[1:], e.g. 8,16 (up to SPLIT_MAX_BATCH sequences); 'none': only "
                    "the automatic count")
    ap.add_argument("--configs", default="", help="fp8 tiles to try instead of CONFIGS: "
                    "TILE_N/WARPS/STAGES[/PER_SM][+FLAG] items, comma-separated (e.g. 64/2/4,32/1/3/9, "
                    "128/4/2+one_loop: a boolean field of DecodeConfig set)")
    ap.add_argument("--bf16-configs", default="", help="bfloat16 tiles to try instead of "
                    "BF16_CONFIGS, as --configs")
    ap.add_argument("--automatic-configs", action="store_true",
                    help="only the automatic tiles (with the forced splits): no CONFIGS sweep")
    ap.add_argument("--lengths", default="fixed", help="the batch's contexts: fixed (all the "
                    "shape's), spread (uniform over half to 1.5x it), or a ShareGPT workload "
                    "JSON (live requests' contexts; the shape's context unused)")
    ap.add_argument("--min-partition", type=int, default=None, help="with --splits: the "
                    "fewest tokens a split sequence gives one program (default: one tile)")
    ap.add_argument("--split-max-batch", type=int, default=SPLIT_MAX_BATCH,
                    help="forced splits up to this many sequences (more: the automatic count)")
    ap.add_argument("--plan", default="", help="also time decode plans (plan_decode: chunks "
                    "balanced over the batch's contexts, longest first), one per min chunk "
                    "listed, e.g. 64,128,256, or MxK: K times the lanes (chunks K times "
                    "shorter), M[xK]e: without a graph's padding items; with each config "
                    "unless --automatic-configs")
    ap.add_argument("--longest-first", action="store_true", help="also time each shape with "
                    "its sequences in order of context length, longest first")
    run = start(ap, check, budget_s=150.0)
    if isinstance(run, int):
        return run
    args, deadline, copy_bw, gen = run.args, run.deadline, run.copy_bw, run.gen
    rows: list[dict] = []
    shapes = [tuple(map(int, x.split("x"))) for x in args.shapes.split(",") if x] or SHAPES
    fp8_configs = parse_configs(args.configs) or CONFIGS
    bf16_configs = parse_configs(args.bf16_configs) or BF16_CONFIGS
    runs = [(b, c, False) for b, c in shapes]
    if args.longest_first:
        runs = [(b, c, order) for b, c in shapes for order in (False, True)]
    for batch, context, longest_first in runs:
        host_lens = context_lengths(batch, context, args.lengths, seed=batch)
        if longest_first:
            host_lens.sort(reverse=True)
        if args.lengths not in ("fixed", "spread"):
            context = round(sum(host_lens) / batch)  # the rows' context: the mean
        lens = torch.tensor(host_lens, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(q)
        bf16_us = None
        for dtype in (torch.bfloat16,) if args.bf16_only else (torch.bfloat16, FP8):
            nbytes = 2 * sum(host_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
            kvs, tables = caches(host_lens, dtype, gen, max(1, int(-(-ROTATE_BYTES // nbytes))))
            forced = ([] if args.splits == "none" else
                      [int(x) for x in args.splits.split(",") if x] or SPLITS[1:])
            forced = forced if batch <= args.split_max_batch else []  # many pairs: automatic
            plans = [f"plan{m}" for m in args.plan.split(",") if m]
            variants = [(None, None)] + [(None, s) for s in forced + plans]
            if not args.automatic_configs:
                configs = bf16_configs if dtype == torch.bfloat16 else fp8_configs
                variants += [(c, s) for c in configs for s in [None, *forced, *plans]]
            for cfg, splits in variants:
                if time.monotonic() > deadline:
                    break
                it = itertools.cycle(kvs)
                plan = None
                if isinstance(splits, str):
                    plan = graph_plan(host_lens, dtype, cfg, splits)

                def run(cfg=cfg, splits=splits, it=it, tables=tables, lens=lens, q=q, out=out,
                        plan=plan):  # fmt: skip
                    if plan is not None:
                        return attend(q, next(it), tables, lens, out, cfg, plan=plan)
                    return attend(q, next(it), tables, lens, out, cfg, splits, args.min_partition)

                row = {"batch": batch, "context": context, "lengths": args.lengths,
                       "kv": str(dtype).split(".")[-1],
                       "config": None if cfg is None else [cfg.tile_n, cfg.num_warps,
                                                           cfg.num_stages, cfg.per_sm,
                                                           cfg.one_loop],
                       "splits": splits, "longest_first": longest_first}  # fmt: skip
                # named before it runs: a sticky CUDA error (run with CUDA_LAUNCH_BLOCKING=1)
                # then points at the variant whose kernel raised it, not at the next one
                log.info("run B=%d ctx=%d %s %s splits=%s longest first=%s", batch, context,
                         row["kv"], row["config"], splits, longest_first)  # fmt: skip
                try:
                    # do_bench_cudagraph times on its own stream: the inputs must be written
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3
                except Exception as exc:  # a tile that does not compile or fit
                    rows.append({**row, "error": repr(exc)[:300]})
                    log.info("B=%d ctx=%d %s: error %s", batch, context, row, repr(exc)[:200])
                    continue
                if dtype == torch.bfloat16 and cfg is None and splits is None:
                    bf16_us = us  # the automatic bfloat16 row: what vs_bf16 compares with
                row.update(us=us, bw_frac=nbytes / us / 1e6 / copy_bw)
                if bf16_us:
                    row["vs_bf16"] = bf16_us / us
                rows.append(row)
                log.info("B=%-4d ctx=%-4d %-9s %-24s splits=%-4s longest first=%-5s %8.1f us "
                         "%5.1f%% of copy %s", batch, context, row["kv"], row["config"], splits,
                         longest_first, us,
                         100 * row["bw_frac"], f"x{row['vs_bf16']:.2f} bf16" if bf16_us else "")
            del kvs
    best = {}
    for r in rows:
        key = (r["batch"], r["context"], r["longest_first"])
        if r.get("kv") == "float8_e4m3fn" and "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for key, r in best.items():
        log.info("best fp8 B=%d ctx=%d longest first=%s: %s splits=%s %.1f us %.1f%% x%.2f bf16",
                 *key, r["config"], r["splits"], r["us"], 100 * r["bw_frac"],
                 r.get("vs_bf16", float("nan")))  # fmt: skip
    write_result(args, "decode_fp8_engine_shapes", "decode_fp8_engine_shapes.py",
                 copy_bw_TBps=copy_bw, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
