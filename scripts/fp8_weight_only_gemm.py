"""Can a weight-only fp8 GEMM make small-batch decode faster than bf16? A diagnosis.

With ``--quantization fp8`` the linear layers hold e4m3 weights with one float32 scale per
output channel, and ``fp8_linear`` quantizes the activations per token and calls
``torch._scaled_mm``. At the batch sizes of decode (1-64 rows) that is barely faster than bf16
``F.linear`` on an H200 (Llama-3-8B layer at M=16: 3.53 ms fp8 against 3.83 ms bf16 per
step) although it reads half the weight bytes: cuBLAS tiles M=16 as 128x128. vLLM answers with
a weight-only kernel (fp8 Marlin): bf16 activations, e4m3 weights widened in the kernel, the
per-channel scale applied in the epilogue. This script times a Triton kernel of that kind,

    y[M, N] = (x[M, K] @ Wq[N, K].T) * w_scale[N]    x bf16, Wq e4m3, fp32 accumulation, bf16 out

  dot   BLOCK_M = 16 (32, 64 for larger M; rows past M masked), the e4m3 tile widened to bf16
        in registers before ``tl.dot``; split-K (grid axis 2) when N / BLOCK_N tiles alone
        would leave SMs idle: each split writes fp32 partials [SPLIT_K, M, N] and a second
        small kernel sums them, applies the scale and casts to bf16. (Atomics would need a
        zeroed fp32 buffer and still a pass to scale and cast: three launches instead of two,
        and a summation order that changes from run to run. The automatic split keeps the
        partials under 1/8 of the weight bytes, and they stay in L2.)
  fma   M <= 4 only: no tensor cores, the widened tile multiplied and summed in fp32 (GEMV)

and two fp8 x fp8 variants on rows already quantized (as the fused norms and SiLU hand them to
three of the four linear layers):

  fp8_prequant  ``torch._scaled_mm`` alone on those rows, as ``fp8_linear`` calls it past
                ``FP8_MATMUL_MAX_ROWS`` (until 2b5b50b this row called ``fp8_linear``,
                which sends up to that many rows to ``fp8_matmul``: in the sweeps of
                f534e71 and 6d1d2a1 its rows of 16-64 are ``fp8_matmul``'s)
  swap_pick     ``pagedattn_kernels.fp8_matmul`` as the engine calls it: its own tiles per
                shape (``pick_config``) and fast accumulation
  swap_fp8      ``pagedattn_kernels.fp8_matmul``: the operands swapped, weight rows on the
                wgmma tile's 64/128-row side, the tokens on its N side, no conversion at all

next to bf16 ``F.linear`` and the engine's ``fp8_linear``, on Llama-3-8B's four linear shapes
(Q/K/V 6144x4096, O 4096x4096, gate/up 28672x4096, down 4096x14336) at M = 1..128, replayed
from CUDA graphs (``do_bench_cudagraph``, as ``pagedkv.bench.kernels._time_graph``). Each call
takes the next of several weight copies (> 256 MB together), so weights come from HBM as in a
decode step and not from the 50 MB L2. Per row: ``us``, ``bw_frac`` (weights + activations +
output bytes against the copy bandwidth; partials not counted), ``vs_bf16`` and
``rel_err_vs_bf16`` (against ``F.linear`` on the dequantized weights); per M the layer sum
(``wo_fp8``: the fastest config of each shape, a slightly optimistic pick).

    python scripts/fp8_weight_only_gemm.py --output-json OUT.json            # on a GPU
    TRITON_INTERPRET=1 python scripts/fp8_weight_only_gemm.py --check        # CPU: outputs only
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from variant_cli import start, write_result

import pagedattn_kernels
from pagedattn_kernels.quant import triton_launch as ql
from pagedattn_kernels.quant.triton_launch import Fp8MatmulConfig, auto_split
from pagedkv.engine.models import quantization
from pagedkv.engine.models.quantization import fp8_linear, quantize_weight

log = logging.getLogger("fp8_weight_only_gemm")

FP8 = torch.float8_e4m3fn
LLAMA3_8B_LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                     ("down", 4096, 14336)]  # fmt: skip
ROTATE_BYTES = 256e6  # weight copies per variant: several L2s' worth


@triton.jit
def wo_fp8_kernel(
    y_ptr, part_ptr, x_ptr, w_ptr, scale_ptr, M, N, K, k_chunk, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (M blocks, N blocks, splits): one [BLOCK_M, BLOCK_N] tile over K range
    [split * k_chunk, + k_chunk) (k_chunk a multiple of BLOCK_K). Rows past M and columns past
    N re-read valid ones (``% M``, ``% N``: no masks in the loop) and are not stored. SPLIT:
    write the raw fp32 sums to ``part [splits, M, N]`` (``splitk_reduce_kernel`` finishes),
    else scale and store bf16. UPCAST: the interpreter, whose dot cannot multiply bf16 (numpy
    has none): the operands go to float32, which holds their values exactly."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [K, N] view
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k)
            w = tl.load(w_ptrs + k)
        else:
            x = tl.load(x_ptrs + k, mask=(k + rk < K)[None, :], other=0.0)
            w = tl.load(w_ptrs + k, mask=(k + rk < K)[:, None], other=0.0)
        if not USE_DOT:  # e4m3 -> fp32 (exact), products and sums on the CUDA cores
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        elif UPCAST:
            w = w.to(tl.bfloat16).to(tl.float32)
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(tl.bfloat16), acc)  # e4m3 -> bf16 is exact
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        acc = acc * tl.load(scale_ptr + rn % N)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def splitk_reduce_kernel(y_ptr, part_ptr, scale_ptr, numel, N, splits, BLOCK: tl.constexpr):
    """y = bf16(sum over splits of part[s] * scale[n]), y and each part[s] [M, N] flat."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    acc = acc * tl.load(scale_ptr + offs % N, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(tl.bfloat16), mask=mask)


