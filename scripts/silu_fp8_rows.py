"""SiLU-and-multiply to fp8 rows at prefill sizes: the tiled pair against a program per row
and against whole rows in two passes through a scratch row.

In an fp8 prefill pass of 16,384 tokens (Llama-3-8B on an H200, 21de09d) SiLU-and-multiply and
its quantization took 12.7 + 8.2 ms of the pass's 211 ms of GPU time, where the bf16 model's
SiLU-and-multiply alone took 11.0: the tiled pair writes the products in bf16 (470 MB a layer)
and reads them back, 2.1 GB a layer against the 1.18 GB that a kernel holding each row would
move. That kernel (``silu_and_mul``'s ``tiled=False``: a program per row, 16 warps, the row in
registers) lost at 1,024 rows (50.9 against 37.4 us): 98 registers x 512 threads leave one
program per SM, whose load, reduction and store phases do not overlap. This script times, at
``--rows`` of Llama-3-8B's 14,336-wide rows, the tiled pair against the per-row kernel with
other warp counts and register caps (``maxnreg``: two programs per SM at 64), and checks that
every variant writes what the tiled pair writes. Bandwidth: the minimal bytes (the 16-bit gate
and up rows read, the e4m3 rows and scales written) over the copy bandwidth.

On an H200 (7231965, ``docs/performance/gpu_runs/2026-12-03c/``) the best per-row variant (32
warps) was 1-3% faster than the tiled pair, the others slower: the tiled pair stayed.

On an H200 (4453a04, ``docs/performance/gpu_runs/2026-12-04d/``) the two-pass kernel of
2,048 columns and eight warps, four programs an SM, took 473.5 us at 16,384 rows against the
tiled pair's 654.6, 120.4 against 163.8 at 4,096, 8.4 against 10.1 at 256: it became the
default from 256 rows.

``two_pass_*`` (``--two-pass``): ``silu_and_mul_fp8_rows_kernel``, a persistent grid of small
programs, each taking whole rows in steps of ``b`` columns: the products to its own scratch row
with their largest magnitude, then read back (from L2) and quantized; ``w`` warps, ``p``
programs an SM.

    python scripts/silu_fp8_rows.py [--two-pass] --output-json OUT.json     # on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch
import triton.testing

from pagedattn_kernels.common import kernels_for, next_power_of_2, round_mode, use_pdl
from pagedattn_kernels.fused import triton_launch as fused
from pagedattn_kernels.quant.torch_impl import MIN_SCALE

log = logging.getLogger("silu_fp8_rows")
INTER = 14336
FP8 = torch.float8_e4m3fn
# (warps, maxnreg) of the per-row kernel; (16, None) is the shipped one
PER_ROW = [(16, None), (16, 64), (16, 80), (32, None), (32, 32), (8, None), (8, 128)]
# (block, warps, programs per SM) of the two-pass kernel; the first is the shipped one. (The
# sweeps of 90d0ab0 and 4453a04 also tried two pipeline stages and L2 eviction hints: removed.)
TWO_PASS = [(2048, 8, 4), (2048, 8, 3), (2048, 4, 4), (2048, 4, 5), (1024, 8, 6), (1024, 8, 4),
            (1024, 4, 8), (2048, 16, 2), (2048, 16, 3), (4096, 16, 2), (512, 4, 12)]


def per_row(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, warps: int,
            maxnreg: int | None) -> None:  # fmt: skip
    """``silu_and_mul_kernel`` with a program per row (QUANT), ``warps`` warps, at most
    ``maxnreg`` registers a thread."""
    kernel = kernels_for(x.device, fused.KERNELS).silu_and_mul_kernel
    pdl = use_pdl(x.device)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    kernel[(x.shape[0], 1)](
        x, x, x.shape[0], x.stride(0), x.stride(0), q, scale, q.stride(0), MIN_SCALE, x, 1,
        INTER=INTER, BLOCK=next_power_of_2(INTER), ROWS=1, ROUND=round_mode(x.dtype, False),
        LIBDEVICE=True, QUANT=fused._quant_mode(kernel, x, (q, scale)), AMAX=False, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, enable_fp_fusion=False, **extra,
    )  # fmt: skip


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GB device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--two-pass", action="store_true",
                    help="the two-pass variants instead of the per-row ones")
    ap.add_argument("--output-json", default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bw = copy_bandwidth()
    log.info("copy bandwidth %.2f TB/s", bw / 1e12)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for m in args.rows:
        x = (torch.randn(m, 2 * INTER, generator=gen, device="cuda") * 2).to(torch.bfloat16)
        ref_q = torch.empty(m, INTER, dtype=FP8, device="cuda")
        ref_s = torch.empty(m, 1, dtype=torch.float32, device="cuda")
        nbytes = x.numel() * 2 + m * INTER + 4 * m
        variants = {"tiled": lambda q, s, x=x: fused.silu_and_mul(x, x, INTER, fp8_out=(q, s),
                                                                   method="tiled")}  # fmt: skip
        if args.two_pass:
            for b, w, p in TWO_PASS:
                variants[f"two_pass_b{b}_w{w}_p{p}"] = (
                    lambda q, s, x=x, b=b, w=w, p=p: fused._silu_and_mul_fp8_two_pass(
                        x, INTER, q, s, block=b, num_warps=w, per_sm=p))  # fmt: skip
        else:
            for warps, reg in PER_ROW:
                variants[f"per_row_w{warps}_r{reg}"] = lambda q, s, x=x, w=warps, r=reg: per_row(
                    x, q, s, w, r
                )
        variants["tiled"](ref_q, ref_s)
        for name, fn in variants.items():
            q = torch.empty_like(ref_q)
            s = torch.empty_like(ref_s)
            try:
                fn(q, s)
                torch.cuda.synchronize()
                same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
                            and torch.equal(s, ref_s))  # fmt: skip
                us = triton.testing.do_bench_cudagraph(lambda fn=fn, q=q, s=s: fn(q, s), rep=30,
                                                       return_mode="median") * 1e3  # fmt: skip
            except Exception as exc:  # a variant that does not compile or fit
                log.info("rows %6d %-22s error %s", m, name, repr(exc)[:200])
                rows_out.append({"rows": m, "variant": name, "error": repr(exc)[:300]})
                continue
            frac = nbytes / (us * 1e-6) / bw
            rows_out.append({"rows": m, "variant": name, "us": us, "bw_frac": frac, "same": same})
            log.info("rows %6d %-22s %9.1f us %5.1f%% of copy  same as tiled: %s", m, name, us,
                     100 * frac, same)  # fmt: skip
        del x
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"commit": args.commit, "copy_bw_TBps": bw / 1e12, "inter": INTER,
                       "rows": rows_out}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
