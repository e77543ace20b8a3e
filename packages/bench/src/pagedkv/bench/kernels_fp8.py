"""The fp8 rows of the kernel benchmark (``python -m pagedkv.bench.kernels --fp8``).

- ``decode_fp8``: paged decode attention reading an fp8 e4m3 KV cache (``--kv-cache-dtype
  fp8``): achieved bandwidth counted in the bytes it reads (one per K/V element), its fraction
  of the copy bandwidth, and its speed against the same kernel on the 16-bit cache holding the
  same values (``vs_16bit``, events and CUDA-graph replay, which is how the engine decodes);
  ``rel_err_vs_16bit``: its output against the 16-bit kernel's on those values (the kernels
  dequantize exactly, so only rounding differs).
- ``prefill_fp8``: the prefill kernel on an fp8 cache, TFLOP/s against the 16-bit kernel and
  against SDPA (the SDPA time of the same run's ``prefill`` row).
- ``gemm``: the linear layers of one Llama-3-8B decoder layer (Q/K/V 6144x4096, output
  4096x4096, gate/up 28672x4096, down 4096x14336) at M tokens (a decode step of M sequences):
  ``F.linear`` in the model dtype against the engine's fp8 path (``fp8_linear``: per-token
  activation quantization, then ``torch._scaled_mm`` with per-channel weight scales on Hopper),
  and the scaled matmul alone (also with ``use_fast_accum``: ``gemm_fast_accum_us``); ``gemm_layer``
  sums each M's four. The issue's goal is the layer
  sum at M = 512 (``gemm_fp8_vs_16bit_m512`` >= 1.6).
- ``gemm_layer_fused``: the four linear layers as a decode step runs them, with the kernels
  that make their inputs: fused add + RMSNorm before Q/K/V and gate/up, SiLU-and-multiply
  before down, in one CUDA graph per M. 16-bit, fp8 with ``fp8_linear`` quantizing each input
  (``graph_us_unfused``), and fp8 with the norms and the activation quantizing their own
  outputs (``graph_us``: ``rms_norm_fp8``..., what the engine runs); ``graph_vs_16bit`` is
  the fused one (``gemm_fp8_fused_graph_vs_16bit_m512``).
- ``quant``: per-token quantization at 4,096 and 14,336 columns, a program per row against
  tiled, and SiLU-and-multiply quantizing its output both ways (``bench_quant``).
On the CPU (``--quick``) the same code runs tiny shapes through the torch paths (the fp8
matmul there is the dequantizing fallback): a smoke run, not a measurement.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import pagedattn_kernels as pk
from pagedkv.bench.kernels import (
    Setup,
    _fits,
    _paged,
    _time,
    _time_graph,
    rel_error,
    time_tile,
)

FP8 = torch.float8_e4m3fn
#: (name, out_features, in_features) of Llama-3-8B's linear layers (the fused ones as the engine
#: runs them).
LLAMA3_8B_LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                     ("down", 4096, 14336)]  # fmt: skip
QUICK_LINEARS = [("qkv", 384, 256), ("o", 256, 256), ("gate_up", 1024, 256), ("down", 256, 512)]
GEMM_TOKENS = [64, 256, 512, 1024]
FP8_CONTEXTS = [512, 2048, 4096, 8192, 32768]


def _unit(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def bench_decode_fp8(setup: Setup, copy_bw: float, gen: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    contexts = setup.contexts if setup.quick else FP8_CONTEXTS
    for batch in setup.batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * setup.kv_heads * setup.head_dim  # one byte each
            # the fp8 cache, the 16-bit one (twice its bytes) and a 16-bit conversion scratch
            if not _fits(setup, 4 * kv_bytes):
                rows.append({"batch": batch, "context": context, "skipped": "memory"})
                continue
            row = decode_fp8_row(setup, batch, context, kv_bytes, copy_bw, gen)
            rows.append(row)
            graph = ""
            if "graph_us" in row:
                graph = (f" | graph {row['graph_us']:8.1f} us {100 * row['graph_bw_frac']:5.1f}%"
                         f" x{row.get('graph_vs_16bit', float('nan')):.2f}")
            print(f"decode fp8 B={batch:<4d} ctx={context:<6d} {row['us']:9.1f} us "
                  f"{100 * row['bw_frac']:5.1f}% of copy  16-bit {row['us_16bit']:9.1f} us "
                  f"x{row['vs_16bit']:.2f} err {row['rel_err_vs_16bit']:.1e}{graph}", flush=True)
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def decode_fp8_row(setup: Setup, batch: int, context: int, kv_bytes: int, copy_bw: float,
                   gen: torch.Generator) -> dict[str, Any]:  # fmt: skip
    kc16, vc16, tables = _paged(setup, batch, context, gen)
    kc8, vc8 = kc16.to(FP8), vc16.to(FP8)
    # The 16-bit cache holds exactly the fp8 values: both kernels attend over the same numbers.
    kc16.copy_(kc8.to(setup.dtype))
    vc16.copy_(vc8.to(setup.dtype))
    scale = _unit(setup.device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
    q = q.to(setup.dtype)
    out8, out16 = torch.empty_like(q), torch.empty_like(q)

    def fp8() -> torch.Tensor:
        return pk.paged_decode_attention(q, kc8, vc8, tables, lens, max_seq_len=context,
                                         out=out8, k_scale=scale, v_scale=scale)  # fmt: skip

    def b16() -> torch.Tensor:
        return pk.paged_decode_attention(q, kc16, vc16, tables, lens, max_seq_len=context,
                                         out=out16)  # fmt: skip

    fp8()
    b16()
    err = rel_error(out8, out16.double())
    seconds, seconds16 = _time(fp8, setup.device), _time(b16, setup.device)
    row: dict[str, Any] = {
        "batch": batch, "context": context, "us": seconds * 1e6,
        "GBps": kv_bytes / seconds / 1e9, "bw_frac": kv_bytes / seconds / copy_bw,
        "us_16bit": seconds16 * 1e6, "vs_16bit": seconds16 / seconds, "rel_err_vs_16bit": err,
    }  # fmt: skip
    graph_s = _time_graph(fp8, setup.device)
    if graph_s is not None:
        row.update(graph_us=graph_s * 1e6, graph_bw_frac=kv_bytes / graph_s / copy_bw)
        graph16 = _time_graph(b16, setup.device)
        if graph16 is not None:
            row.update(graph_us_16bit=graph16 * 1e6, graph_vs_16bit=graph16 / graph_s)
    return row


def sweep_decode_fp8(setup: Setup, copy_bw: float, gen: torch.Generator,
                     deadline: float) -> list[dict]:  # fmt: skip
    """Tile shapes of the decode kernel on an fp8 cache at 64 sequences x 4k and 16 x 8k (the
    automatic split count): how ``decode_config``'s fp8 choice was (and is to be) made."""
    import time

    from pagedkv.bench.kernels import _tuning

    to = _tuning()
    configs = [to.decode_config(setup.head_dim, setup.dtype, kv_dtype=FP8),
               to.DecodeConfig(128, 4, 2), to.DecodeConfig(256, 4, 2), to.DecodeConfig(256, 8, 3),
               to.DecodeConfig(64, 4, 4), to.DecodeConfig(128, 4, 3, early_v=True),
               to.DecodeConfig(64, 4, 4, early_v=True), to.DecodeConfig(64, 2, 3),
               # bfloat16 products (the kernel before float16 ones became the default)
               to.DecodeConfig(128, 4, 3, f16_products=False),
               # tiles loaded as int32 words (no byte-wise shared-memory reads)
               to.DecodeConfig(128, 4, 3, packed_loads=True),
               to.DecodeConfig(128, 4, 2, packed_loads=True),
               to.DecodeConfig(64, 4, 2, per_sm=3, packed_loads=True),
               to.DecodeConfig(64, 4, 3, packed_loads=True),
               to.DecodeConfig(64, 2, 2, packed_loads=True)]  # fmt: skip
    rows: list[dict] = []
    scale = _unit(setup.device)
    for batch, context in ((64, 4096), (16, 8192)):
        kc, vc, tables = _paged(setup, batch, context, gen)
        kc, vc = kc.to(FP8), vc.to(FP8)
        lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
        q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
        q = q.to(setup.dtype)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * context * setup.kv_heads * setup.head_dim
        for cfg in configs:
            if time.monotonic() > deadline:
                return rows

            def run(cfg=cfg, kc=kc, vc=vc, tables=tables, lens=lens, q=q, out=out,
                    context=context) -> torch.Tensor:  # fmt: skip
                return to.paged_decode_attention(q, kc, vc, tables, lens, setup.head_dim**-0.5,
                                                 context, out, config=cfg, k_scale=scale,
                                                 v_scale=scale)  # fmt: skip

            row: dict[str, Any] = {"batch": batch, "context": context,
                                   "config": {"tile_n": cfg.tile_n, "num_warps": cfg.num_warps,
                                              "num_stages": cfg.num_stages,
                                              "early_v": cfg.early_v,
                                              "f16_products": cfg.f16_products,
                                              "packed_loads": cfg.packed_loads}}  # fmt: skip
            rows.append(row)
            if not time_tile(run, setup.device, row, kv_bytes, copy_bw):
                continue
            print(f"sweep decode fp8 B={batch} ctx={context} {row['config']}: "
                  f"{row['us']:.1f} us {100 * row['bw_frac']:.1f}% of copy"
                  + (f" | graph {100 * row['graph_bw_frac']:.1f}%" if "graph_us" in row else ""),
                  flush=True)  # fmt: skip
        del kc, vc
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_prefill_fp8(setup: Setup, gen: torch.Generator, prefill: list[dict]) -> list[dict]:
    """``prefill``: the same run's 16-bit prefill rows (their SDPA time is the baseline)."""
    sdpa_us = {r["tokens"]: r.get("sdpa_us") for r in prefill}
    rows = []
    for tokens in setup.prefill_tokens:
        kc16, vc16, tables = _paged(setup, 1, tokens, gen)
        kc8, vc8 = kc16.to(FP8), vc16.to(FP8)
        kc16.copy_(kc8.to(setup.dtype))
        vc16.copy_(vc8.to(setup.dtype))
        q = torch.randn(tokens, setup.heads, setup.head_dim, generator=gen, device=setup.device)
        q = q.to(setup.dtype)
        lens = torch.tensor([tokens], dtype=torch.int32, device=setup.device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=setup.device)
        out8, out16 = torch.empty_like(q), torch.empty_like(q)
        scale = _unit(setup.device)

        def fp8(kc8=kc8, vc8=vc8, tables=tables, q=q, lens=lens, cu=cu, out8=out8, scale=scale,
                tokens=tokens) -> torch.Tensor:  # fmt: skip
            return pk.paged_attention(q, kc8, vc8, tables, lens, cu, max_query_len=tokens,
                                      max_seq_len=tokens, out=out8, k_scale=scale,
                                      v_scale=scale)  # fmt: skip

        def b16(kc16=kc16, vc16=vc16, tables=tables, q=q, lens=lens, cu=cu, out16=out16,
                tokens=tokens) -> torch.Tensor:  # fmt: skip
            return pk.paged_attention(q, kc16, vc16, tables, lens, cu, max_query_len=tokens,
                                      max_seq_len=tokens, out=out16)  # fmt: skip

        fp8()
        b16()
        err = rel_error(out8, out16.double())
        seconds, seconds16 = _time(fp8, setup.device), _time(b16, setup.device)
        flops = 4 * setup.heads * setup.head_dim * tokens * tokens / 2
        row: dict[str, Any] = {
            "tokens": tokens, "us": seconds * 1e6, "tflops": flops / seconds / 1e12,
            "us_16bit": seconds16 * 1e6, "vs_16bit": seconds16 / seconds,
            "rel_err_vs_16bit": err,
        }  # fmt: skip
        if sdpa_us.get(tokens):
            row["vs_sdpa"] = sdpa_us[tokens] / 1e6 / seconds
        rows.append(row)
        print(f"prefill fp8 N={tokens:<6d} {row['us']:10.1f} us {row['tflops']:7.1f} TFLOP/s  "
              f"16-bit x{row['vs_16bit']:.2f}"
              + (f"  SDPA x{row['vs_sdpa']:.2f}" if "vs_sdpa" in row else "")
              + f"  err {err:.1e}", flush=True)  # fmt: skip
        del kc16, vc16, kc8, vc8
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_gemm(setup: Setup, gen: torch.Generator) -> tuple[list[dict], list[dict]]:
    """Per (M, linear layer) rows, and per M the sum over the layer's four."""
    from pagedkv.engine.models.quantization import fp8_linear, quantize_weight, uses_scaled_mm

    dev, dtype = setup.device, setup.dtype
    shapes = QUICK_LINEARS if setup.quick else LLAMA3_8B_LINEARS
    tokens_list = [16, 64] if setup.quick else GEMM_TOKENS
    rows: list[dict] = []
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(dtype)
        wq, ws = quantize_weight(w)
        for m in tokens_list:
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            xq, xs = pk.quantize_fp8_per_token(x)
            scaled_mm = uses_scaled_mm(x, wq)

            def b16(x=x, w=w) -> torch.Tensor:
                return F.linear(x, w)

            def fp8(x=x, wq=wq, ws=ws) -> torch.Tensor:
                return fp8_linear(x, wq, ws)

            def quant(x=x) -> Any:
                return pk.quantize_fp8_per_token(x)

            def gemm_only(xq=xq, xs=xs, wq=wq, ws=ws) -> torch.Tensor:
                return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                        out_dtype=torch.bfloat16)  # fmt: skip

            def gemm_fast_accum(xq=xq, xs=xs, wq=wq, ws=ws) -> torch.Tensor:
                return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

            err = rel_error(fp8(), b16().double())
            row: dict[str, Any] = {
                "m": m, "op": name, "n": n, "k": k,
                "path": "torch._scaled_mm" if scaled_mm else "dequantizing fallback",
                "us_16bit": _time(b16, dev) * 1e6, "us": _time(fp8, dev) * 1e6,
                "quant_us": _time(quant, dev) * 1e6, "rel_err_vs_16bit": err,
            }  # fmt: skip
            if scaled_mm:
                row["gemm_only_us"] = _time(gemm_only, dev) * 1e6
                # fp8 tensor cores' own accumulation, without the promotion to fp32 every
                # 128 products that the default does: faster, less accurate (rel_err_*)
                try:
                    row["gemm_fast_accum_us"] = _time(gemm_fast_accum, dev) * 1e6
                    row["rel_err_fast_accum_vs_16bit"] = rel_error(gemm_fast_accum(),
                                                                   b16().double())
                except RuntimeError as exc:  # a torch without fast accumulation here
                    row["gemm_fast_accum_error"] = repr(exc)[:200]
            row["vs_16bit"] = row["us_16bit"] / row["us"]
            g8, g16 = _time_graph(fp8, dev), _time_graph(b16, dev)
            if g8 is not None and g16 is not None:
                row.update(graph_us=g8 * 1e6, graph_us_16bit=g16 * 1e6, graph_vs_16bit=g16 / g8)
            rows.append(row)
            print(f"gemm {name:8s} M={m:<5d} {n}x{k}: 16-bit {row['us_16bit']:8.1f} us  fp8 "
                  f"{row['us']:8.1f} us (quant {row['quant_us']:.1f}"
                  + (f", matmul {row['gemm_only_us']:.1f}" if "gemm_only_us" in row else "")
                  + (f", fast accum {row['gemm_fast_accum_us']:.1f}"
                     if "gemm_fast_accum_us" in row else "")
                  + f") x{row['vs_16bit']:.2f}"
                  + (f" | graph x{row['graph_vs_16bit']:.2f}" if "graph_vs_16bit" in row else "")
                  + f"  err {err:.1e}  [{row['path']}]", flush=True)  # fmt: skip
        del w, wq
    layer = []
    for m in tokens_list:
        ops = [r for r in rows if r["m"] == m]
        total = {"m": m, "us_16bit": sum(r["us_16bit"] for r in ops),
                 "us": sum(r["us"] for r in ops)}  # fmt: skip
        total["vs_16bit"] = total["us_16bit"] / total["us"]
        if all("gemm_only_us" in r for r in ops):
            total["gemm_only_us"] = sum(r["gemm_only_us"] for r in ops)
            total["gemm_only_vs_16bit"] = total["us_16bit"] / total["gemm_only_us"]
        if all("gemm_fast_accum_us" in r for r in ops):
            total["gemm_fast_accum_us"] = sum(r["gemm_fast_accum_us"] for r in ops)
            total["gemm_fast_accum_vs_16bit"] = total["us_16bit"] / total["gemm_fast_accum_us"]
        if all("graph_us" in r for r in ops):
            g8 = sum(r["graph_us"] for r in ops)
            g16 = sum(r["graph_us_16bit"] for r in ops)
            total.update(graph_us=g8, graph_us_16bit=g16, graph_vs_16bit=g16 / g8)
        layer.append(total)
        print(f"gemm layer M={m:<5d}: 16-bit {total['us_16bit']:9.1f} us  fp8 {total['us']:9.1f} "
              f"us  x{total['vs_16bit']:.2f}"
              + (f" | graph x{total['graph_vs_16bit']:.2f}" if "graph_vs_16bit" in total else ""),
              flush=True)  # fmt: skip
    return rows, layer