class Config(NamedTuple):
    kind: str  # "dot" or "fma"
    block_n: int
    block_k: int
    split_k: int  # 0: auto_split
    warps: int
    stages: int


# Timed on the GPU: BLOCK_K 128-256 keeps 16-32 KB of weights per stage in flight; split 1 is
# the no-split-K baseline; fma only where M <= 4.
CONFIGS = [Config("dot", 64, 128, 0, 4, 4), Config("dot", 128, 128, 0, 4, 4),
           Config("dot", 64, 256, 0, 4, 3), Config("dot", 128, 128, 0, 8, 3),
           Config("dot", 64, 128, 1, 4, 4), Config("fma", 32, 64, 0, 4, 3),
           Config("fma", 64, 64, 0, 4, 3)]  # fmt: skip
# pagedattn_kernels.fp8_matmul (fp8 x fp8, operands swapped): 64 or 128 weight rows per
# wgmma tile, 128-256 bytes of K per stage; sm_90 offline compiles (Triton 3.6): all QGMMA,
# 70-153 instructions per loop step, 38-154 registers, 40-144 KB of shared memory
C = Fp8MatmulConfig
SWAP_CONFIGS = [C(128, 128, 0, 4, 4), C(64, 128, 0, 4, 4), C(128, 256, 0, 4, 3),
                C(64, 256, 0, 4, 4), C(128, 128, 0, 8, 4), C(128, 128, 1, 4, 4),
                # the default with its split-K merged by a second kernel, not by the last split
                C(128, 128, 0, 4, 4, merge_here=False),
                # fast accumulation (no promotion to float32 per K block), as _scaled_mm's
                # default in the engine; deeper pipelines; fixed splits; more, smaller programs
                C(128, 128, 0, 4, 4, promote=False), C(128, 128, 0, 4, 6, promote=False),
                C(128, 256, 0, 4, 4, promote=False), C(64, 128, 0, 4, 6, promote=False),
                C(64, 256, 0, 4, 4, promote=False), C(128, 128, 0, 4, 6),
                C(128, 128, 2, 4, 6, promote=False), C(128, 128, 4, 4, 6, promote=False),
                C(64, 128, 1, 4, 8, promote=False), C(128, 128, 0, 8, 6, promote=False),
                C(128, 256, 0, 8, 4, promote=False)]  # fmt: skip
