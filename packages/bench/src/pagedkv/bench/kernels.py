"""Benchmark: paged decode and prefill attention against the copy bandwidth and torch SDPA.

    python -m pagedkv.bench.kernels            # on a CUDA GPU: the full set
    python -m pagedkv.bench.kernels --quick    # CPU smoke run (tiny sizes, torch path)

Measured in one run:
- copy bandwidth: a device-to-device copy of a 2 GiB tensor, counting bytes read + written
  (the practical ceiling for a memory-bound kernel);
- decode (32 query heads, 8 KV heads, head dim 128, block size 16, bf16) for batch
  {1, 16, 64, 256} x context {512, 2k, 4k, 8k, 32k}: median time, achieved bandwidth
  (K/V bytes read / time), its fraction of the copy bandwidth, and the ratio to torch SDPA on
  the same K/V laid out contiguously ([B, H, 1, D] query; the fastest of the SDPA backends,
  with enable_gqa or with K/V repeated per query head);
- prefill (one causal sequence of 1k, 4k, 16k tokens, same heads) in TFLOP/s against SDPA
  causal on contiguous tensors, called as the engine calls it (the chunk's own keys from the
  step's new rows, ``key``/``value``), and with every key gathered from the cache
  (``tflops_cache_only``);
- sweeps of the flash-decoding split count and of tile shapes at the headline sizes, which
  is how the defaults were chosen;
- the fused elementwise ops of a Llama-3-8B decoder layer (hidden 4096, intermediate 14336,
  32/8 heads of 128, bf16) at T = 256 and 4096 tokens: ``rms_norm``, ``fused_add_rms_norm``,
  ``silu_and_mul``, ``rotary_embedding`` against the unfused torch composition they replace
  (Hugging Face's numerics, as the model runs it on CPU), timed in the same run: speed-up,
  achieved bandwidth (bytes read + written once / time) against the copy bandwidth, and how
  many outputs are bit-identical to the composition's (``--fused-only`` runs just these).
Physical blocks are in random order. Times are medians of ``triton.testing.do_bench``
(CUDA events, L2 flushed between runs). The last line of output is one JSON object.

The kernels are called through the public ``pagedattn_kernels`` API; only the split/tile sweeps
reach inside (the Triton launch configurations), all through :func:`_tuning`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import pagedattn_kernels as pk
from pagedattn_kernels.testing import own_rows
from pagedkv.bench.env import environment, hardware

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336  # Llama 3 8B
FUSED_TOKENS = [256, 4096]
BATCHES = [1, 16, 64, 256]
CONTEXTS = [512, 2048, 4096, 8192, 32768]
PREFILL_TOKENS = [1024, 4096, 16384]


@dataclass(slots=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    batches: list[int]
    contexts: list[int]
    prefill_tokens: list[int]
    quick: bool


def _tuning():
    """The Triton launch internals the sweeps vary (split counts, tile configurations): not
    public API, and the one place this benchmark reaches inside pagedattn_kernels."""
    from pagedattn_kernels.attention import triton_launch

    return triton_launch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in ``out`` gives inf."""
    out64 = out.to(device=ref.device, dtype=torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    denom = float(ref.norm())
    return float((out64 - ref).norm()) / (denom if denom > 0 else 1.0)


_SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two tensors of one float dtype in units in the last place (0 =
    bit-identical, or +0 and -0), int64."""
    as_int = _SAME_WIDTH_INT[a.dtype]
    sign_bit = 1 << (torch.finfo(a.dtype).bits - 1)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bits -> integers in the same order as the floats they encode.
        i = t.contiguous().view(as_int).to(torch.int64)
        return torch.where(i < 0, -(i + sign_bit), i)

    return (ordered(a) - ordered(b.to(a.device))).abs()


#: Rounds of ``interleaved_ratio``: ours and the baseline timed in turn.
INTERLEAVED_ROUNDS = 5


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds per call: CUDA events around each call with L2 flushed before it
    (``do_bench``). Host time of a call beyond the flush's ~60 us shows up here."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=60, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_graph(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median seconds per call replayed from a CUDA graph (no host overhead, as the engine
    runs decode; L2 not flushed between calls). None where capture fails."""
    if device.type != "cuda":
        return None
    import triton.testing

    try:
        # do_bench_cudagraph runs fn on a stream of its own, which does not wait for the
        # default stream: the inputs written there must be complete first
        torch.cuda.synchronize(device)
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") / 1e3
    except Exception:  # e.g. a backend that cannot be captured
        torch.cuda.synchronize()
        return None



def time_tile(run, device, row: dict, kv_bytes: float, copy_bw: float) -> bool:
    """Time one tile configuration of a decode sweep into `row` (`us`, `bw_frac` and, with
    CUDA graphs, `graph_us`, `graph_bw_frac`); a shape that does not compile or fit gets
    `error` instead and False is returned."""
    try:
        run()
        seconds = _time(run, device)
        graph_s = _time_graph(run, device)
    except Exception as exc:  # a tile shape that does not compile or fit
        row["error"] = repr(exc)[:200]
        return False
    row.update(us=seconds * 1e6, bw_frac=kv_bytes / seconds / copy_bw)
    if graph_s is not None:
        row.update(graph_us=graph_s * 1e6, graph_bw_frac=kv_bytes / graph_s / copy_bw)
    return True

def _host_us(fn: Callable[[], object], device: torch.device, n: int = 200) -> float:
    """Host time per call (launches queued, not waited for)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host * 1e6


def _warm_gpu(device: torch.device, seconds: float = 0.3) -> None:
    """Keep the GPU busy for a moment so that timings start at full clocks."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, quick: bool) -> float:
    """Bytes per second of a device-to-device copy, counting reads and writes."""
    n = (64 if quick else 2048) * 2**20 // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / seconds


def _sdpa_backends(device: torch.device) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return [("default", None)]
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def fastest_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    repeat_ok: bool,
) -> tuple[float, str, torch.Tensor | None, Callable[[], object] | None]:
    """Fastest SDPA over the available backends, with enable_gqa and (where memory allows)
    with K/V repeated per query head. Returns (seconds, label, output, the call)."""
    from torch.nn.attention import sdpa_kernel

    group = q.shape[1] // k.shape[1]
    layouts: list[tuple[str, torch.Tensor, torch.Tensor, bool]] = [("gqa", k, v, True)]
    if repeat_ok and group > 1:
        layouts.append(
            ("repeat", k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)
        )
    best: tuple[float, str, torch.Tensor | None, Callable[[], object] | None] = (
        math.inf, "none", None, None,
    )  # fmt: skip
    for layout, kk, vv, gqa in layouts:
        for name, backend in _sdpa_backends(q.device):

            def run(kk=kk, vv=vv, gqa=gqa, backend=backend) -> torch.Tensor:
                ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
                with ctx:
                    return F.scaled_dot_product_attention(
                        q, kk, vv, is_causal=causal, enable_gqa=gqa
                    )

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = run()
                    seconds = _time(run, q.device)
            except RuntimeError:
                continue  # this backend does not take these inputs
            if seconds < best[0]:
                best = (seconds, f"{name}/{layout}", out, run)
    return best


