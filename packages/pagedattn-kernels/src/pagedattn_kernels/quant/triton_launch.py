"""Launchers of the quantization kernels (``triton_kernels.py``).

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernel, CPU tensors
the same kernel in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from pagedattn_kernels.common import (
    e4m3_encoder,
    is_interpreted,
    kernels_for,
    next_power_of_2,
    round_mode,
    sm_count,
    use_pdl,
)
from pagedattn_kernels.quant.torch_impl import MIN_SCALE

KERNELS = "pagedattn_kernels.quant.triton_kernels"
ONE_PASS_COLS = 16384


#: Elements per tile of the tiled kernels: compiled (4 warps, 16-byte loads of 16-bit values),
#: and at most in the interpreter, which pays per operation rather than per element.
TILE = 1024
_INTERPRETER_TILE = 1 << 16


def quantize_fp8_per_token(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor,
                           tiled: bool = False,
                           block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token e4m3 quantization of ``x [rows, cols]``: a program per row, or with ``tiled``
    the two tiled kernels (``block``: their tile width). A program per row is the default: on
    an H200, in CUDA graphs, it was faster at every shape timed, 16-1,024 rows of 4,096 and
    14,336 (512 x 14,336: 8.8 us against 12.5; ``python -m pagedkv.bench.kernels
    --gemm-only``, ``quant[]``); a row read once from memory beats two lighter reads. The
    tiled pair stays for SiLU-and-multiply, whose products are not in memory to begin with
    (``quantize_fp8_from_maxima``), and for that benchmark."""
    rows, cols = x.shape
    if rows == 0:
        return out, scale_out
    if cols == 0:
        scale_out.fill_(MIN_SCALE)
        return out, scale_out
    if tiled:
        return quantize_fp8_tiled(x, out, scale_out, block)
    kernel = kernels_for(x.device, KERNELS).quantize_fp8_per_token_kernel
    # One pass over rows up to ONE_PASS_COLS wide, held in registers (16 warps: at most 32
    # float32 values per thread); longer rows in chunks of 2048 columns, read twice.
    whole = next_power_of_2(cols)
    one_pass = whole <= ONE_PASS_COLS
    block = whole if one_pass else 2048
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    pdl = use_pdl(x.device)
    kernel[(rows,)](
        x, out, scale_out, cols, x.stride(0), out.stride(0), MIN_SCALE,
        BLOCK=block, ONE_PASS=one_pass, E4M3=e4m3_encoder(kernel, x.device), PDL=pdl,
        launch_pdl=pdl, num_warps=warps,
    )  # fmt: skip
    return out, scale_out


