"""Compile every Triton kernel variant the tests use for an H100/H200 (sm_90) on a machine
without a GPU, and print each variant's registers, spills and shared memory.

Catches front-end errors (and Triton-version differences) before any GPU time is spent, and
shows whether a tile configuration spills, and how many of its programs an SM holds
(``per_sm``, the count the launchers size their grids by). Usage (from the repo root):

    .venv/bin/python packages/pagedattn-kernels/tools/compile_sm90.py [--quick]

Run it with another Triton on PYTHONPATH to check that version too. It swaps Triton's active
driver for a stub that names an sm_90 target, so it must run in its own process.

``--sass`` also counts the instructions of each variant's SASS that tell how it moves and
converts data (shared-memory loads byte by byte or by ldmatrix, conversions, tensor-core
instructions): the offline evidence behind the fp8 decode kernel's choices, e.g.

    .venv/bin/python packages/pagedattn-kernels/tools/compile_sm90.py --fp8 --sass
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import triton
from triton.backends.compiler import GPUTarget

from pagedattn_kernels.attention import plan as decode_plan
from pagedattn_kernels.attention import triton_kernels as attention_kernels
from pagedattn_kernels.attention import triton_launch as attention
from pagedattn_kernels.cache import triton_kernels as cache_kernels
from pagedattn_kernels.cache import triton_launch as cache
from pagedattn_kernels.common import programs_per_sm
from pagedattn_kernels.fused import triton_kernels as fused_kernels
from pagedattn_kernels.fused import triton_launch as fused
from pagedattn_kernels.quant import triton_kernels as quant_kernels
from pagedattn_kernels.quant import triton_launch as quant
from pagedattn_kernels.sampling import triton_kernels as sampling_kernels
from pagedattn_kernels.sampling import triton_launch as sampling

FUSED_KERNELS = ("rms_norm_kernel", "silu_and_mul_kernel", "silu_and_mul_fp8_rows_kernel",
                 "rotary_kernel", "rotary_and_cache_kernel")  # fmt: skip
# SASS opcodes (with their width suffix where it matters) that --sass counts.
SASS_OPS = ("HMMA", "HGMMA", "QGMMA", "LDSM", "LDS", "LDS.U8", "LDS.U16", "LDS.64", "LDS.128",
            "LDGSTS", "LDG", "STS", "F2FP", "F2F", "PRMT", "BAR", "SHFL", "MUFU", "STL", "LDL")  # fmt: skip


class _StubDriver:
    """Just enough of a driver for JITFunction.run(warmup=True) to compile for sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


RESULTS: list[tuple[str, str, dict]] = []


class _Warmup:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            t = time.perf_counter()
            ck = self.kernel.warmup(*args, grid=grid, **kwargs)
            info = _resources(ck)
            if "regs" in info:  # what DecodeConfig.per_sm and its kind must match
                info["per_sm"] = programs_per_sm(info["regs"], info["shared"],
                                                 kwargs.get("num_warps", 4))  # fmt: skip
            info["compile_s"] = round(time.perf_counter() - t, 2)
            consts = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
            dtype = next((str(a.dtype) for a in args if isinstance(a, torch.Tensor)), "?")
            RESULTS.append((self.kernel.__name__, f"{dtype} {consts}", info))

        return launch


def sass_counts(sass: str) -> dict[str, int]:
    """How often each of ``SASS_OPS`` occurs in a cuobjdump -sass listing (static counts:
    an instruction inside the key loop counts once), ``instrs``: all of them, and ``loop``: the
    instructions of the longest loop (from a backward branch's target to the branch), the work
    per tile."""
    counts: dict[str, int] = {}
    addrs, loops = [], []
    pattern = r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)([^;]*)"
    for m in re.finditer(pattern, sass):
        addr, op, suffix = int(m[1], 16), m[2], m[3]
        addrs.append(addr)
        target = re.search(r"0x([0-9a-f]+)", m[4]) if op == "BRA" else None
        if target and int(target[1], 16) < addr:
            loops.append((int(target[1], 16), addr))
        counts[op] = counts.get(op, 0) + 1
        if op == "LDS":
            width = next((w for w in (".U8", ".U16", ".64", ".128") if w in suffix), None)
            if width:
                counts[op + width] = counts.get(op + width, 0) + 1
    out = {k: counts[k] for k in SASS_OPS if counts.get(k)}
    out["instrs"] = len(addrs)
    if loops:
        lo, hi = max(loops, key=lambda span: span[1] - span[0])
        out["loop"] = sum(lo <= a <= hi for a in addrs)
    return out


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


