"""The kernels of a small fp8 decode step, one call each, for Nsight Compute (``ncu``).

A decode step of 16-64 sequences (a third of the real-ShareGPT fp8 run's time on an H200) is
far from its roofline: in the profile at 16 sequences of ~900 tokens the fp8 matmuls read their
weights at ~77% of the copy bandwidth, and decode attention takes ~25 us a layer for 29 MB of
cache (~7 us at the copy bandwidth). Timings alone do not say why; ``ncu``'s occupancy, warp
stall reasons and memory throughput do. This script runs Llama-3-8B's decode-step kernels at
``--batch`` rows (the engine's inputs: a padded decode plan over random paged blocks, e4m3
weights with per-channel scales), once each, so that

    ncu --clock-control none -k regex:'decode_kernel|decode_merge|fp8_matmul|rms_norm' \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats ... \\
        env NCU=1 python scripts/ncu_small_decode.py --batch 16

reports each kernel as the engine launches it (PDL off: ncu serializes the kernels anyway;
``NCU=1``: one call each). Without it the script prints each kernel's time (``triton.testing.do_bench``), a quick check.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("PAGEDATTN_PDL", "0")

import torch

import pagedattn_kernels as pk
from pagedattn_kernels.attention import plan as decode_plan
from pagedattn_kernels.attention import triton_launch as attn

log = logging.getLogger("ncu_small_decode")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 4096, 32, 8, 128, 14336, 16
FP8 = torch.float8_e4m3fn
LINEARS = {"qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
           "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}  # fmt: skip


def attention_inputs(batch: int, context: int, kv_dtype: torch.dtype, gen: torch.Generator):
    """A query, a paged cache of ``batch`` rows of ``context`` tokens in shuffled blocks (of a
    pool 8x larger, so the reads scatter as a serving cache's do) and its block table."""
    per_seq = -(-context // BLOCK)
    pool = 8 * batch * per_seq
    shape = (pool, BLOCK, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, generator=gen, device="cuda").to(kv_dtype)
    vc = torch.randn(shape, generator=gen, device="cuda").to(kv_dtype)
    perm = torch.randperm(pool, generator=gen, device="cuda")[: batch * per_seq]
    tables = perm.view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    return q, kc, vc, tables, lens


def attention_call(batch: int, context: int, kv_dtype: torch.dtype, gen: torch.Generator):
    q, kc, vc, tables, lens = attention_inputs(batch, context, kv_dtype, gen)
    plan = decode_plan.plan_decode([context] * batch, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   dtype=q.dtype, kv_dtype=kv_dtype, device=q.device,
                                   padded=True).to(q.device)  # fmt: skip
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    scales = {"k_scale": one, "v_scale": one} if kv_dtype == FP8 else {}
    out = torch.empty_like(q)
    log.info("attention %d x %d %s: plan of %d items", batch, context, kv_dtype,
             plan.to("cpu").num_items)  # fmt: skip
    return lambda: attn.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM**-0.5,
                                               None, out, plan=plan, **scales)  # fmt: skip


def matmul_call(batch: int, name: str, gen: torch.Generator):
    n, k = LINEARS[name]
    x = torch.randn(batch, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    xq, xs = pk.quantize_fp8_per_token(x)
    wq = (torch.randn(n, k, generator=gen, device="cuda") * 0.1).to(FP8)
    ws = torch.rand(n, generator=gen, device="cuda") * 0.01 + 0.001
    out = torch.empty(batch, n, dtype=torch.bfloat16, device="cuda")
    return lambda: pk.fp8_matmul(xq, xs, wq, ws, out=out)


def norm_call(batch: int, gen: torch.Generator):
    x = torch.randn(batch, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
    return lambda: pk.fused_add_rms_norm_fp8(x, res, w, 1e-5, residual_out=res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--only", default="attention,matmul,norm")
    ap.add_argument("--bf16-attention", action="store_true", help="also the bfloat16 cache")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    only = set(args.only.split(","))
    calls = {}
    if "attention" in only:
        calls["attention fp8"] = attention_call(args.batch, args.context, FP8, gen)
        if args.bf16_attention:
            calls["attention bf16"] = attention_call(args.batch, args.context, torch.bfloat16,
                                                     gen)  # fmt: skip
    if "matmul" in only:
        for name in LINEARS:
            calls[f"fp8_matmul {name}"] = matmul_call(args.batch, name, gen)
    if "norm" in only:
        calls["fused_add_rms_norm_fp8"] = norm_call(args.batch, gen)
    profiled = os.environ.get("NCU") == "1"  # under ncu: one call each, ncu times it
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        if not profiled:
            import triton.testing

            us = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3
            log.info("%-24s %8.1f us", name, us)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