def tile_shape(rows: int, cols: int, interpreted: bool,
               block: int | None = None) -> tuple[int, int]:  # fmt: skip
    """``(ROWS, BLOCK)`` of the tiled kernels over ``[rows, cols]``: ``TILE`` elements
    (``BLOCK`` columns, the whole row when shorter); in the interpreter up to 4,096 columns and
    ``_INTERPRETER_TILE`` elements. Compiled, ROWS does not follow the row count, which changes
    with every batch (each ROWS is another compiled kernel)."""
    if not interpreted:
        block = block or min(next_power_of_2(cols), TILE)
        return max(1, TILE // block), block
    block = block or min(next_power_of_2(cols), 4096)
    return min(next_power_of_2(rows), max(1, _INTERPRETER_TILE // block)), block


def quantize_fp8_tiled(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor,
                       block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token e4m3 quantization in two tiled kernels: each tile's largest magnitude per row
    (``row_chunk_amax_kernel``), then the tiles quantized (``quantize_fp8_from_maxima``)."""
    kernels = kernels_for(x.device, KERNELS)
    rows, cols = x.shape
    tile_rows, block = tile_shape(rows, cols, is_interpreted(kernels.row_chunk_amax_kernel), block)
    chunks = -(-cols // block)
    partial = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x.device)
    kernels.row_chunk_amax_kernel[(-(-rows // tile_rows), chunks)](
        x, partial, rows, cols, x.stride(0), chunks, ROWS=tile_rows, BLOCK=block, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return quantize_fp8_from_maxima(x, partial, out, scale_out, block)


def quantize_fp8_from_maxima(x: torch.Tensor, partial: torch.Tensor, out: torch.Tensor,
                             scale_out: torch.Tensor,
                             block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``quantize_fp8_tiles_kernel``: ``x [rows, cols]`` to e4m3 with each row's scale from its
    largest magnitude, given as ``partial [rows, chunks]`` float32 maxima of parts of the row
    (any split: their maximum is the row's)."""
    kernel = kernels_for(x.device, KERNELS).quantize_fp8_tiles_kernel
    rows, cols = x.shape
    chunks = partial.shape[1]
    tile_rows, block = tile_shape(rows, cols, is_interpreted(kernel), block)
    pdl = use_pdl(x.device)
    kernel[(-(-rows // tile_rows), -(-cols // block))](
        x, partial, out, scale_out, rows, cols, x.stride(0), out.stride(0), MIN_SCALE,
        CHUNKS=chunks, CHUNKS_P2=next_power_of_2(chunks), ROWS=tile_rows, BLOCK=block,
        E4M3=e4m3_encoder(kernel, x.device), PDL=pdl, launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return out, scale_out


@dataclass(frozen=True, slots=True)
class Fp8MatmulConfig:
    """Tiles of ``fp8_matmul_kernel``: ``block_n`` weight rows (the tensor-core tile's M
    side: 64 or 128 for wgmma) and ``block_k`` columns per step; ``split_k`` 0 picks the
    split that fills the SMs (``auto_split``). ``merge_here``: a split matmul's last split
    per tile sums the partials (the kernel's MERGE_HERE), else a second kernel does.
    ``promote``: exact float32 accumulation (the kernel's PROMOTE), else the tensor cores'
    fast accumulation, as ``torch._scaled_mm(use_fast_accum=True)``."""

    block_n: int = 128
    block_k: int = 128
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    merge_here: bool = True
    promote: bool = True


#: Most tokens per tile (the wgmma's N side, which goes to 256): 65-128 rows in one tile read
#: the weights once instead of twice.
MAX_BLOCK_M = 128
_INTERPRETER_CONFIG = Fp8MatmulConfig(block_n=32, block_k=64, num_stages=1)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


@functools.lru_cache(maxsize=1024)  # called per matmul: the few shapes of a model, per row count
def pick_config(m: int, n: int, k: int, sms: int, fast_accum: bool = False) -> Fp8MatmulConfig:
    """The tiles for an ``[m, k] x [n, k]`` matmul, from the H200 sweep of
    ``scripts/fp8_weight_only_gemm.py`` over Llama-3-8B's four linear shapes at 16-128 rows
    (f534e71). At these sizes the weights stream through once, and what decides the speed is
    how long each program streams: short programs (split-K into 4-8 steps of K each, to fill
    the SMs) spend their time filling and draining the pipeline. So:

    - enough 128-row tiles to fill the SMs (gate/up, 28,672 rows: 224 tiles on 132 SMs): no
      split, 4 stages (16 rows: 31.6 us against 40.7 with split 4, 91% of the copy bandwidth);
    - long K on few tiles (down, K = 14,336): 64-row tiles, 256 bytes of K a step, split
      ``auto_split`` (16 rows: 18.9 against 22.2 us);
    - else (Q/K/V, O): 64-row tiles, no split, 8 stages in flight (6 when a tile holds more
      than 64 tokens, whose shared memory is twice as large): 8.9 against 16.3 us for Q/K/V.

    A decoder layer's four matmuls at 16 rows: 67 us against 90 for the single config before
    (``Fp8MatmulConfig()``) and 123 for bf16 ``F.linear``.

    Up to 32 rows (a tile of at most 32 tokens; ``scripts/fp8_weight_only_gemm.py --swap-set
    pick``, 2d09a7d, and the refine sweep of 6d1d2a1): 64-row tiles of 256 bytes of K, no
    split, for gate/up (4 stages: 31.1 us at 16 rows and 32.0-32.2 at 24-32, where the 128-row
    tiles took 33.9-34.2; at 8-16 rows they took 43.3 in that sweep and 30.3 in 6d1d2a1's:
    their 224 tiles leave 92 SMs two of them and 40 one, a balance the 448 smaller tiles do not
    depend on), down (8 stages: 16.8 against 18.3 at 16 rows) and the output projection's square
    shape (6 stages: 6.5 against 7.1); Q/K/V keeps its tiles. 8 stages of 256 bytes would not
    fit the shared memory with 64-token tiles."""
    promote = not fast_accum
    if m <= 32 and (n >= 128 * sms or k >= 2 * n or n == k):
        stages = 4 if n >= 128 * sms else 8 if k >= 2 * n else 6
        return Fp8MatmulConfig(64, 256, 1, 4, stages, promote=promote)
    if n >= 128 * sms:
        return Fp8MatmulConfig(128, 128, 1, 4, 4, promote=promote)
    if k >= 2 * n:
        return Fp8MatmulConfig(64, 256, 0, 4, 4, promote=promote)
    return Fp8MatmulConfig(64, 128, 1, 4, 8 if m <= 64 else 6, promote=promote)


def _merge_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 counts of ``fp8_matmul_kernel``'s MERGE_HERE, one per output tile,
    kept per device (each kernel leaves them zero). None while a CUDA graph is being captured
    and they are missing or too few: an allocation there would belong to the graph's pool.
    One split matmul at a time per device: the engine's matmuls run on one stream."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        have = torch.zeros(max(4096, next_power_of_2(tiles)), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def auto_split(tiles: int, k_iters: int, sms: int, max_split: int = 16) -> int:
    """The split-K (a power of 2 up to ``max_split``, at least 4 K steps per split) whose
    ``tiles * split`` programs fill whole waves of the SMs best (one program per SM
    assumed); the smaller on a tie."""
    splits = [s for s in (1, 2, 4, 8, 16) if k_iters >= 4 * s and s <= max_split] or [1]
    return max(splits, key=lambda s: (tiles * s / (-(-tiles * s // sms) * sms), -s))


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
               w_scale: torch.Tensor, out: torch.Tensor, config: Fp8MatmulConfig | None = None,
               fast_accum: bool = False) -> torch.Tensor:  # fmt: skip
    """``config`` None: ``pick_config`` for this shape (the interpreter: small tiles, one
    stage); ``fast_accum`` only matters then (a given config says ``promote`` itself)."""
    return _swapped_matmul(xq, (x_scale, w_scale), wq, out, config, fast_accum)


@functools.lru_cache(maxsize=1024)
def pick_config_16bit(m: int, n: int, k: int, sms: int) -> Fp8MatmulConfig:
    """``pick_config``'s tiles for 16-bit operands: the same bytes of K a step (half the
    columns), no promotion (bf16 and fp16 MMAs accumulate in float32 already). A starting
    point that the H200 sweep of ``scripts/bf16_stream_gemm.py`` (9b846dc) kept: at 1-32 rows,
    for each of Llama-3-8B's four shapes, the fastest of the ten configs tried or within 1.5%
    of it; at 48-64 rows up to 12% slower (the output projection)."""
    cfg = pick_config(m, n, k, sms)
    return dataclasses.replace(cfg, block_k=cfg.block_k // 2, promote=False)


def matmul_16bit(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                 config: Fp8MatmulConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``out = x @ w.T`` for bf16 or fp16 ``x [M, K]`` and ``w [N, K]`` (unit stride along K),
    by ``fp8_matmul_kernel`` without scales (SCALED False): the weight rows on the tensor-core
    tile's long side, the few tokens on its short side, split K merged by the last split
    (``ops.matmul_16bit``). ``config`` None: ``pick_config_16bit`` (the interpreter: small
    tiles, one stage)."""
    return _swapped_matmul(x, None, w, out, config)


def matmul_silu_and_mul(xq: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                        wq: torch.Tensor, out: torch.Tensor, amax: bool,
                        config: Fp8MatmulConfig | None,
                        fast_accum: bool = False) -> torch.Tensor | None:  # fmt: skip
    """``fp8_matmul_kernel`` with GATED: ``out [M, I] = silu(gate) * up`` of the fused gate/up
    projection ``xq @ wq.T`` (``wq [2 I, K]``), scaled by ``scales`` as ``fp8_matmul`` or
    unscaled (None) as ``matmul_16bit``. With ``amax``, returns each tile's largest magnitude
    per token (``[M, tiles]`` float32, for ``quantize_fp8_from_maxima``), else None. The
    tiles are the plain matmul's for the same shape, never split (a product's gate and up
    are summed in one program)."""
    return _swapped_matmul(xq, scales, wq, out, config, fast_accum, gated=True, amax=amax)


def _config(m: int, n: int, k: int, device: torch.device, scaled: bool,
            config: Fp8MatmulConfig | None, fast_accum: bool) -> Fp8MatmulConfig:  # fmt: skip
    """The tiles of one launch: ``config``, the interpreter's, or the pick for the shape."""
    if config is not None:
        return config
    kernel = kernels_for(device, KERNELS).fp8_matmul_kernel
    if is_interpreted(kernel):
        return _INTERPRETER_CONFIG
    sms = sm_count(device)
    return pick_config(m, n, k, sms, fast_accum) if scaled else pick_config_16bit(m, n, k, sms)


def _swapped_matmul(xq: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                    wq: torch.Tensor, out: torch.Tensor, config: Fp8MatmulConfig | None,
                    fast_accum: bool = False, gated: bool = False,
                    amax: bool = False) -> torch.Tensor | None:  # fmt: skip
    """One launch of ``fp8_matmul_kernel`` (and of its reduce kernel when a split matmul
    cannot merge in place): scaled by ``scales`` = (x_scale, w_scale), or unscaled (None);
    ``gated``: SwiGLU's activation of the projection (:func:`matmul_silu_and_mul`, which
    returns its tile maxima with ``amax``)."""
    m, k = xq.shape
    n = wq.shape[0]
    if m == 0 or n == 0:
        return (torch.empty(m, 0, device=xq.device) if amax else None) if gated else out
    if k == 0 and not gated:
        return out.zero_()
    kernels = kernels_for(xq.device, KERNELS)
    interpreted = is_interpreted(kernels.fp8_matmul_kernel)
    sms = sm_count(xq.device)
    cfg = _config(m, n, k, xq.device, scales is not None, config, fast_accum)
    block_m = min(MAX_BLOCK_M, max(16, next_power_of_2(m)))
    # A 128 x 128 float32 accumulator over 4 warps would take 128 registers a thread.
    num_warps = cfg.num_warps if block_m <= 64 or interpreted else max(cfg.num_warps, 8)
    # gated: a tile of block_n weight rows makes block_n / 2 products
    grid_mn = (-(-m // block_m), -(-(n // 2 if gated else n) // (cfg.block_n // (1 + gated))))
    k_iters = -(-k // cfg.block_k)
    # fp32 partials (split * M * N * 4 bytes) at most 1/8 of the e4m3 weights (N * K)
    if gated:
        split = 1
    else:
        split = cfg.split_k or auto_split(grid_mn[0] * grid_mn[1], k_iters, sms,
                                          max(1, k // (32 * m)))  # fmt: skip
    k_chunk = -(-k_iters // split) * cfg.block_k
    x_scale, w_scale = (s.reshape(-1) for s in scales) if scales is not None else (out, out)
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    counters = None
    if split > 1 and cfg.merge_here:
        counters = _merge_counters(xq.device, grid_mn[0] * grid_mn[1])
    if gated and amax:
        part = torch.empty(m, grid_mn[1], dtype=torch.float32, device=xq.device)
    pdl = use_pdl(xq.device)
    kernels.fp8_matmul_kernel[(*grid_mn, split)](
        out, part, counters if counters is not None else part, xq, x_scale, wq, w_scale,
        m, n, k, k_chunk, split, xq.stride(0), wq.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=block_m, BLOCK_K=cfg.block_k, SPLIT=split > 1,
        MERGE_HERE=counters is not None, EVEN_K=k % cfg.block_k == 0, UPCAST=interpreted,
        PROMOTE=cfg.promote and scales is not None, PDL=pdl, launch_pdl=pdl,
        SCALED=scales is not None, GATED=gated, ROUND=round_mode(out.dtype, interpreted),
        LIBDEVICE=not interpreted, AMAX=gated and amax, num_warps=num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=not gated,
    )  # fmt: skip
    if split > 1 and counters is None:
        kernels.fp8_matmul_reduce_kernel[(-(-(m * n) // 1024),)](
            out, part, x_scale, w_scale, m * n, n, split, out.stride(0), BLOCK=1024,
            PDL=pdl, launch_pdl=pdl, SCALED=scales is not None,
        )  # fmt: skip
    if gated:
        return part if amax else None
    return out
