"""Llama-3-8B's gate/up matmul and SwiGLU's activation at decode sizes, on one GPU: the fused
kernel (``*_silu_and_mul``) against the matmul then ``silu_and_mul`` (and the matmul alone),
bf16 and fp8, in CUDA graphs with the weights rotated through copies so they come from HBM.
Prints microseconds a call (median of REPEATS graphs of CALLS calls), the kinds interleaved.

    python scripts/gate_up_silu_bench.py [--m 8 32 64 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import pagedattn_kernels as pk

INTER, HIDDEN, COPIES, CALLS = 14336, 4096, 6, 24


def _chains(x16, xq, xs, w16, w8, d16, d8, tiny) -> dict:
    """gate/up, the activation and the down projection, as a decoder layer's MLP runs them
    (``nop``: a tiny PDL kernel between the fused kernel and the down projection)."""
    def fp8_down(a):
        return pk.fp8_matmul(a[0], a[1], *d8, fast_accum=True)

    return {
        "bf16 chain apart": lambda i: pk.matmul_16bit(
            pk.silu_and_mul(pk.matmul_16bit(x16, w16[i])), d16),
        "bf16 chain fused": lambda i: pk.matmul_16bit(pk.matmul_16bit_silu_and_mul(x16, w16[i]),
                                                      d16),
        "bf16 chain fused+nop": lambda i: pk.matmul_16bit(
            (pk.matmul_16bit_silu_and_mul(x16, w16[i]), pk.quantize_fp8_per_token(tiny))[0], d16),
        "fp8 chain apart": lambda i: fp8_down(pk.silu_and_mul_fp8(
            pk.fp8_matmul(xq, xs, *w8[i], fast_accum=True))),
        "fp8 chain fused": lambda i: fp8_down(pk.fp8_matmul_silu_and_mul(
            xq, xs, *w8[i], fp8_out=True, fast_accum=True)),
    }  # fmt: skip


def _graph_us(fn, repeats: int) -> float:
    for _ in range(2):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % COPIES)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def _kinds(x16, xq, xs, w16, w8) -> dict:
    """The calls timed, each taking the index of the weight copy to read."""
    return {
        "bf16 matmul": lambda i: pk.matmul_16bit(x16, w16[i]),
        "bf16 matmul + silu": lambda i: pk.silu_and_mul(pk.matmul_16bit(x16, w16[i])),
        "bf16 fused": lambda i: pk.matmul_16bit_silu_and_mul(x16, w16[i]),
        "fp8 matmul": lambda i: pk.fp8_matmul(xq, xs, *w8[i], fast_accum=True),
        "fp8 matmul + silu_fp8": lambda i: pk.silu_and_mul_fp8(
            pk.fp8_matmul(xq, xs, *w8[i], fast_accum=True)),
        "fp8 fused (fp8 out)": lambda i: pk.fp8_matmul_silu_and_mul(
            xq, xs, *w8[i], fp8_out=True, fast_accum=True),
        # without the quantization: the fused kernel's own cost against matmul + SiLU
        "fp8 matmul + silu": lambda i: pk.silu_and_mul(
            pk.fp8_matmul(xq, xs, *w8[i], fast_accum=True)),
        "fp8 fused (bf16 out)": lambda i: pk.fp8_matmul_silu_and_mul(
            xq, xs, *w8[i], fast_accum=True),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", action="store_true", help="with the down projection after")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w16 = [torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen).mul_(0.02).bfloat16()
           for _ in range(COPIES)]  # fmt: skip
    w8 = [(q, s.reshape(1, -1)) for q, s in (pk.quantize_fp8_per_token(w) for w in w16)]
    d16 = torch.randn(HIDDEN, INTER, device="cuda", generator=gen).mul_(0.01).bfloat16()
    dq, ds = pk.quantize_fp8_per_token(d16)
    tiny = torch.randn(1, 64, device="cuda", generator=gen)
    for m in args.m:
        x16 = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
        xq, xs = pk.quantize_fp8_per_token(x16)
        kinds = (_chains(x16, xq, xs, w16, w8, d16, (dq, ds.reshape(1, -1)), tiny)
                 if args.chain else _kinds(x16, xq, xs, w16, w8))
        results: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(2):  # interleaved
            for name, fn in kinds.items():
                results[name].append(_graph_us(fn, args.repeats))
        print(f"M={m}: " + ", ".join(f"{k} {min(v):.1f}/{max(v):.1f} us"
                                     for k, v in results.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