# --swap-set refine: around the winners of the broad set (f534e71), fast accumulation only
SWAP_REFINE = [C(64, 128, 1, 4, s, promote=False) for s in (6, 8, 10, 12)] + [
    C(64, 128, 2, 4, 8, promote=False), C(64, 256, 1, 4, 4, promote=False),
    C(64, 256, 1, 4, 6, promote=False), C(64, 256, 0, 4, 6, promote=False),
    C(64, 256, 2, 4, 4, promote=False), C(64, 256, 4, 4, 4, promote=False),
    C(64, 256, 0, 4, 4, merge_here=False, promote=False),
    C(128, 128, 1, 4, 3, promote=False), C(128, 128, 1, 4, 4, promote=False),
    C(128, 128, 1, 4, 6, promote=False), C(128, 256, 1, 4, 3, promote=False),
    C(128, 128, 1, 8, 4, promote=False)]  # fmt: skip
# --swap-set pick: the refine set's winners at 16-32 rows (6d1d2a1: one 64 x 256 config, no
# split, 6 stages, for Q/K/V, O and down) against pick_config's, with neighbours, at 1-64 rows
SWAP_PICK = [C(64, 256, 1, 4, s, promote=False) for s in (4, 6, 8)] + [
    C(64, 128, 1, 4, 8, promote=False), C(64, 128, 1, 4, 12, promote=False),
    C(64, 256, 0, 4, 4, promote=False), C(64, 256, 2, 4, 6, promote=False),
    C(128, 128, 1, 4, 3, promote=False), C(128, 128, 1, 4, 4, promote=False)]  # fmt: skip
# --swap-set narrow: 32 weight rows a tile (mma.sync, as wgmma's tiles are 64 rows at least),
# so that Q/K/V (6,144 rows), O and down (4,096) make 192 / 128 programs for the 132 SMs of an
# H200 instead of 96 / 64 (ncu at 16 rows, gpu_runs/2026-12-03b: 53% / 42% / 63% of the DRAM
# bandwidth for them, 75% for gate/up's 448 programs); against the pick's 64-row tiles
SWAP_NARROW = [C(32, 256, 1, 4, s, promote=False) for s in (4, 6, 8)] + [
    C(32, 128, 1, 4, 8, promote=False), C(32, 256, 1, 2, 6, promote=False),
    C(32, 512, 1, 4, 4, promote=False), C(64, 256, 1, 4, 6, promote=False),
    C(64, 256, 1, 4, 8, promote=False)]  # fmt: skip
SWAP_SETS = {"broad": SWAP_CONFIGS, "refine": SWAP_REFINE, "pick": SWAP_PICK,
             "narrow": SWAP_NARROW}  # fmt: skip
# swap_m256 (M of 129-256 only): all the tokens in one 256-wide tile, so each program reads
# its weight tile once, with pipelines shallow enough for the shared memory (sm_90 offline
# compiles, Triton 3.6: 119-197 registers, no spills, 160-192 KB); 8 warps, fast accumulation
SWAP_M256 = {"qkv": C(64, 128, 1, 8, 4, promote=False), "o": C(64, 128, 1, 8, 4, promote=False),
             "gate_up": C(128, 128, 1, 8, 4, promote=False),
             "down": C(64, 128, 0, 8, 4, promote=False)}  # fmt: skip


def block_m_for(m: int, kind: str) -> int:
    if kind == "fma":
        assert m <= 4, "the fma variant is for M <= 4"
        return triton.next_power_of_2(m)
    return min(64, max(16, triton.next_power_of_2(m)))  # tl.dot needs >= 16