def bench_layer_fused(setup: Setup, gen: torch.Generator) -> list[dict]:
    """Per M: one decoder layer's linear layers with the kernels feeding them (see the module
    docstring), 16-bit against fp8 unfused and fused, each replayed from a CUDA graph."""
    from pagedkv.engine.models.quantization import Fp8Rows, fp8_linear, quantize_weight

    dev, dtype = setup.device, setup.dtype
    shapes = dict((name, (n, k)) for name, n, k in
                  (QUICK_LINEARS if setup.quick else LLAMA3_8B_LINEARS))  # fmt: skip
    hidden, inter = shapes["qkv"][1], shapes["down"][1]
    w16 = {name: (torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(dtype)
           for name, (n, k) in shapes.items()}  # fmt: skip
    w8 = {name: quantize_weight(w) for name, w in w16.items()}
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=dev)).to(dtype)
    eps = 1e-5
    rows: list[dict] = []
    for m in [16, 64] if setup.quick else GEMM_TOKENS:
        x = torch.randn(m, hidden, generator=gen, device=dev).to(dtype)
        res = torch.randn(m, hidden, generator=gen, device=dev).to(dtype)
        attn = torch.randn(m, shapes["o"][1], generator=gen, device=dev).to(dtype)

        def b16(x=x, res=res, attn=attn) -> torch.Tensor:
            h, r = pk.fused_add_rms_norm(x, res, norm_w, eps)
            F.linear(h, w16["qkv"])
            o = F.linear(attn, w16["o"])
            h, r = pk.fused_add_rms_norm(o, r, norm_w, eps)
            return F.linear(pk.silu_and_mul(F.linear(h, w16["gate_up"])), w16["down"])

        def unfused(x=x, res=res, attn=attn) -> torch.Tensor:
            h, r = pk.fused_add_rms_norm(x, res, norm_w, eps)
            fp8_linear(h, *w8["qkv"])
            o = fp8_linear(attn, *w8["o"])
            h, r = pk.fused_add_rms_norm(o, r, norm_w, eps)
            return fp8_linear(pk.silu_and_mul(fp8_linear(h, *w8["gate_up"])), *w8["down"])

        def fused(x=x, res=res, attn=attn) -> torch.Tensor:
            q, s, r = pk.fused_add_rms_norm_fp8(x, res, norm_w, eps)
            fp8_linear(Fp8Rows(q, s, dtype), *w8["qkv"])
            o = fp8_linear(attn, *w8["o"])
            q, s, r = pk.fused_add_rms_norm_fp8(o, r, norm_w, eps)
            gate_up = fp8_linear(Fp8Rows(q, s, dtype), *w8["gate_up"])
            return fp8_linear(Fp8Rows(*pk.silu_and_mul_fp8(gate_up), dtype), *w8["down"])

        same = torch.equal(fused(), unfused())
        row: dict[str, Any] = {"m": m, "hidden": hidden, "intermediate": inter,
                               "fused_equals_unfused": same}  # fmt: skip
        times = {name: _time_graph(fn, dev) for name, fn in
                 (("16bit", b16), ("unfused", unfused), ("fused", fused))}  # fmt: skip
        if all(t is not None for t in times.values()):
            row.update(graph_us_16bit=times["16bit"] * 1e6, graph_us_unfused=times["unfused"] * 1e6,
                       graph_us=times["fused"] * 1e6,
                       graph_vs_16bit=times["16bit"] / times["fused"],
                       graph_unfused_vs_16bit=times["16bit"] / times["unfused"])  # fmt: skip
            print(f"gemm layer fused M={m:<5d}: 16-bit {row['graph_us_16bit']:8.1f} us  fp8 "
                  f"unfused {row['graph_us_unfused']:8.1f} us (x{row['graph_unfused_vs_16bit']:.2f})"
                  f"  fused {row['graph_us']:8.1f} us (x{row['graph_vs_16bit']:.2f})  "
                  f"same output: {same}", flush=True)  # fmt: skip
        else:
            print(f"gemm layer fused M={m:<5d}: no CUDA graphs here; same output: {same}",
                  flush=True)  # fmt: skip
        rows.append(row)
    return rows


