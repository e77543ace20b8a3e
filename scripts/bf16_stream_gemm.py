"""Can the swapped fp8 matmul's tiles beat cuBLAS's bf16 matmuls at decode batch sizes?

At 1-64 rows a bf16 decode step of Llama-3-8B is ~78% matmuls, and cuBLAS reads the four
linear layers' weights at 72-96% of the copy bandwidth: Q/K/V (50 MB) at ~76%, the output
projection (34 MB, split K plus a reduce kernel) at ~62%, gate/up at ~90% and down (split K
plus a reduce kernel) at ~85% (the decode profiles of 34eaf52 and 2d09a7d). The replay of
the real-ShareGPT run (``scripts/roofline_replay.py``) puts the largest share of the run's
missing time in these small passes (1.8 of 5.5 s). ``pagedattn_kernels.fp8_matmul``'s kernel
streams the weights with the weight rows on the tensor-core tile's long side and merges split
K in its last split; on e4m3 weights it reads gate/up at 94.8% of the copy bandwidth at one
row (dd684d9). ``triton_launch.matmul_16bit`` runs the same kernel on bf16 operands without
scales. This script times it against ``F.linear`` on the four shapes (Q/K/V 6144x4096, O
4096x4096, gate/up 28672x4096, down 4096x14336) at ``--m`` rows, replayed from CUDA graphs with
the weights rotated through more than 256 MB (from HBM, as in a decode step): with
``pick_config_16bit``'s tiles and with each config of ``--configs``. Per row: ``us``,
``bw_frac`` (weight and activation bytes against the copy bandwidth), ``vs_bf16``; per M the
layer's sum for cuBLAS, the pick and the fastest config of each shape.

``--blas``: ``F.linear`` through cuBLASLt as well (``bf16_lt``: torch's
``preferred_blas_library("cublaslt")``, what ``TORCH_BLAS_PREFER_CUBLASLT=1`` sets for a whole
run), whose heuristic picks other kernels than cuBLAS's. The profiles of f39b7cd show cuBLAS's
at 160 rows reading the output projection at 41% of the copy bandwidth and Q/K/V at 59%
(split K plus a reduce kernel for down): the 65-512-sequence bands of the bf16 run. With
``--configs none --blas --m 64 96 128 160 192 256 384 512`` the script times just the two.

    python scripts/bf16_stream_gemm.py --output-json OUT.json                 # on a GPU
    python scripts/bf16_stream_gemm.py --configs none --blas --m 64 128 160 256 512  # cuBLAS vs Lt
    TRITON_INTERPRET=1 python scripts/bf16_stream_gemm.py --check            # CPU: outputs only
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from fp8_weight_only_gemm import (
    LLAMA3_8B_LINEARS,
    ROTATE_BYTES,
    layer_sums,
    rel_err,
    time_row,
)
from variant_cli import start, write_result

from pagedattn_kernels.quant import triton_launch as ql

log = logging.getLogger("bf16_stream_gemm")
C = ql.Fp8MatmulConfig
# (block_n, block_k, split_k, num_warps, num_stages): 64/128 weight rows a tile, 64/128
# columns (128/256 bytes) a step, unsplit or the automatic split, pipelines of 4-8 steps
CONFIGS = [C(64, 64, 1, 4, 8, promote=False), C(64, 128, 1, 4, 4, promote=False),
           C(64, 128, 1, 4, 6, promote=False), C(64, 128, 0, 4, 4, promote=False),
           C(128, 64, 1, 4, 6, promote=False), C(128, 64, 1, 4, 4, promote=False),
           C(128, 128, 1, 4, 3, promote=False), C(64, 64, 0, 4, 8, promote=False),
           C(64, 64, 2, 4, 8, promote=False), C(32, 128, 1, 4, 6, promote=False)]  # fmt: skip


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's matmuls through ``name`` ("cublas" or "cublaslt") inside the block; a CUDA
    graph captured inside keeps that library's kernels."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def linear_lt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear`` through cuBLASLt."""
    with blas_library("cublaslt"):
        return F.linear(x, w)


def check() -> int:
    """``matmul_16bit`` against float64 at small shapes with forced splits (the numbers are
    tested in tests/kernels/test_fp8_matmul.py; this checks the script's calls)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    bad = 0
    for m, n, k, split in ((1, 96, 256, 1), (16, 64, 192, 3), (48, 80, 200, 2)):
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(torch.bfloat16)
        cfg = C(32, 64, split, 4, 1 if dev == "cpu" else 4, promote=False)
        y = ql.matmul_16bit(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=dev), cfg)
        err = rel_err(y, x.double() @ w.double().T)
        bad += not err < 1e-2
        log.info("M=%-3d N=%-3d K=%-3d split=%d: rel err %.1e %s", m, n, k, split, err,
                 "ok" if err < 1e-2 else "WRONG")  # fmt: skip
        if dev == "cuda":  # a CPU build of torch has no cuBLASLt to switch to
            err = rel_err(linear_lt(x, w), x.double() @ w.double().T)
            bad += not err < 1e-2
            log.info("  F.linear through cuBLASLt: rel err %.1e", err)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    ap.add_argument("--configs", choices=("all", "none"), default="all",
                    help="time CONFIGS as well as the pick (none: the pick only; with --blas, "
                    "neither)")
    ap.add_argument("--blas", action="store_true",
                    help="time F.linear through cuBLASLt too (bf16_lt)")
    run = start(ap, check, budget_s=240.0)
    if isinstance(run, int):
        return run
    args, deadline, copy_bw, gen = run.args, run.deadline, run.copy_bw, run.gen
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = {}
    for name, n, k in LLAMA3_8B_LINEARS:
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
        copies = int(-(-ROTATE_BYTES // (2 * n * k)))
        layers[name] = (n, k, [w] + [w.clone() for _ in range(copies - 1)])
    configs = [("config", c) for c in CONFIGS] if args.configs == "all" else []
    if not (args.blas and args.configs == "none"):
        configs.insert(0, ("pick", None))
    rows: list[dict] = []
    for m in args.m:
        for name, (n, k, ws) in layers.items():
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, ws[0])
            nbytes = 2 * n * k + 2 * m * k + 2 * m * n
            variants = [("bf16", None, lambda w, x=x: F.linear(x, w))]
            if args.blas:
                variants.append(("bf16_lt", None, lambda w, x=x: linear_lt(x, w)))
            for kind, cfg in configs:
                variants.append((kind, cfg, lambda w, x=x, out=out, cfg=cfg:
                                 ql.matmul_16bit(x, w, out, cfg)))  # fmt: skip
            for variant, cfg, fn in variants:
                if time.monotonic() > deadline:
                    break
                shown = cfg or (ql.pick_config_16bit(m, n, k, sms) if variant == "pick" else None)
                info = {} if shown is None else {
                    "block_n": shown.block_n, "block_k": shown.block_k, "split_k": shown.split_k,
                    "num_warps": shown.num_warps, "num_stages": shown.num_stages}  # fmt: skip
                row = {"op": name, "n": n, "k": k, "m": m, "variant": variant, **info}
                rows.append(time_row(row, info, fn, ws, ref, nbytes, copy_bw))
    layer = layer_sums(rows, args.m, list(layers), ("bf16", "bf16_lt", "pick", "config"))
    write_result(args, "bf16_stream_gemm", "bf16_stream_gemm.py", copy_bw_TBps=copy_bw,
                 rows=rows, layer=layer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