def make_wo(x: torch.Tensor, scale: torch.Tensor, n: int, cfg: Config, sms: int):
    """(launch, split): ``launch(wq)`` computes ``(x @ wq.T) * scale`` into one bf16 buffer.
    Requirements: x [M, K] bf16 and wq [N, K] e4m3 with unit stride along K, scale float32
    with N elements ([N] or quantize_weight's [1, N]); any M, N, K (masked)."""
    m, k = x.shape
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1, "x: [M, K] bf16, rows contiguous"
    scale = scale.reshape(-1).contiguous()
    assert scale.dtype == torch.float32 and scale.numel() == n, "w_scale: N float32"
    bm = block_m_for(m, cfg.kind)
    grid_mn = (triton.cdiv(m, bm), triton.cdiv(n, cfg.block_n))
    k_iters = triton.cdiv(k, cfg.block_k)
    # fp32 partials (split * M * N * 4 bytes) at most 1/8 of the e4m3 weights (N * K)
    split = cfg.split_k or auto_split(grid_mn[0] * grid_mn[1], k_iters, sms, k // (32 * m))
    k_chunk = triton.cdiv(k_iters, split) * cfg.block_k
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    upcast = x.device.type == "cpu"

    def launch(wq: torch.Tensor) -> torch.Tensor:
        assert wq.dtype == FP8 and wq.shape == (n, k) and wq.stride(1) == 1, "wq: [N, K] e4m3"
        wo_fp8_kernel[(*grid_mn, split)](
            y, part, x, wq, scale, m, n, k, k_chunk, x.stride(0), wq.stride(0),
            BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
            EVEN_K=k % cfg.block_k == 0, USE_DOT=cfg.kind == "dot", UPCAST=upcast,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        if split > 1:
            splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](y, part, scale, m * n, n, split,
                                                              BLOCK=1024)  # fmt: skip
        return y

    return launch, split


def make_swap(xq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, n: int,
              cfg: Fp8MatmulConfig, max_block_m: int | None = None):  # fmt: skip
    """``launch(wq)``: ``pagedattn_kernels.fp8_matmul`` with these tiles into one bf16
    buffer; ``max_block_m``: the launcher's most tokens a tile for this call
    (``triton_launch.MAX_BLOCK_M``, read at each call)."""
    y = torch.empty(xq.shape[0], n, dtype=torch.bfloat16, device=xq.device)

    def launch(wq: torch.Tensor) -> torch.Tensor:
        if max_block_m is None:
            return pagedattn_kernels.fp8_matmul(xq, x_scale, wq, w_scale, out=y, config=cfg)
        shipped, ql.MAX_BLOCK_M = ql.MAX_BLOCK_M, max_block_m
        try:
            return pagedattn_kernels.fp8_matmul(xq, x_scale, wq, w_scale, out=y, config=cfg)
        finally:
            ql.MAX_BLOCK_M = shipped

    return launch


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
              w_scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``torch._scaled_mm`` on quantized rows, as ``fp8_linear`` calls it for many rows."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale.reshape(-1, 1), scale_b=w_scale,
                            out_dtype=torch.bfloat16,
                            use_fast_accum=quantization.FP8_FAST_ACCUM)  # fmt: skip


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# (M, N, K, config): M = 1, non-multiples of 16 and > 16; N and K off the tiles; an uneven and
# an empty split (K=200: 4 steps of 64 in splits of 2, 2, 0)
CHECK_CASES = [(1, 96, 256, Config("dot", 32, 64, 0, 4, 1)),
               (3, 80, 200, Config("dot", 32, 64, 3, 4, 1)),
               (16, 96, 256, Config("dot", 64, 64, 1, 4, 1)),
               (21, 64, 192, Config("dot", 32, 64, 2, 4, 1)),
               (40, 48, 136, Config("dot", 16, 32, 4, 4, 1)),
               (1, 80, 200, Config("fma", 32, 64, 2, 4, 1)),
               (4, 96, 256, Config("fma", 32, 64, 0, 4, 1))]  # fmt: skip