QUANT_TOKENS = [16, 64, 128, 256, 384, 512, 768, 1024, 4096, 16384]


def _fp8_rows(m: int, cols: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers of a per-token quantization: e4m3 codes and float32 scales."""
    return torch.empty(m, cols, dtype=FP8, device=dev), torch.empty(m, 1, device=dev)


def _same_fp8(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bit for bit (fp8 codes as bytes, so -0 is not +0)."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def bench_quant(setup: Setup, copy_bw: float, gen: torch.Generator) -> list[dict]:
    """Per-token quantization of a decode step's activations, a program per row against
    tiled (``pagedattn_kernels.quant.triton_launch.quantize_fp8_per_token``'s ``tiled``), at
    Llama-3-8B's widths (4,096: the output projection's input; 14,336: the down projection's),
    and at 14,336 SiLU-and-multiply quantizing its own output each way (a program per row,
    tiled, two passes over whole rows) against the plain kernel followed by the default
    quantization. Bandwidth in the bytes each needs at least (16-bit in, e4m3 out; SiLU reads
    gate and up); ``same``: tiled gives the per-row bits; ``silu_same``: so do SiLU's three
    ways."""
    from pagedattn_kernels.fused import triton_launch as fused_launch
    from pagedattn_kernels.quant import triton_launch as quant_launch

    dev, dtype = setup.device, setup.dtype
    if dev.type != "cuda":
        print("quant: the Triton kernels need a GPU here (the interpreter is not timed)")
        return []
    widths = [256, 512] if setup.quick else [4096, 14336]
    rows: list[dict] = []
    for m in [4, 16] if setup.quick else QUANT_TOKENS:
        for cols in widths:
            x = torch.randn(m, cols, generator=gen, device=dev).to(dtype)
            outs = {k: _fp8_rows(m, cols, dev) for k in ("per_row", "tiled")}

            def per_row(x=x, o=outs["per_row"]) -> Any:
                return quant_launch.quantize_fp8_per_token(x, *o, tiled=False)

            def tiled(x=x, o=outs["tiled"]) -> Any:
                return quant_launch.quantize_fp8_per_token(x, *o, tiled=True)

            fns = {"per_row": per_row, "tiled": tiled}
            if cols == widths[-1]:
                g = torch.randn(m, 2 * cols, generator=gen, device=dev).to(dtype)
                silu_out = {k: _fp8_rows(m, cols, dev) for k in ("per_row", "tiled", "two_pass")}

                def silu_per_row(g=g, o=silu_out["per_row"], cols=cols) -> None:
                    fused_launch.silu_and_mul(g, g, cols, fp8_out=o, method="row")

                def silu_tiled(g=g, o=silu_out["tiled"], cols=cols) -> None:
                    fused_launch.silu_and_mul(g, g, cols, fp8_out=o, method="tiled")

                def silu_two_pass(g=g, o=silu_out["two_pass"], cols=cols) -> None:
                    fused_launch.silu_and_mul(g, g, cols, fp8_out=o, method="two_pass")

                def silu_then_quant(g=g) -> Any:
                    return pk.quantize_fp8_per_token(pk.silu_and_mul(g))

                fns.update(silu_per_row=silu_per_row, silu_tiled=silu_tiled,
                           silu_two_pass=silu_two_pass, silu_then_quant=silu_then_quant)  # fmt: skip
            for fn in fns.values():
                fn()
            row: dict[str, Any] = {"m": m, "cols": cols,
                                   "same": _same_fp8(outs["per_row"], outs["tiled"])}  # fmt: skip
            if "silu_tiled" in fns:
                row["silu_same"] = (_same_fp8(silu_out["per_row"], silu_out["tiled"])
                                    and _same_fp8(silu_out["two_pass"], silu_out["tiled"]))  # fmt: skip
            for name, fn in fns.items():
                seconds = _time_graph(fn, dev) or _time(fn, dev)
                need = m * cols * (2 * x.element_size() if name.startswith("silu") else
                                   x.element_size()) + m * cols + 4 * m  # fmt: skip
                row[f"{name}_us"] = seconds * 1e6
                row[f"{name}_bw_frac"] = need / seconds / copy_bw
            row["tiled_vs_per_row"] = row["per_row_us"] / row["tiled_us"]
            if "silu_tiled_us" in row:
                row["silu_tiled_vs_per_row"] = row["silu_per_row_us"] / row["silu_tiled_us"]
                row["silu_tiled_vs_unfused"] = row["silu_then_quant_us"] / row["silu_tiled_us"]
                row["silu_two_pass_vs_tiled"] = row["silu_tiled_us"] / row["silu_two_pass_us"]
            print(f"quant M={m:<5d} cols={cols:<6d} per row {row['per_row_us']:7.1f} us "
                  f"({100 * row['per_row_bw_frac']:4.1f}%)  tiled {row['tiled_us']:7.1f} us "
                  f"({100 * row['tiled_bw_frac']:4.1f}%)  same: {row['same']}"
                  + (f" | silu fp8 per row {row['silu_per_row_us']:7.1f} tiled "
                     f"{row['silu_tiled_us']:7.1f} two-pass {row['silu_two_pass_us']:7.1f} "
                     f"silu+quant {row['silu_then_quant_us']:7.1f} us"
                     f" same: {row['silu_same']}" if "silu_tiled_us" in row else ""),
                  flush=True)  # fmt: skip
            rows.append(row)
    return rows


def fp8_headlines(decode: list[dict], prefill: list[dict], layer: list[dict],
                  layer_fused: list[dict] | None = None,
                  quant: list[dict] | None = None) -> dict[str, Any]:  # fmt: skip
    """Flat keys for the fp8 goals: decode bandwidth fraction (fp8 bytes) at 64 x 4k, prefill
    against SDPA at 4k and 16k, decode GEMMs at M = 512 against the 16-bit ones."""

    def pick(rows: list[dict], key: str, **where: Any) -> Any:
        for r in rows:
            if all(r.get(a) == b for a, b in where.items()) and key in r:
                return r[key]
        return None

    return {
        "decode_fp8_bw_frac_b64_c4k": pick(decode, "bw_frac", batch=64, context=4096),
        "decode_fp8_graph_bw_frac_b64_c4k": pick(decode, "graph_bw_frac", batch=64, context=4096),
        "decode_fp8_vs_16bit_b64_c4k": pick(decode, "vs_16bit", batch=64, context=4096),
        "decode_fp8_graph_vs_16bit_b64_c4k": pick(decode, "graph_vs_16bit", batch=64,
                                                  context=4096),
        "prefill_fp8_vs_sdpa_4k": pick(prefill, "vs_sdpa", tokens=4096),
        "prefill_fp8_vs_sdpa_16k": pick(prefill, "vs_sdpa", tokens=16384),
        "gemm_fp8_vs_16bit_m512": pick(layer, "vs_16bit", m=512),
        "gemm_fp8_graph_vs_16bit_m512": pick(layer, "graph_vs_16bit", m=512),
        "gemm_fp8_matmul_only_vs_16bit_m512": pick(layer, "gemm_only_vs_16bit", m=512),
        "gemm_fp8_fast_accum_matmul_only_vs_16bit_m512": pick(layer, "gemm_fast_accum_vs_16bit",
                                                              m=512),
        "gemm_fp8_fused_graph_vs_16bit_m512": pick(layer_fused or [], "graph_vs_16bit", m=512),
        "quant_tiled_vs_per_row_m512_c14336": pick(quant or [], "tiled_vs_per_row", m=512,
                                                   cols=14336),
        "silu_fp8_tiled_vs_per_row_m512": pick(quant or [], "silu_tiled_vs_per_row", m=512),
    }
