"""Host time of one eager ``pagedattn_kernels.paged_decode_attention`` call, and where it goes.

Without a CUDA graph each call's Python (checks, configuration, split count, scratch
buffer) and its Triton launches are paid on the host. When that takes longer than the kernel,
the GPU waits for the host: the kernel benchmark's eager decode rows (``bench.kernels``: L2
flushed before each call, so the launch is not hidden behind the previous call) then measure
the host. This script times the calls back to back with nothing to wait for (launches queued,
synchronized once) and prints cProfile's top functions by their own time.

    python scripts/decode_host_time.py --shapes 1x32768,64x4096 --kv bf16,fp8   # on a GPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import sys
import time

import torch

import pagedattn_kernels as pk

log = logging.getLogger("decode_host_time")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3-8B


def call(batch: int, context: int, kv: str):
    """A closure that decodes ``batch`` sequences of ``context`` tokens as the benchmark does."""
    blocks = batch * -(-context // BLOCK)
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    kc = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scales = {}
    if kv == "fp8":
        one = torch.ones(1, device="cuda")
        scales = {"k_scale": one, "v_scale": one}
    return lambda: pk.paged_decode_attention(q, kc, kc, tables, lens, max_seq_len=context,
                                             out=out, **scales)  # fmt: skip


def host_us(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,64x4096", help="batch x context pairs")
    ap.add_argument("--kv", default="bf16,fp8", help="caches: bf16, fp8")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=18, help="cProfile lines per shape")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU")
        return 2
    for shape in filter(None, args.shapes.split(",")):
        batch, context = map(int, shape.split("x"))
        for kv in filter(None, args.kv.split(",")):
            fn = call(batch, context, kv)
            best = min(host_us(fn, args.calls) for _ in range(3))
            log.info("B=%d ctx=%d %s: %.1f us of host time a call (best of 3 x %d)", batch,
                     context, kv, best, args.calls)  # fmt: skip
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
            log.info("%s", text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