def check() -> int:
    """Each case against float64 with an elementwise bound: |y - ref| <= u |ref| + (1 + u) e,
    u the bf16 rounding of the output (8 significant bits: 2^-8 rounding to nearest on the GPU;
    2^-7 under the interpreter, which truncates float32 to bf16) and e the fp32 accumulation's
    (K + 2) * 2^-24 * (|x| @ |W|.T) (products exact, K sums in any order, then the scale)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    u = 2.0**-8 if dev == "cuda" else 2.0**-7
    gen = torch.Generator(device=dev).manual_seed(0)
    bad = 0
    for m, n, k, cfg in CHECK_CASES:
        w = torch.randn(n, k, generator=gen, device=dev) * k**-0.5
        w[::7] *= 30.0  # channels of different scales
        wq, ws = quantize_weight(w.to(torch.bfloat16))
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
        launch, split = make_wo(x, ws, n, cfg, sms=132)
        y = launch(wq).double()
        wd = wq.double() * ws.reshape(-1, 1).double()
        ref = x.double() @ wd.T
        acc_bound = (k + 2) * 2.0**-24 * (x.double().abs() @ wd.abs().T)
        bound = u * ref.abs() + (1 + u) * acc_bound
        worst = float(((y - ref).abs() / bound).max())
        bad += not worst <= 1.0
        log.info("%s M=%-3d N=%-3d K=%-3d BN=%-3d BK=%-3d split=%d: rel err %.1e, worst "
                 "|err|/bound %.2f %s", cfg.kind, m, n, k, cfg.block_n, cfg.block_k, split,
                 rel_err(y, ref), worst, "ok" if worst <= 1.0 else "WRONG")  # fmt: skip
    # swap_fp8 (pagedattn_kernels.fp8_matmul, tested in tests/kernels/test_fp8_matmul.py) on
    # the same bound over its quantized operands, with small tiles and forced splits
    # (and 150 rows in one 256-wide tile of tokens, as swap_m256 takes them)
    for m, n, k, split in ((1, 96, 256, 1), (21, 64, 192, 3), (70, 48, 136, 2),
                           (150, 40, 96, 2)):  # fmt: skip
        cfg = Fp8MatmulConfig(32, 64, split, 4, 1 if dev == "cpu" else 4)
        wq, ws = quantize_weight((torch.randn(n, k, generator=gen, device=dev) * 0.1)
                                 .to(torch.bfloat16))  # fmt: skip
        xq, xs = pagedattn_kernels.quantize_fp8_per_token(
            torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16))
        y = make_swap(xq, xs, ws, n, cfg, 256 if m > 128 else None)(wq).double()
        xd, wd = xq.double() * xs.double(), wq.double() * ws.reshape(-1, 1).double()
        ref = xd @ wd.T
        bound = u * ref.abs() + (1 + u) * (k + 3) * 2.0**-24 * (xd.abs() @ wd.abs().T)
        worst = float(((y - ref).abs() / bound).max())
        bad += not worst <= 1.0
        log.info("swap M=%-3d N=%-3d K=%-3d split=%d: rel err %.1e, worst |err|/bound %.2f %s",
                 m, n, k, split, rel_err(y, ref), worst, "ok" if worst <= 1.0 else "WRONG")  # fmt: skip
    return bad


def bench(fn) -> float:
    """Median microseconds per call replayed from a CUDA graph. (do_bench_cudagraph runs fn
    on a stream of its own that does not wait for the default stream: inputs first.)"""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def time_row(row: dict, info: dict | None, fn, weights: list[torch.Tensor], ref: torch.Tensor,
             nbytes: int, copy_bw: float) -> dict:  # fmt: skip
    """``row`` with the variant ``fn`` timed over the rotated ``weights``: ``us``, ``bw_frac``
    (``nbytes`` against the copy bandwidth) and ``rel_err_vs_bf16`` (against ``ref``); or with
    ``error`` when it does not compile or fit. Logged either way, with its tiles (``info``)."""
    tiles = "" if not info else str(tuple(info.values()))
    try:
        err = rel_err(fn(weights[0]), ref)
        us = bench(rotating(fn, weights))
    except Exception as exc:  # a tile shape that does not compile or fit
        log.info("%s M=%d %s %s: error %s", row["op"], row["m"], row["variant"], tiles,
                 repr(exc)[:200])  # fmt: skip
        return {**row, "error": repr(exc)[:300]}
    row.update(us=us, bw_frac=nbytes / us / 1e6 / copy_bw, rel_err_vs_bf16=err)
    log.info("%-8s M=%-4d %-12s %-52s %8.1f us %5.1f%% of copy  err %.1e", row["op"], row["m"],
             row["variant"], tiles, us, 100 * row["bw_frac"], err)  # fmt: skip
    return row


def layer_sums(rows: list[dict], ms: list[int], ops: list[str],
               variants: tuple[str, ...]) -> list[dict]:  # fmt: skip
    """Per M, the layer's time for each variant: the sum over ``ops`` of each one's fastest
    row (``{variant}_us``), and ``{variant}_vs_bf16`` against the first variant, "bf16".
    Also sets each timed row's ``vs_bf16`` (against the fastest bf16 row of its M and op)."""
    best: dict[tuple, dict] = {}  # (m, op, variant) -> fastest row
    for r in rows:
        key = (r["m"], r["op"], r["variant"])
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for r in rows:
        if "us" in r and (r["m"], r["op"], "bf16") in best:
            r["vs_bf16"] = best[(r["m"], r["op"], "bf16")]["us"] / r["us"]
    layer = []
    for m in ms:
        total: dict = {"m": m}
        for variant in variants:
            found = [best.get((m, op, variant)) for op in ops]
            if all(found):
                total[f"{variant}_us"] = sum(r["us"] for r in found)
        for variant in variants[1:]:
            if "bf16_us" in total and f"{variant}_us" in total:
                total[f"{variant}_vs_bf16"] = total["bf16_us"] / total[f"{variant}_us"]
        layer.append(total)
        log.info("layer M=%-4d %s", m, {key: round(v, 3) for key, v in total.items()})
    return layer