WANT_SASS = False


def _resources(ck) -> dict:
    cubin = ck.asm.get("cubin")
    info = {"shared": ck.metadata.shared}
    if cubin is None:
        return info
    if WANT_SASS:
        info["sass"] = sass_counts(_cuobjdump(cubin, "-sass"))
    out = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m:
        info.update(regs=int(m[1]), stack=int(m[2]), local=int(m[4]))
    ptx = ck.asm.get("ptx", "")
    info["wgmma"] = "wgmma" in ptx
    # Approximate fp32 division (Triton's `/`), which the fused ops must not use.
    info["div_full"] = "div.full.f32" in ptx
    return info


def _proxy(module, names: tuple[str, ...]) -> SimpleNamespace:
    return SimpleNamespace(**{name: _Warmup(getattr(module, name)) for name in names})


def _fused_variants(quick: bool) -> None:
    """The fused elementwise kernels at the shapes of the tests and of Llama 3 8B."""
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        for hidden in [4096] if quick else [64, 576, 1000, 4096, 8192, 16384]:
            x = torch.empty(8, hidden, dtype=dtype)
            w = torch.empty(hidden, dtype=dtype)
            fused.rms_norm(x, None, x, None, w, 1e-5, hidden)
            fused.rms_norm(x, x, x, x, w, 1e-5, hidden)
        for inter in [14336] if quick else [64, 300, 1408, 14336]:
            fused.silu_and_mul(
                torch.empty(8, inter, dtype=dtype), torch.empty(8, 2 * inter, dtype=dtype), inter
            )
        shapes = [(32, 8, 128)] if quick else [(32, 8, 128), (9, 3, 64), (8, 2, 80), (2, 0, 32)]
        # a program per token, and each token's heads split over programs (small batches)
        for (heads, kv_heads, head_dim), split in itertools.product(shapes, (False, True)):
            q = torch.empty(4, heads, head_dim, dtype=dtype)
            k = torch.empty(4, kv_heads, head_dim, dtype=dtype) if kv_heads else None
            fused.rotary_embedding(
                torch.zeros(4, dtype=torch.int64), q, k, torch.empty(head_dim // 2), split=split
            )
            if k is None:
                continue
            for cache_dtype in (dtype, torch.float8_e4m3fn):
                kc = torch.empty(8, 16, kv_heads, head_dim, dtype=cache_dtype)
                fused.rotary_embedding_and_cache(
                    torch.zeros(4, dtype=torch.int64), q, k, torch.empty_like(k),
                    torch.empty(head_dim // 2), kc, kc, torch.zeros(4, dtype=torch.int64),
                    None, None, split=split,
                )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one variant per kernel")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="only this dtype")  # fmt: skip
    ap.add_argument("--head-dim", type=int, default=None, help="only this head dim")
    ap.add_argument("--fp8", action="store_true",
                    help="only the fp8 kernels: attention on fp8 caches (Llama-3-8B heads), "
                         "the e4m3 writers and the fp8 matmul")  # fmt: skip
    ap.add_argument("--sampling", action="store_true",
                    help="only the sampling kernels (argmax_rows at Llama-3's vocabulary)")
    ap.add_argument("--sass", action="store_true", help="count SASS instructions (SASS_OPS)")
    args = ap.parse_args()
    global WANT_SASS
    WANT_SASS = args.sass
    triton.runtime.driver.set_active(_StubDriver())
    # Each op folder's launchers find their kernels through `kernels_for`: hand them proxies
    # that compile and never launch.
    attention_proxy = _proxy(
        attention_kernels,
        ("decode_kernel", "decode_reduce_kernel", "decode_merge_kernel", "prefill_kernel"),
    )
    attention.kernels_for = lambda device, module: attention_proxy
    cache_proxy = _proxy(cache_kernels, ("reshape_and_cache_kernel", "copy_blocks_kernel"))
    cache.kernels_for = lambda device, module: cache_proxy
    fused_proxy = _proxy(fused_kernels, FUSED_KERNELS)
    fused.kernels_for = lambda device, module: fused_proxy
    quant_proxy = _proxy(quant_kernels, ("quantize_fp8_per_token_kernel", "row_chunk_amax_kernel",
                                         "quantize_fp8_tiles_kernel", "fp8_matmul_kernel",
                                         "fp8_matmul_reduce_kernel"))  # fmt: skip
    quant.kernels_for = lambda device, module: quant_proxy
    sampling_proxy = _proxy(sampling_kernels, ("argmax_chunks_kernel", "argmax_merge_kernel"))
    sampling.kernels_for = lambda device, module: sampling_proxy
    # The stub's tensors live on the CPU, where the launchers would pick the interpreter's
    # e4m3 encoder: compile the sm_90 one (the hardware conversion).
    for launcher in (cache, fused, quant):
        launcher.e4m3_encoder = lambda kernel, device: 2
    # ... and with programmatic dependent launch, as on an sm_90 GPU (common.use_pdl).
    for launcher in (attention, cache, fused, quant, sampling):
        launcher.use_pdl = lambda device: True
    fused.sm_count = lambda device: 132  # an H200's SMs: the persistent grids' size

    if args.sampling:
        _sampling_variants(args.quick)
        _report()
        return
    if args.fp8:
        _fp8_variants()
        _report()
        return
    dims = [64, 80, 96, 128, 256]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    variants = [] if args.dtype or args.head_dim else [(128, torch.bfloat16, 16, 4)]
    if not args.quick:
        variants += [(d, dt, bs, g) for d in dims for dt in dtypes for bs, g in [(16, 4)]]
    variants = [
        v for v in variants
        if (args.dtype is None or v[1] == getattr(torch, args.dtype))
        and (args.head_dim is None or v[0] == args.head_dim)
    ]  # fmt: skip
    seen = set()
    for head_dim, dtype, block_size, group in variants:
        if (head_dim, dtype, block_size, group) in seen:
            continue
        seen.add((head_dim, dtype, block_size, group))
        hkv = 2
        kc = torch.empty(64, block_size, hkv, head_dim, dtype=dtype)
        q = torch.empty(8, hkv * group, head_dim, dtype=dtype)
        bt = torch.zeros(2, 32, dtype=torch.int32)
        lens = torch.tensor([100, 5], dtype=torch.int32)
        cu = torch.tensor([0, 6, 8], dtype=torch.int32)
        attention.paged_attention(q, kc, kc, bt, lens, cu, 0.1, torch.empty_like(q))
        qd = q[:2].contiguous()
        for splits in (1, 4):
            attention.paged_decode_attention(
                qd, kc, kc, bt, lens, 0.1, 512, torch.empty_like(qd), num_splits=splits
            )
        # longest first, as the engine's decode steps run it (seq_order)
        attention.paged_decode_attention(qd, kc, kc, bt, lens, 0.1, 512, torch.empty_like(qd),
                                         seq_order=torch.tensor([1, 0], dtype=torch.int32))  # fmt: skip
        _planned(qd, kc, bt, lens)
        cache.reshape_and_cache(
            q[:, :hkv].contiguous(), q[:, :hkv].contiguous(), kc, kc,
            torch.zeros(8, dtype=torch.int64),
        )  # fmt: skip
    cache.copy_blocks(torch.empty(4, 64, 2048, dtype=torch.bfloat16),
                      torch.zeros(3, 2, dtype=torch.int64))  # fmt: skip
    if args.head_dim is None:
        _fused_variants(args.quick)
        _sampling_variants(args.quick)
    _report()


def _sampling_variants(quick: bool) -> None:
    """``argmax_rows`` over Llama-3's 128,256 columns (``pick_chunk``'s 8,192 columns a
    program, and the merge of 16 chunks), and one chunk a row (a narrow vocabulary: no
    merge)."""
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        sampling.argmax_rows(torch.empty(16, 128256, dtype=dtype),
                             torch.empty(16, dtype=torch.int64))  # fmt: skip
        sampling.argmax_rows(torch.empty(4, 1000, dtype=dtype), torch.empty(4, dtype=torch.int64))


def _planned(q, kc, bt, lens, config=None, **scales) -> None:
    """Decode by a plan (``decode_kernel``'s WORK variant and ``decode_merge_kernel``) with
    ``config`` (None: the launcher's)."""
    cfg = config or attention.decode_config(q.shape[2], q.dtype, kv_dtype=kc.dtype,
                                            num_pairs=q.shape[0] * kc.shape[2],
                                            planned=True)  # fmt: skip
    plan = decode_plan.build_plan(lens.tolist(), 2, cfg.tile_n, min_chunk=cfg.tile_n)
    attention.paged_decode_attention(q, kc, kc, bt, lens, 0.1, 512, torch.empty_like(q),
                                     config=cfg, plan=plan, **scales)  # fmt: skip


def _fp8_variants() -> None:
    """The fp8 kernels at Llama-3-8B's shapes (8 KV heads of 128, 4 query heads each): decode
    on fp8 caches (the launcher's tiles with float16 and with bfloat16 products, packed
    loads at three tiles, the narrow tiles of many sequences: 64 x 2 warps, 32 x 1 warp),
    prefill, the e4m3 writers (cache write, per-token quantization, the fused norm and SiLU)
    and the fp8 matmul at decode batch sizes."""
    hkv, group, head_dim = 8, 4, 128
    kc = torch.empty(64, 16, hkv, head_dim, dtype=torch.float8_e4m3fn)
    bt = torch.zeros(2, 32, dtype=torch.int32)
    lens = torch.tensor([100, 5], dtype=torch.int32)
    unit = torch.ones(1)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.empty(2, hkv * group, head_dim, dtype=dtype)
        base = attention.decode_config(head_dim, dtype, kv_dtype=kc.dtype)
        # (f16_products, packed_loads, tile shape or None for the launcher's)
        options = [(True, False, None), (True, True, None), (True, True, (64, 4, 2)),
                   (True, True, (64, 2, 2)), (True, False, (64, 2, 3)),
                   (True, False, (32, 1, 3)), (True, False, (32, 1, 4))]  # fmt: skip
        if dtype == torch.bfloat16:
            options.append((False, False, None))
        for f16, packed, shape in options:
            tile_n, warps, stages = shape or (base.tile_n, base.num_warps, base.num_stages)
            cfg = dataclasses.replace(base, tile_n=tile_n, num_warps=warps, num_stages=stages,
                                      f16_products=f16, packed_loads=packed)  # fmt: skip
            attention.paged_decode_attention(q, kc, kc, bt, lens, 0.1, 512, torch.empty_like(q),
                                             num_splits=1, config=cfg, k_scale=unit,
                                             v_scale=unit)  # fmt: skip
        # the one-warp tiles as the engine runs them: longest first
        attention.paged_decode_attention(
            q, kc, kc, bt, lens, 0.1, 2048, torch.empty_like(q), config=attention.FP8_ONE_WARP,
            k_scale=unit, v_scale=unit, seq_order=torch.tensor([1, 0], dtype=torch.int32),
        )  # fmt: skip
        for cfg in (None, attention.FP8_NARROW, attention.FP8_PLANNED_ONE_WARP):  # by plans
            _planned(q, kc, bt, lens, cfg, k_scale=unit, v_scale=unit)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        attention.paged_attention(q, kc, kc, bt, lens, cu, 0.1, torch.empty_like(q),
                                  k_scale=unit, v_scale=unit)  # fmt: skip
        # Writers of e4m3: the cache write, per-token quantization (a program per row: one
        # pass up to 16,384 columns, two beyond; and tiled), and the norms and SiLU that
        # quantize their output (SiLU a program per row and tiled).
        kv = torch.empty(8, hkv, head_dim, dtype=dtype)
        cache.reshape_and_cache(kv, kv, kc, kc, torch.zeros(8, dtype=torch.int64), unit, unit)
        for cols in (4096, 14336, 20480):
            x = torch.empty(4, cols, dtype=dtype)
            for tiled in (False, True):
                quant.quantize_fp8_per_token(x, torch.empty(4, cols, dtype=kc.dtype),
                                             torch.empty(4, 1), tiled=tiled)  # fmt: skip
        for m in (1, 16, 64, 128):  # the fp8 matmul at decode batch sizes (its default tiles)
            wq = torch.empty(6144, 4096, dtype=kc.dtype)
            for split in (0, 4):  # the launcher's split (none here: 4 stub SMs), and four
                quant.fp8_matmul(torch.empty(m, 4096, dtype=kc.dtype), torch.ones(m), wq,
                                 torch.ones(6144), torch.empty(m, 6144, dtype=dtype),
                                 quant.Fp8MatmulConfig(split_k=split))  # fmt: skip
            # the same kernel on bf16 operands (matmul_16bit; timed by bf16_stream_gemm.py)
            for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
                cfg = quant.pick_config_16bit(m, n, k, sms=132)
                quant.matmul_16bit(torch.empty(m, k, dtype=torch.bfloat16),
                                   torch.empty(n, k, dtype=torch.bfloat16),
                                   torch.empty(m, n, dtype=torch.bfloat16), cfg)  # fmt: skip
            # gate/up with SwiGLU's activation in the epilogue (GATED): fp8 with and without
            # the tile maxima of an fp8 output, and on bf16 operands
            wg = torch.empty(28672, 4096, dtype=kc.dtype)
            act = torch.empty(m, 14336, dtype=dtype)
            cfg = quant.pick_config(m, 28672, 4096, sms=132, fast_accum=True)
            for amax in (False, True):
                quant.matmul_silu_and_mul(torch.empty(m, 4096, dtype=kc.dtype),
                                          (torch.ones(m), torch.ones(28672)), wg, act, amax,
                                          cfg)  # fmt: skip
            quant.matmul_silu_and_mul(torch.empty(m, 4096, dtype=torch.bfloat16), None,
                                      torch.empty(28672, 4096, dtype=torch.bfloat16),
                                      torch.empty(m, 14336, dtype=torch.bfloat16), False,
                                      quant.pick_config_16bit(m, 28672, 4096, sms=132))  # fmt: skip
        x, w = torch.empty(8, 4096, dtype=dtype), torch.empty(4096, dtype=dtype)
        fp8_out = (torch.empty(8, 4096, dtype=kc.dtype), torch.empty(8, 1))
        fused.rms_norm(x, x, x, x, w, 1e-5, 4096, fp8_out=fp8_out)
        for method in fused.SILU_FP8_METHODS:
            fused.silu_and_mul(x, torch.empty(8, 2 * 14336, dtype=dtype), 14336,
                               fp8_out=(torch.empty(8, 14336, dtype=kc.dtype), torch.empty(8, 1)),
                               method=method)  # fmt: skip


def _report() -> None:
    print(f"triton {triton.__version__}: compiled {len(RESULTS)} variants for sm_90")
    for name, consts, info in RESULTS:
        keep = ("regs", "stack", "shared", "per_sm", "wgmma", "div_full", "compile_s")
        short = {k: info[k] for k in keep if k in info}
        print(f"{name:26s} {short} {consts}")
        if "sass" in info:
            print(f"{'':26s} SASS {info['sass']}")
    # rotary_kernel's 32-byte stack is libdevice's cosf/sinf argument reduction for huge
    # angles (a small local array, as in torch's own cos/sin), not a register spill.
    bad = [
        r for r in RESULTS
        if r[2].get("local", 0)
        or (r[2].get("stack", 0) and not (r[0].startswith("rotary") and r[2]["stack"] <= 32))
    ]  # fmt: skip
    if bad:
        print(f"{len(bad)} variants spill to local memory:", file=sys.stderr)
        for name, consts, info in bad:
            print(f"  {name} local={info.get('local', 0)} stack={info.get('stack', 0)} {consts}",
                  file=sys.stderr)  # fmt: skip
    approx = [r for r in RESULTS if r[0] in FUSED_KERNELS and r[2].get("div_full")]
    if approx:
        print(f"{len(approx)} fused-op variants use approximate division", file=sys.stderr)


if __name__ == "__main__":
    main()