def _paged(setup: Setup, batch: int, context: int, gen: torch.Generator):
    """Random paged K/V for `batch` sequences of `context` tokens in shuffled blocks."""
    per_seq = -(-context // setup.block)
    num_blocks = batch * per_seq
    shape = (num_blocks, setup.block, setup.kv_heads, setup.head_dim)
    dev = setup.device
    kc = torch.randn(shape, generator=gen, device=dev, dtype=setup.dtype)
    vc = torch.randn(shape, generator=gen, device=dev, dtype=setup.dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    tables = perm.view(batch, per_seq).to(torch.int32)
    return kc, vc, tables


def _contiguous(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, kv_heads, context, dim] copy of the paged cache (the SDPA baseline's layout)."""
    b = tables.shape[0]
    g = cache[tables.long()].view(b, -1, cache.shape[2], cache.shape[3])[:, :context]
    return g.transpose(1, 2).contiguous()


def _fits(setup: Setup, nbytes: int) -> bool:
    if setup.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(setup.device)
    return nbytes < 0.8 * free


def bench_decode(setup: Setup, copy_bw: float, gen: torch.Generator) -> list[dict]:
    rows = []
    item = torch.finfo(setup.dtype).bits // 8
    for batch in setup.batches:
        for context in setup.contexts:
            kv_bytes = 2 * batch * context * setup.kv_heads * setup.head_dim * item
            if not _fits(setup, 3 * kv_bytes):  # paged + contiguous copy + gather scratch
                rows.append({"batch": batch, "context": context, "skipped": "memory"})
                continue
            row = decode_row(setup, batch, context, kv_bytes, copy_bw, gen)
            rows.append(row)
            _print_decode(row)
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def decode_row(
    setup: Setup, batch: int, context: int, kv_bytes: int, copy_bw: float, gen: torch.Generator
) -> dict:
    kc, vc, tables = _paged(setup, batch, context, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
    q = q.to(setup.dtype)
    out = torch.empty_like(q)

    def ours() -> torch.Tensor:
        return pk.paged_decode_attention(q, kc, vc, tables, lens, max_seq_len=context, out=out)

    ours()
    seconds = _time(ours, setup.device)
    graph_s = _time_graph(ours, setup.device)
    result = out.clone()
    k4 = _contiguous(kc, tables, context)
    v4 = _contiguous(vc, tables, context)
    repeat_ok = _fits(setup, 2 * kv_bytes * (setup.heads // setup.kv_heads))
    sdpa_s, label, sdpa_out, sdpa_fn = fastest_sdpa(q.unsqueeze(2), k4, v4, False, repeat_ok)
    sdpa_graph_s = _time_graph(sdpa_fn, setup.device) if sdpa_fn is not None else None
    err = rel_error(result, sdpa_out.squeeze(2).double()) if sdpa_out is not None else None
    row = {
        "batch": batch,
        "context": context,
        "us": seconds * 1e6,
        "GBps": kv_bytes / seconds / 1e9,
        "bw_frac": kv_bytes / seconds / copy_bw,
        "sdpa_us": sdpa_s * 1e6,
        "sdpa": label,
        "vs_sdpa": sdpa_s / seconds,
        "rel_err_vs_sdpa": err,
    }
    if graph_s is not None:
        row.update(graph_us=graph_s * 1e6, graph_bw_frac=kv_bytes / graph_s / copy_bw)
        if sdpa_graph_s is not None:
            row.update(sdpa_graph_us=sdpa_graph_s * 1e6, graph_vs_sdpa=sdpa_graph_s / graph_s)
    if batch == 1 and context == max(setup.contexts) and setup.device.type == "cuda":
        row["host_us"] = _host_us(ours, setup.device)
        if sdpa_fn is not None:
            row["sdpa_host_us"] = _host_us(sdpa_fn, setup.device)
    return row


def _print_decode(row: dict) -> None:
    graph = ""
    if "graph_us" in row:
        graph = f" | graph {row['graph_us']:8.1f} us {100 * row['graph_bw_frac']:5.1f}%"
        if "graph_vs_sdpa" in row:
            graph += f" SDPA {row['sdpa_graph_us']:8.1f} us x{row['graph_vs_sdpa']:.2f}"
    host = f" | host {row['host_us']:.0f} us/call" if "host_us" in row else ""
    print(
        f"decode  B={row['batch']:<4d} ctx={row['context']:<6d} {row['us']:9.1f} us "
        f"{100 * row['bw_frac']:5.1f}% of copy  SDPA {row['sdpa_us']:9.1f} us "
        f"({row['sdpa']}) x{row['vs_sdpa']:.2f} err {row['rel_err_vs_sdpa']:.1e}{graph}{host}",
        flush=True,
    )


def bench_prefill(setup: Setup, gen: torch.Generator) -> list[dict]:
    rows = []
    for tokens in setup.prefill_tokens:
        row = prefill_row(setup, tokens, gen)
        rows.append(row)
        print(
            f"prefill N={tokens:<6d} {row['us']:10.1f} us {row['tflops']:7.1f} TFLOP/s "
            f"(all keys from the cache {row['tflops_cache_only']:7.1f})  "
            f"SDPA {row['sdpa_tflops']:7.1f} TFLOP/s ({row['sdpa']})  x{row['vs_sdpa']:.2f}  "
            f"err {row['rel_err_vs_sdpa']:.1e}{_interleaved_text(row)}",
            flush=True,
        )
    return rows


def _interleaved_text(row: dict) -> str:
    if "vs_sdpa_interleaved" not in row:
        return ""
    lo, hi = row["vs_sdpa_interleaved_range"]
    return f"  interleaved x{row['vs_sdpa_interleaved']:.2f} ({lo:.2f}-{hi:.2f})"


def _prefill_inputs(setup: Setup, tokens: int, gen: torch.Generator):
    """One fresh sequence of ``tokens``: the query, the caches holding its K/V, and the same
    K/V as the step's own rows (``key``/``value``, as the engine passes them)."""
    kc, vc, tables = _paged(setup, 1, tokens, gen)
    q = torch.randn(tokens, setup.heads, setup.head_dim, generator=gen, device=setup.device)
    q = q.to(setup.dtype)
    lens = torch.tensor([tokens], dtype=torch.int32, device=setup.device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=setup.device)
    own = {"key": own_rows(kc, tables, [tokens], [tokens]),
           "value": own_rows(vc, tables, [tokens], [tokens])}  # fmt: skip
    return q, kc, vc, tables, lens, cu, own


def prefill_row(setup: Setup, tokens: int, gen: torch.Generator) -> dict:
    """The engine's call (the chunk's own keys from its new rows) and, for comparison, the
    same attention with every key gathered from the cache (``us_cache_only``)."""
    q, kc, vc, tables, lens, cu, own = _prefill_inputs(setup, tokens, gen)
    out = torch.empty_like(q)

    def ours(own=own) -> torch.Tensor:
        return pk.paged_attention(
            q, kc, vc, tables, lens, cu, max_query_len=tokens, max_seq_len=tokens, out=out, **own
        )

    ours({})
    cache_only_s = _time(lambda: ours({}), setup.device)
    ours()
    seconds = _time(ours, setup.device)
    flops = 4 * setup.heads * setup.head_dim * tokens * tokens / 2  # causal: half the matrix
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    k4 = _contiguous(kc, tables, tokens)
    v4 = _contiguous(vc, tables, tokens)
    sdpa_s, label, sdpa_out, sdpa_fn = fastest_sdpa(q4, k4, v4, True, True)
    err = None
    if sdpa_out is not None:
        err = rel_error(out, sdpa_out[0].transpose(0, 1).double())
    row = {
        "tokens": tokens,
        "us": seconds * 1e6,
        "tflops": flops / seconds / 1e12,
        "us_cache_only": cache_only_s * 1e6,
        "tflops_cache_only": flops / cache_only_s / 1e12,
        "sdpa_us": sdpa_s * 1e6,
        "sdpa_tflops": flops / sdpa_s / 1e12,
        "sdpa": label,
        "vs_sdpa": sdpa_s / seconds,
        "rel_err_vs_sdpa": err,
    }
    if sdpa_fn is not None:
        row.update(interleaved_ratio(ours, sdpa_fn, setup.device))
    return row


def interleaved_ratio(ours: Callable[[], object], theirs: Callable[[], object],
                      device: torch.device, rounds: int = INTERLEAVED_ROUNDS) -> dict:  # fmt: skip
    """Both calls timed in turn, ``rounds`` times (``_time`` each): the median of the rounds'
    speed ratios (theirs' time over ours) and their range. ``vs_sdpa`` times the baseline once
    per SDPA variant and keeps the fastest, a choice that favours the baseline's fast outliers
    (at 16k prefill tokens on an H200 the SDPA reading ranged 571-655 TFLOP/s over four runs of
    one day while ours held 550-556); this compares ours with the chosen variant alone, on the
    same machine state, and says how far the rounds spread."""
    ratios = []
    for _ in range(rounds):
        mine = _time(ours, device)
        ratios.append(_time(theirs, device) / mine)
    return {"vs_sdpa_interleaved": statistics.median(ratios),
            "vs_sdpa_interleaved_range": [min(ratios), max(ratios)]}  # fmt: skip


def _sweep_decode(
    setup: Setup,
    batch: int,
    context: int,
    splits_list: list[int],
    configs: list,
    copy_bw: float,
    gen: torch.Generator,
    deadline: float,
) -> list[dict]:
    """Every split count with the default tiles; the other tiles at the first and the
    automatic split count."""
    to = _tuning()

    kc, vc, tables = _paged(setup, batch, context, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
    q = q.to(setup.dtype)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * setup.kv_heads * setup.head_dim * q.element_size()
    first = configs[0]
    auto = to.choose_num_splits(batch, setup.kv_heads, context, to.sm_count(setup.device),
                                first.per_sm, first.saturate_per_sm, first.tile_n)  # fmt: skip
    rows: list[dict] = []
    for cfg in configs:
        for splits in sorted({*splits_list, auto}):
            if time.monotonic() > deadline:
                return rows
            if cfg != configs[0] and splits not in (splits_list[0], auto):
                continue

            def run(cfg=cfg, splits=splits) -> torch.Tensor:
                return to.paged_decode_attention(
                    q, kc, vc, tables, lens, setup.head_dim**-0.5, context, out,
                    num_splits=splits, config=cfg,
                )  # fmt: skip

            row = {"batch": batch, "context": context, "config": asdict(cfg), "splits": splits,
                   "auto_splits": auto}  # fmt: skip
            rows.append(row)
            if not time_tile(run, setup.device, row, kv_bytes, copy_bw):
                continue
            seconds = row["us"] / 1e6
            graph = ""
            if "graph_us" in row:
                graph = f" | graph {row['graph_us']:.1f} us {100 * row['graph_bw_frac']:.1f}%"
            print(f"sweep decode B={batch} ctx={context} {asdict(cfg)} splits={splits}"
                  f"{' (auto)' if splits == auto else ''}: {seconds * 1e6:.1f} us "
                  f"{100 * row['bw_frac']:.1f}% of copy{graph}", flush=True)  # fmt: skip
    return rows


def _sweep_decode_mixed(setup: Setup, copy_bw: float, gen: torch.Generator,
                        deadline: float) -> list[dict]:  # fmt: skip
    """Small decode batches of mixed lengths (300-1,500 tokens, as in ShareGPT-like serving)
    with the longest length as the hint, and with a bound of 2,048 as a CUDA graph passes it
    (``max_model_len``): each sequence splits by its own length, so the bound should cost
    little (before, a graph at 16 sequences ran each ~900-token sequence in one program per
    KV head: 58% of the copy bandwidth in a Llama-3-8B decode step on an H200)."""
    to = _tuning()
    rows: list[dict] = []
    for batch in (4, 16, 32):
        lens_host = torch.randint(300, 1501, (batch,), generator=torch.Generator().manual_seed(batch))
        kc, vc, tables = _paged(setup, batch, 2048, gen)
        lens = lens_host.to(device=setup.device, dtype=torch.int32)
        q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
        q = q.to(setup.dtype)
        out = torch.empty_like(q)
        kv_bytes = 2 * int(lens_host.sum()) * setup.kv_heads * setup.head_dim * q.element_size()
        for hint in (int(lens_host.max()), 2048):
            if time.monotonic() > deadline:
                return rows

            def run(hint=hint, q=q, kc=kc, vc=vc, tables=tables, lens=lens,
                    out=out) -> torch.Tensor:  # fmt: skip
                return to.paged_decode_attention(q, kc, vc, tables, lens, setup.head_dim**-0.5,
                                                 hint, out)  # fmt: skip

            row = {"batch": batch, "mean_len": float(lens_host.float().mean()),
                   "max_len": int(lens_host.max()), "hint": hint}  # fmt: skip
            rows.append(row)
            if time_tile(run, setup.device, row, kv_bytes, copy_bw):
                print(f"sweep decode mixed B={batch} mean {row['mean_len']:.0f} hint {hint}: "
                      f"{row['us']:.1f} us {100 * row['bw_frac']:.1f}%"
                      + (f" | graph {100 * row['graph_bw_frac']:.1f}%" if "graph_us" in row
                         else ""), flush=True)  # fmt: skip
    return rows


def _sweep_prefill(setup: Setup, tokens: int, configs: list, gen: torch.Generator,
                   deadline: float) -> list[dict]:  # fmt: skip
    to = _tuning()

    q, kc, vc, tables, lens, cu, own = _prefill_inputs(setup, tokens, gen)
    out = torch.empty_like(q)
    flops = 4 * setup.heads * setup.head_dim * tokens * tokens / 2
    rows: list[dict] = []
    for cfg in configs:
        if time.monotonic() > deadline:
            break

        def run(cfg=cfg) -> torch.Tensor:
            return to.paged_attention(
                q, kc, vc, tables, lens, cu, setup.head_dim**-0.5, out, config=cfg, **own
            )

        try:
            run()
            seconds = _time(run, setup.device)
        except Exception as exc:
            rows.append({"tokens": tokens, "config": asdict(cfg), "error": repr(exc)[:200]})
            continue
        rows.append({"tokens": tokens, "config": asdict(cfg), "tflops": flops / seconds / 1e12})
        print(f"sweep prefill N={tokens} {asdict(cfg)}: {flops / seconds / 1e12:.1f} TFLOP/s",
              flush=True)  # fmt: skip
    return rows


def sweeps(setup: Setup, copy_bw: float, gen: torch.Generator, deadline: float) -> dict:
    """Split counts and tile shapes at the headline sizes (GPU only)."""
    to = _tuning()

    decode_cfgs = [
        to.decode_config(setup.head_dim, setup.dtype),
        to.DecodeConfig(64, 2, 3),
        to.DecodeConfig(64, 4, 3),
        to.DecodeConfig(128, 8, 2),
        to.DecodeConfig(128, 4, 2, early_v=True),
        to.DecodeConfig(64, 2, 3, early_v=True),
    ]
    decode: list[dict] = []
    for batch, context, splits_list in (
        (64, 4096, [1, 2]),
        (1, 32768, [16, 32, 48, 64]),
        (16, 4096, [1, 2, 3, 4]),
    ):
        decode += _sweep_decode(setup, batch, context, splits_list, decode_cfgs, copy_bw, gen,
                                deadline)  # fmt: skip
    decode_mixed = _sweep_decode_mixed(setup, copy_bw, gen, deadline)
    qpk = setup.heads // setup.kv_heads
    prefill_cfgs = [
        to.prefill_config(setup.head_dim, setup.dtype, qpk),
        to.PrefillConfig(128, 128, 8, 2),
        to.PrefillConfig(128, 64, 8, 3),
        to.PrefillConfig(64, 128, 4, 3),
        to.PrefillConfig(128, 128, 8, 4),
        to.PrefillConfig(128, 64, 4, 3),
        to.PrefillConfig(256, 64, 8, 3),
        to.PrefillConfig(256, 128, 8, 2),
        to.PrefillConfig(64, 64, 4, 4),
    ]
    prefill = _sweep_prefill(setup, 4096, prefill_cfgs, gen, deadline)
    # The three fastest at 4k again at 16k, where the prefill goal is measured too.
    fastest = sorted((r for r in prefill if "tflops" in r), key=lambda r: -r["tflops"])[:3]
    prefill += _sweep_prefill(setup, 16384, [to.PrefillConfig(**r["config"]) for r in fastest],
                              gen, deadline)
    return {"decode": decode, "decode_mixed": decode_mixed, "prefill": prefill}


# --------------------------------------------------------------------------- fused elementwise ops


def _unfused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: the torch kernels the fused one replaces."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _unfused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _fused_cases(setup: Setup, tokens: int, gen: torch.Generator) -> list[tuple]:
    """(op, bytes moved, fused call, unfused call, fused output getter, unfused output getter):
    inputs built once per token count; outputs preallocated, so calls time the kernels only."""
    dev, dtype = setup.device, setup.dtype
    hidden, inter = (256, 512) if setup.quick else (HIDDEN, INTERMEDIATE)
    item = torch.finfo(dtype).bits // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    x, res = rand(tokens, hidden), rand(tokens, hidden)
    weight = (1 + 0.1 * rand(hidden)).to(dtype)
    eps = 1e-5
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    gate_up = rand(tokens, 2 * inter)
    act = torch.empty(tokens, inter, device=dev, dtype=dtype)
    q_size, kv_size = setup.heads * setup.head_dim, setup.kv_heads * setup.head_dim
    qkv = rand(tokens, q_size + 2 * kv_size)
    q = qkv[:, :q_size].view(tokens, setup.heads, setup.head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, setup.kv_heads, setup.head_dim)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=dev)
    inv_freq = 1.0 / 500000.0 ** (
        torch.arange(0, setup.head_dim, 2, device=dev, dtype=torch.float32) / setup.head_dim
    )
    # The unfused model computes cos/sin once per step for all layers: not timed here.
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    q0, k0 = q.clone(), k.clone()
    rope_out: dict[str, torch.Tensor] = {}

    def fused_rope() -> None:
        pk.rotary_embedding(positions, q, k, inv_freq)

    def fused_rope_result() -> torch.Tensor:
        q.copy_(q0)
        k.copy_(k0)
        fused_rope()
        return torch.cat((q.flatten(), k.flatten()))

    def unfused_rope() -> None:
        rope_out["q"], rope_out["k"] = _unfused_rotary(q0, cos, sin), _unfused_rotary(k0, cos, sin)

    def unfused_rope_result() -> torch.Tensor:
        unfused_rope()
        return torch.cat((rope_out["q"].flatten(), rope_out["k"].flatten()))

    def fused_add() -> tuple[torch.Tensor, torch.Tensor]:
        return pk.fused_add_rms_norm(x, res, weight, eps, out=out, residual_out=res_out)

    def unfused_add() -> tuple[torch.Tensor, torch.Tensor]:
        s = x + res
        return _unfused_rms_norm(s, weight, eps), s

    def silu_unfused() -> torch.Tensor:
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    norm_bytes = (2 * tokens * hidden + hidden) * item
    return [
        ("rms_norm", norm_bytes,
         lambda: pk.rms_norm(x, weight, eps, out=out), lambda: _unfused_rms_norm(x, weight, eps),
         lambda: pk.rms_norm(x, weight, eps, out=out).clone(),
         lambda: _unfused_rms_norm(x, weight, eps)),
        ("fused_add_rms_norm", norm_bytes + 2 * tokens * hidden * item, fused_add, unfused_add,
         lambda: torch.cat([t.flatten().clone() for t in fused_add()]),
         lambda: torch.cat([t.flatten() for t in unfused_add()])),
        ("silu_and_mul", 3 * tokens * inter * item,
         lambda: pk.silu_and_mul(gate_up, out=act), silu_unfused,
         lambda: pk.silu_and_mul(gate_up, out=act).clone(), silu_unfused),
        ("rotary_embedding", 2 * tokens * (q_size + kv_size) * item + tokens * 8,
         fused_rope, unfused_rope, fused_rope_result, unfused_rope_result),
    ]  # fmt: skip


def bench_fused(setup: Setup, copy_bw: float, gen: torch.Generator) -> list[dict]:
    rows = []
    for tokens in [16, 64] if setup.quick else FUSED_TOKENS:
        for op, nbytes, fused, unfused, fused_result, unfused_result in _fused_cases(
            setup, tokens, gen
        ):
            fused()
            unfused()
            ulps = ulp_distance(fused_result(), unfused_result())
            seconds, base_s = _time(fused, setup.device), _time(unfused, setup.device)
            row = {
                "op": op,
                "tokens": tokens,
                "us": seconds * 1e6,
                "unfused_us": base_s * 1e6,
                "vs_unfused": base_s / seconds,
                "GBps": nbytes / seconds / 1e9,
                "bw_frac": nbytes / seconds / copy_bw,
                "exact_frac": float((ulps == 0).float().mean()),
                "max_ulp": int(ulps.max()),
            }
            if setup.device.type == "cuda":  # eager (prefill) steps pay the host time too
                row.update(host_us=_host_us(fused, setup.device),
                           unfused_host_us=_host_us(unfused, setup.device))  # fmt: skip
            graph_s, base_graph_s = _time_graph(fused, setup.device), None
            if graph_s is not None:
                base_graph_s = _time_graph(unfused, setup.device)
                row.update(graph_us=graph_s * 1e6, graph_bw_frac=nbytes / graph_s / copy_bw)
                if base_graph_s is not None:
                    row.update(unfused_graph_us=base_graph_s * 1e6,
                               graph_vs_unfused=base_graph_s / graph_s)  # fmt: skip
            rows.append(row)
            host = ""
            if "host_us" in row:
                host = f" | host {row['host_us']:.0f} vs {row['unfused_host_us']:.0f} us/call"
            graph = ""
            if "graph_vs_unfused" in row:
                graph = (f" | graph {row['graph_us']:7.1f} us {100 * row['graph_bw_frac']:5.1f}%"
                         f" unfused {row['unfused_graph_us']:7.1f} us"
                         f" x{row['graph_vs_unfused']:.2f}")  # fmt: skip
            print(f"fused   {op:18s} T={tokens:<5d} {row['us']:8.1f} us "
                  f"{100 * row['bw_frac']:5.1f}% of copy  unfused {row['unfused_us']:8.1f} us "
                  f"x{row['vs_unfused']:.2f}  exact {100 * row['exact_frac']:.3f}% "
                  f"max {row['max_ulp']} ulp{graph}{host}", flush=True)  # fmt: skip
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fused_headlines(rows: list[dict]) -> dict[str, float | None]:
    """Flat keys per op and token count: speed-up over the unfused composition (events and
    CUDA-graph replay) and fraction of the copy bandwidth."""
    ops = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
    keys = ("vs_unfused", "graph_vs_unfused", "bw_frac", "graph_bw_frac")
    return {
        f"fused_{op}_{key}_t{t}": _pick(rows, key, op=op, tokens=t)
        for op in ops
        for t in FUSED_TOKENS
        for key in keys
    }


def _pick(rows: list[dict], key: str, **where) -> float | None:
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()) and key in row:
            return row[key]
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m pagedkv.bench.kernels", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, torch path")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the split/tile sweeps")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop starting sweeps after this many seconds")  # fmt: skip
    ap.add_argument("--fused-only", action="store_true",
                    help="only the fused elementwise ops (and the copy bandwidth)")  # fmt: skip
    ap.add_argument("--fp8", action="store_true",
                    help="also the fp8 rows: decode and prefill on an fp8 KV cache, the decode "
                         "GEMMs of fp8 weights (pagedkv.bench.kernels_fp8)")  # fmt: skip
    ap.add_argument("--fp8-only", action="store_true",
                    help="only the fp8 rows (and the 16-bit prefill rows, their SDPA baseline)")
    ap.add_argument("--gemm-only", action="store_true",
                    help="only the fp8 GEMM rows and the quantization kernels that feed them "
                         "(gemm, gemm_layer, gemm_layer_fused, quant)")  # fmt: skip
    ap.add_argument("--quant-only", action="store_true",
                    help="only the quantization kernels (quant: per token, SiLU-and-multiply "
                         "to fp8 each way)")  # fmt: skip
    args = ap.parse_args(argv)
    start = time.monotonic()
    if args.quick:
        setup = Setup(torch.device("cpu"), torch.float32, 4, 2, 64, 16, [1, 4], [64, 256],
                      [128, 256], True)  # fmt: skip
    else:
        if not torch.cuda.is_available():
            sys.exit("the benchmark needs a CUDA GPU; use --quick for a CPU smoke run")
        setup = Setup(torch.device("cuda"), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                      BATCHES, CONTEXTS, PREFILL_TOKENS, False)  # fmt: skip
    env = environment(argv=argv, prog="python -m pagedkv.bench.kernels")
    info = {
        "hardware": hardware(setup.device),
        "torch": env["torch"],
        "triton": env.get("triton"),
        "python": env["python"],
        "commit": args.commit or env["commit"],
        "command": env["command"],
        "workload": (
            f"{setup.heads} query heads, {setup.kv_heads} KV heads, head dim {setup.head_dim}, "
            f"block size {setup.block}, {str(setup.dtype).removeprefix('torch.')}, "
            "physical blocks in random order"
        ),
    }
    for k, v in info.items():
        print(f"{k:9s}: {v}")
    gen = torch.Generator(device=setup.device).manual_seed(1234)
    copy_bw = copy_bandwidth(setup.device, setup.quick)
    print(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s (bytes read + written)", flush=True)
    prefill: list[dict] = []
    decode: list[dict] = []
    fused: list[dict] = []
    if args.quant_only:
        args.gemm_only = True
    if args.gemm_only:
        args.fp8_only = args.no_sweeps = True
    if not args.fused_only and not args.gemm_only:
        _warm_gpu(setup.device)
        prefill = bench_prefill(setup, gen)
        if not args.fp8_only:
            _warm_gpu(setup.device)
            decode = bench_decode(setup, copy_bw, gen)
    fp8: dict = {}
    if args.fp8 or args.fp8_only:
        from pagedkv.bench import kernels_fp8

        decode_fp8, prefill_fp8 = [], []
        if not args.gemm_only:
            _warm_gpu(setup.device)
            decode_fp8 = kernels_fp8.bench_decode_fp8(setup, copy_bw, gen)
            prefill_fp8 = kernels_fp8.bench_prefill_fp8(setup, gen, prefill)
        _warm_gpu(setup.device)
        quant = kernels_fp8.bench_quant(setup, copy_bw, gen)
        gemm, gemm_layer, layer_fused = [], [], []
        if not args.quant_only:
            gemm, gemm_layer = kernels_fp8.bench_gemm(setup, gen)
            layer_fused = kernels_fp8.bench_layer_fused(setup, gen)
        fp8_sweep = []
        if not setup.quick and not args.no_sweeps:
            fp8_sweep = kernels_fp8.sweep_decode_fp8(setup, copy_bw, gen, start + args.budget_s)
        fp8 = {**kernels_fp8.fp8_headlines(decode_fp8, prefill_fp8, gemm_layer, layer_fused,
                                           quant),
               "decode_fp8": decode_fp8, "prefill_fp8": prefill_fp8, "gemm": gemm,
               "gemm_layer": gemm_layer, "gemm_layer_fused": layer_fused, "quant": quant,
               "sweep_decode_fp8": fp8_sweep}  # fmt: skip
    if not args.fp8_only:
        _warm_gpu(setup.device)
        fused = bench_fused(setup, copy_bw, gen)
    swept = {}
    if not setup.quick and not args.no_sweeps and not args.fused_only and not args.fp8_only:
        swept = sweeps(setup, copy_bw, gen, start + args.budget_s)

    print()
    print("decode (events: do_bench, L2 flushed | graph: CUDA-graph replay)")
    print(f"{'B':>4} {'ctx':>6} {'us':>9} {'GB/s':>8} {'%copy':>6} {'SDPA us':>9} {'vs SDPA':>7}"
          f" {'graph us':>9} {'%copy':>6} {'vs SDPA':>7}  SDPA backend")  # fmt: skip
    for r in decode:
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['context']:>6}  skipped ({r['skipped']})")
            continue
        g_us = f"{r['graph_us']:>9.1f}" if "graph_us" in r else f"{'-':>9}"
        g_frac = f"{100 * r['graph_bw_frac']:>6.1f}" if "graph_bw_frac" in r else f"{'-':>6}"
        g_vs = f"{r['graph_vs_sdpa']:>7.2f}" if "graph_vs_sdpa" in r else f"{'-':>7}"
        print(f"{r['batch']:>4} {r['context']:>6} {r['us']:>9.1f} {r['GBps']:>8.1f} "
              f"{100 * r['bw_frac']:>6.1f} {r['sdpa_us']:>9.1f} {r['vs_sdpa']:>7.2f} "
              f"{g_us} {g_frac} {g_vs}  {r['sdpa']}")  # fmt: skip
    print(f"\nfused elementwise ops, hidden {4096 if not setup.quick else 256} "
          "(events | graph), vs the unfused torch composition")  # fmt: skip
    print(f"{'op':18s} {'T':>5} {'us':>8} {'GB/s':>7} {'%copy':>6} {'unfused':>8} {'vs':>6}"
          f" {'graph us':>8} {'%copy':>6} {'vs':>6} {'exact %':>8} {'ulp':>4}")  # fmt: skip
    for r in fused:
        g_us = f"{r['graph_us']:>8.1f}" if "graph_us" in r else f"{'-':>8}"
        g_frac = f"{100 * r['graph_bw_frac']:>6.1f}" if "graph_bw_frac" in r else f"{'-':>6}"
        g_vs = f"{r['graph_vs_unfused']:>6.2f}" if "graph_vs_unfused" in r else f"{'-':>6}"
        print(f"{r['op']:18s} {r['tokens']:>5} {r['us']:>8.1f} {r['GBps']:>7.1f} "
              f"{100 * r['bw_frac']:>6.1f} {r['unfused_us']:>8.1f} {r['vs_unfused']:>6.2f} "
              f"{g_us} {g_frac} {g_vs} {100 * r['exact_frac']:>8.3f} {r['max_ulp']:>4}")  # fmt: skip
    print(f"\n{'tokens':>6} {'TFLOP/s':>8} {'SDPA':>8} {'vs SDPA':>7}  SDPA backend")
    for r in prefill:
        print(f"{r['tokens']:>6} {r['tflops']:>8.1f} {r['sdpa_tflops']:>8.1f} {r['vs_sdpa']:>7.2f}  {r['sdpa']}")  # fmt: skip

    headline = not setup.quick
    summary = {
        "bench": "pagedattn_kernels",
        **info,
        "quick": setup.quick,
        "copy_bw_TBps": copy_bw / 1e12,
        "decode_bw_frac_b64_c4k": _pick(decode, "bw_frac", batch=64, context=4096)
        if headline
        else None,
        "decode_vs_sdpa_b64_c4k": _pick(decode, "vs_sdpa", batch=64, context=4096)
        if headline
        else None,
        "decode_bw_frac_b1_c32k": _pick(decode, "bw_frac", batch=1, context=32768)
        if headline
        else None,
        "prefill_vs_sdpa_4k": _pick(prefill, "vs_sdpa", tokens=4096) if headline else None,
        "prefill_vs_sdpa_16k": _pick(prefill, "vs_sdpa", tokens=16384) if headline else None,
        "prefill_vs_sdpa_4k_interleaved": _pick(prefill, "vs_sdpa_interleaved", tokens=4096)
        if headline
        else None,
        "prefill_vs_sdpa_16k_interleaved": _pick(prefill, "vs_sdpa_interleaved", tokens=16384)
        if headline
        else None,
        "decode_bw_frac_b64_c4k_graph": _pick(decode, "graph_bw_frac", batch=64, context=4096),
        "decode_vs_sdpa_b64_c4k_graph": _pick(decode, "graph_vs_sdpa", batch=64, context=4096),
        "decode_bw_frac_b1_c32k_graph": _pick(decode, "graph_bw_frac", batch=1, context=32768),
        "decode_vs_sdpa_b1_c32k_graph": _pick(decode, "graph_vs_sdpa", batch=1, context=32768),
        "decode_host_us_b1_c32k": _pick(decode, "host_us", batch=1, context=32768),
        "timing": (
            "headline keys: triton.testing.do_bench median, L2 flushed before each call "
            "(host launch time beyond the flush is included); *_graph keys: CUDA-graph "
            "replay median (do_bench_cudagraph), no host time, L2 not flushed"
        ),
        "prefill_tflops_4k": _pick(prefill, "tflops", tokens=4096) if headline else None,
        **(_fused_headlines(fused) if headline else {}),
        "fused_workload": (
            f"Llama 3 8B layer: hidden {HIDDEN}, intermediate {INTERMEDIATE}, {setup.heads}/"
            f"{setup.kv_heads} heads x {setup.head_dim}, {str(setup.dtype).removeprefix('torch.')}; "
            "unfused = the torch composition (HF numerics); rotary's unfused cos/sin tables "
            "are precomputed (the model shares them across layers) and not timed"
        ),
        "decode": decode,
        "fused": fused,
        "prefill": prefill,
        **fp8,
        "sweeps": swept,
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary, separators=(",", ":")))
    return summary


if __name__ == "__main__":
    main()