def rotating(fn, weights: list[torch.Tensor]):
    """A callable running ``fn`` on the next weight copy (captured into the graph as such)."""
    it = itertools.cycle(weights)
    return lambda: fn(next(it))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--swap-set", choices=tuple(SWAP_SETS), default="broad",
                    help="the swap_fp8 configs: SWAP_CONFIGS, SWAP_REFINE, SWAP_PICK or "
                    "SWAP_NARROW")
    ap.add_argument("--only", default="", help="comma-separated variants to time (default: "
                    "all of bf16, fp8_linear, fp8_prequant, swap_pick, swap_m256 past 128 rows, "
                    "swap_fp8, wo_fp8)")
    run = start(ap, check, budget_s=150.0)
    if isinstance(run, int):
        return run
    args, deadline, copy_bw, gen = run.args, run.deadline, run.copy_bw, run.gen
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = {}
    for name, n, k in LLAMA3_8B_LINEARS:
        wq, ws = quantize_weight((torch.randn(n, k, generator=gen, device="cuda") * k**-0.5)
                                 .to(torch.bfloat16))  # fmt: skip
        wd = (wq.float() * ws.reshape(-1, 1)).to(torch.bfloat16)  # what bf16 F.linear reads
        copies = [int(-(-ROTATE_BYTES // (n * k * s))) for s in (2, 1)]
        layers[name] = (n, k, ws, [wd] + [wd.clone() for _ in range(copies[0] - 1)],
                        [wq] + [wq.clone() for _ in range(copies[1] - 1)])  # fmt: skip
    rows: list[dict] = []
    for m in args.m:
        for name, (n, k, ws, wds, wqs) in layers.items():
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = F.linear(x, wds[0])
            act_bytes = 2 * m * k + 2 * m * n
            variants = [("bf16", None, lambda w, x=x: F.linear(x, w), wds, 2 * n * k),
                        ("fp8_linear", None, lambda w, x=x, ws=ws: fp8_linear(x, w, ws), wqs,
                         n * k + 4 * n)]  # fmt: skip
            # The tokens already quantized, as the fused norms and SiLU hand them to three of
            # the four linear layers: _scaled_mm alone, and the swapped fp8 kernel.
            xq, xs = pagedattn_kernels.quantize_fp8_per_token(x)
            variants.append(("fp8_prequant", None,
                             lambda w, xq=xq, xs=xs, ws=ws: scaled_mm(xq, xs, w, ws), wqs,
                             n * k + 4 * n))  # fmt: skip
            # the engine's path: fp8_matmul's own per-shape pick, fast accumulation
            variants.append(("swap_pick", None,
                             lambda w, xq=xq, xs=xs, ws=ws: pagedattn_kernels.fp8_matmul(
                                 xq, xs, w, ws, fast_accum=True), wqs, n * k + 4 * n))
            if m > 128:
                variants.append(("swap_m256", None, make_swap(xq, xs, ws, n, SWAP_M256[name],
                                                              256), wqs, n * k + 4 * n))
            for cfg in SWAP_SETS[args.swap_set]:
                info = {"kind": "swap", "block_n": cfg.block_n, "block_k": cfg.block_k,
                        "split_k": cfg.split_k, "num_warps": cfg.num_warps,
                        "num_stages": cfg.num_stages, "merge_here": cfg.merge_here,
                        "promote": cfg.promote}  # fmt: skip
                variants.append(("swap_fp8", info, make_swap(xq, xs, ws, n, cfg), wqs,
                                 n * k + 4 * n))  # fmt: skip
            for cfg in CONFIGS:
                if cfg.kind == "fma" and m > 4:
                    continue
                launch, split = make_wo(x, ws, n, cfg, sms)
                info = {"kind": cfg.kind, "block_m": block_m_for(m, cfg.kind),
                        "block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": split,
                        "num_warps": cfg.warps, "num_stages": cfg.stages}  # fmt: skip
                variants.append(("wo_fp8", info, launch, wqs, n * k + 4 * n))
            only = set(filter(None, args.only.split(",")))
            for variant, info, fn, weights, w_bytes in variants:
                if only and variant not in only:
                    continue
                if time.monotonic() > deadline:
                    break
                row = {"op": name, "n": n, "k": k, "m": m, "variant": variant, **(info or {})}
                rows.append(time_row(row, info, fn, weights, ref, w_bytes + act_bytes, copy_bw))
    layer = layer_sums(rows, args.m, list(layers), ("bf16", "fp8_linear", "fp8_prequant",
                                                    "swap_pick", "swap_m256", "swap_fp8", "wo_fp8"))
    # swap_fp8 per config: the layer's sum with one config for all four shapes, fastest
    # first per M
    swap_layer = []
    for m in args.m:
        sums: dict[tuple, list[float]] = {}
        for r in rows:
            if r["m"] == m and r["variant"] == "swap_fp8" and "us" in r:
                key = tuple(r[f] for f in ("block_n", "block_k", "split_k", "num_warps",
                                           "num_stages", "merge_here", "promote"))  # fmt: skip
                sums.setdefault(key, []).append(r["us"])
        bf16_us = next((t["bf16_us"] for t in layer if t["m"] == m and "bf16_us" in t), None)
        for key, us in sorted(sums.items(), key=lambda kv: sum(kv[1])):
            if len(us) == len(layers):
                row = {"m": m, "config": key, "us": sum(us)}
                if bf16_us:
                    row["vs_bf16"] = bf16_us / sum(us)
                swap_layer.append(row)
                log.info("swap layer M=%-4d %-40s %7.1f us %s", m, key, sum(us),
                         f"{bf16_us / sum(us):.2f}x bf16" if bf16_us else "")
    write_result(args, "fp8_weight_only_gemm", "fp8_weight_only_gemm.py", copy_bw_TBps=copy_bw,
                 sms=sms, rows=rows, layer=layer, swap_layer=swap_layer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
