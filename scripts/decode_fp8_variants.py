"""Why does paged decode on an fp8 cache run at 46% of the copy bandwidth? A diagnosis (issue 20).

On an H200 the 16-bit decode kernel reads K/V at 96-100% of the copy bandwidth, the fp8 one at
33-48% whatever the tiles (``docs/performance/kernels.json``, ``sweep_decode_fp8``): half the
bytes take longer than the 16-bit kernel's. The shipped kernel converts each e4m3 tile to the
query's dtype in registers before ``tl.dot``. This script times minimal decode kernels (one
program per sequence and KV head, batch 64 x 4k context, 32/8 heads of 128) that differ in that
one step:

  bf16        16-bit cache, no conversion (the bandwidth the fp8 ones should double)
  cvt         e4m3 tiles converted to bf16 in registers (what the shipped kernel does)
  cvt_f16     e4m3 tiles converted to float16, the query in float16 (exact: e4m3 and these bf16
              queries fit float16): sm_90 converts e4m3 to float16 with one packed F2FP per
              two values, to bf16 through float16 with a further F2F per value
  bits_f16    e4m3 bytes widened to float16 with integer shifts (exact: the value times 2^-8,
              folded into the scales), the query in float16
  fp8_mma     no conversion: the query (per row) and the probabilities quantized to e4m3 and
              multiplied on fp8 tensor cores, as FlashAttention-3 does for fp8 caches (costs
              accuracy: ``rel_err`` against the bf16 kernel)
  packed_asm  the tiles loaded as int32 words, four e4m3 each, widened to float16 in registers
              by the hardware's packed conversion (inline ``cvt.rn.f16x2.e4m3x2``), the
              query in float16: no byte-wise shared-memory reads (below)
  packed_bits the same words widened with integer shifts (runs in the interpreter)
  packed_pf   packed_asm with the next tile's words loaded an iteration ahead straight into
              registers (and ``packed_bits_pf``, the interpreter's): the shipped kernel's
              packed loads measured slower than its byte loads (46.7% against 63.8% of the
              copy bandwidth at 64 x 4k); packed_asm stages its words through shared memory
              (cp.async, LDGSTS) and widens them from there, this variant skips that staging
              and overlaps the loads by hand (plain LDG in the sm_90 SASS)
  vt_f16      V cached transposed within each block ([blocks, kv_heads, dim, block], the layout
              of vLLM's first value cache), so P.V finds consecutive keys side by side: K as
              cvt_f16's, V^T loaded as it lies and converted to float16
  vt_a        the same cache, O^T = V^T P^T with V^T the A operand (wgmma on sm_90)
  fma         no ``tl.dot``: e4m3 tiles converted to float32 and multiplied on CUDA cores
              (broadcast products and sums, per query head), float32 softmax and accumulator
  fma_ev      fma with the V tile loaded together with K, before the scores ("early V")
  fma_pf      fma with the next tile's K and V loaded one iteration ahead into registers
  fma_bf16    fma on the bf16 cache (and ``fma_bf16_ev``, ``fma_bf16_pf``): does the CUDA-core
              kernel reach the bandwidth at all?
  shipped     ``pagedattn_kernels.paged_decode_attention`` on the fp8 cache

Every fp8 variant takes about as long as the bf16 one on half the bytes (H200: bf16 91-102% of
the copy bandwidth, cvt 48-53%, bits_f16 41-49%, fp8_mma 58-67%). The hypothesis the ``fma``
variants test: ``tl.dot`` with G = 4 real query rows (padded to 16) routes the tiles through
shared memory into the MMA operand layout, and that staging, not the conversion arithmetic,
bounds the kernel; vLLM's original paged-attention kernels computed decode scores on CUDA
cores. If ``fma`` reads fp8 faster than ``cvt`` (and ``fma_bf16`` stays near the bandwidth),
the dot staging is the cost; if ``fma`` is no faster while ``fma_bf16`` is fast, the e4m3 tile
itself (its loads or conversion) is. Caveat: on fp8 the CUDA-core kernel issues about as many
instructions per byte as an SM can issue at the full bandwidth (``decode_fma_kernel``), so a
slow ``fma`` alone does not refute the hypothesis.

What the sm_90 SASS shows (offline compiles with Triton 3.6 and 3.9, tile 128, 4 warps, 2
stages; no GPU needed): every dot variant stages K and V through shared memory by cp.async
(LDGSTS), bf16 included; bf16 then reads the operands with ldmatrix (LDSM), while the e4m3
variants read them back byte by byte (128 LDS.U8 per thread and tile). ``cvt`` then converts
each value twice, e4m3 -> float16 (packed F2FP) -> bf16 (one F2F per value, a conversion-pipe
instruction); ``fp8_mma`` never reaches fp8 tensor cores on sm_90 (16-row tiles take
Triton's mma.sync path, not wgmma, and Triton widens fp8 operands there): they are unpacked
to float16 for an f16 HMMA, i.e. ``cvt_f16`` plus the quantization. ``cvt_f16`` vs ``cvt``
isolates the F2F; the ``fma`` rows drop the staging, the byte loads and the F2F at once.

The byte loads are V's. Q.K^T takes K's rows as they lie (head dim contiguous: LDS.64 of 8
bytes), but P.V needs pairs of consecutive keys in each register, and sm_90 has no transposing
ldmatrix for bytes, so an e4m3 V tile is read one byte per LDS.U8. ``cvt_f16`` measured 67%
with 196 registers (8 warps per SM) and 810 instructions per warp and tile (Triton 3.6 offline
compile). Loaded as words and widened first (``packed_asm``), V is stored to shared memory
as float16 and read by ldmatrix.trans as a 16-bit cache is: no LDS.U8, 127 registers (12
warps per SM), 677 instructions (494 with Triton 3.9); measured 51-68%, no faster.

Nor is the byte-wise read of V the bound: transposed in the cache (``vt_f16``), V is read
back by LDS.64, no LDS.U8, in 115 registers and 591 instructions a tile (cvt_f16: 196 and
810), yet it measured 66-70% at 64 x 4k and 58-65% at 256 x 512, as cvt_f16 (67-72%, 58-63%)
and the shipped kernel (72.9%, 63.2%); ``vt_a`` the same (H200, 2026-12-02, 119317a). What
the fp8 variants share is half the bytes per tile for the same per-tile critical path (wait
for the tile, convert, score, softmax, accumulate) at the same 16 warps per SM: at 64 x 4k
each program spends 5.8 us a tile (bf16 8.9 us for twice the bytes), about 0.8 instructions
per cycle per SM, far below what an SM issues. The kernel is bound by that path's latency,
not by any one instruction kind; more bytes in flight per SM is what would help. (The
eighth session's key-major value cache in the shipped kernel found the same: 58.9% against
66.3%, ``docs/packages/pagedattn-kernels.md``.)

    python scripts/decode_fp8_variants.py --output-json OUT.json       # on a GPU
    TRITON_INTERPRET=1 python scripts/decode_fp8_variants.py --check   # CPU: outputs only
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import triton
import triton.language as tl
from variant_cli import add_common_args, check_or_gpu, copy_bandwidth_tbps, write_result

from pagedattn_kernels.attention.triton_kernels import _e4m3_words_to_f16

log = logging.getLogger("decode_fp8_variants")

(BF16, CVT, BITS_F16, FP8_MMA, CVT_F16, FMA, PACKED_BITS, PACKED_ASM, PACKED_PF, PACKED_BITS_PF,
 VT_F16, VT_A) = range(12)  # fmt: skip
MODES = {"bf16": BF16, "cvt": CVT, "bits_f16": BITS_F16, "fp8_mma": FP8_MMA, "cvt_f16": CVT_F16,
         "packed_bits": PACKED_BITS, "packed_asm": PACKED_ASM, "packed_pf": PACKED_PF,
         "packed_bits_pf": PACKED_BITS_PF, "vt_f16": VT_F16, "vt_a": VT_A}  # fmt: skip
VT = (VT_F16, VT_A)  # V cached transposed within each block: [blocks, kv_heads, dim, block]
PACKED = (PACKED_BITS, PACKED_ASM, PACKED_PF, PACKED_BITS_PF)
# CUDA-core variants (``decode_fma_kernel``): name -> (16-bit cache?, AHEAD)
FMA_MODES = {"fma": (False, 0), "fma_ev": (False, 1), "fma_pf": (False, 2),
             "fma_bf16": (True, 0), "fma_bf16_ev": (True, 1), "fma_bf16_pf": (True, 2)}  # fmt: skip
MODES.update(dict.fromkeys(FMA_MODES, FMA))


def cache_itemsize(mode: str) -> int:
    """Bytes per cached element the variant reads (the bandwidth is counted in these)."""
    return 2 if mode == "bf16" or (mode in FMA_MODES and FMA_MODES[mode][0]) else 1


@triton.jit
def _widen(t, MODE: tl.constexpr):
    """A K or V tile as loaded, in the dtype the products take."""
    if MODE == 1:
        t = t.to(tl.bfloat16)
    elif MODE == 2:  # e4m3 byte -> float16 bits: sign to bit 15, exponent+mantissa shifted by 7
        b = t.to(tl.uint8, bitcast=True).to(tl.uint16)
        t = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    elif MODE == 4:
        t = t.to(tl.float16)
    return t


@triton.jit
def _halves(w):
    """The two float16 values packed in each int32 of ``w`` (low half, high half)."""
    return ((w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
            ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True))  # fmt: skip


@triton.jit
def _unpack(w, HEAD_DIM: tl.constexpr, MODE: tl.constexpr):
    """A [TILE_N, HEAD_DIM] float16 tile from the [TILE_N, HEAD_DIM // 4] int32 words that
    hold its e4m3 bytes (byte j of word i is element 4 i + j, little-endian).

    PACKED_ASM: the shipped kernel's helper (``_e4m3_words_to_f16``: the hardware's packed
    conversion, two e4m3 per ``cvt.rn.f16x2.e4m3x2``; sm_89+, no interpreter). PACKED_BITS:
    integer shifts on whole words, two bytes at a time (each fp16 value is the e4m3 value
    times 2^-8, folded into the scales as in ``bits_f16``). Either way the bytes reach
    registers as words, never one by one."""
    if MODE == 7 or MODE == 8:
        t = _e4m3_words_to_f16(w, True)
    else:
        u = w.to(tl.uint32, bitcast=True)
        even = ((u & 0x007F007F) << 7) | ((u & 0x00800080) << 8)  # bytes 0 and 2
        odd = (((u >> 8) & 0x007F007F) << 7) | (((u >> 8) & 0x00800080) << 8)  # bytes 1, 3
        b0, b2 = _halves(even)
        b1, b3 = _halves(odd)
        # join(join(b0, b2), join(b1, b3))[i, k, j] is byte 2 k + j of word i
        t = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [w.shape[0], HEAD_DIM])
    return t


@triton.jit
def _tile(cache, words, off, d, d4, HEAD_DIM: tl.constexpr, MODE: tl.constexpr):
    """One K or V tile as the products take it: loaded by element, or (PACKED) by int32
    word, 4 e4m3 values each (``off`` is in bytes then, a multiple of 4)."""
    if MODE == 6 or MODE == 7:
        t = _unpack(tl.load(words + (off // 4)[:, None] + d4[None, :]), HEAD_DIM, MODE)
    else:
        t = _widen(tl.load(cache + off[:, None] + d[None, :]), MODE)
    return t


@triton.jit
def _word_offsets(bt, pos, head_off, stride_blk, stride_tok, d4, BLOCK_SIZE: tl.constexpr):
    """int32-word offsets ``[len(pos), HEAD_DIM // 4]`` of the K or V rows at context positions
    ``pos`` (block table ``bt``; strides in bytes, multiples of 4)."""
    off = tl.load(bt + pos // BLOCK_SIZE) * stride_blk + (pos % BLOCK_SIZE) * stride_tok
    return ((off + head_off) // 4)[:, None] + d4[None, :]


@triton.jit
def decode_variant_kernel(
    out_ptr, q_ptr, k_cache, v_cache, block_tables, seq_len, scale_log2, v_scale,
    stride_q_seq, stride_q_head, stride_blk, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (sequences, KV heads): the G query heads of one KV head over the whole context
    (every sequence ``seq_len`` tokens, a multiple of TILE_N). UPCAST: the interpreter, whose
    dot multiplies neither bfloat16 nor fp8 (numpy has neither): the operands go to float32
    first, which holds their values exactly."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    d4 = tl.arange(0, HEAD_DIM // 4)
    k_words = k_cache.to(tl.pointer_type(tl.int32))
    v_words = v_cache.to(tl.pointer_type(tl.int32))
    heads = kv_head * G + g
    q_off = seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None], other=0.0)
    if MODE == 2 or MODE == 4 or MODE == 6 or MODE == 7 or MODE >= 8:
        q = q.to(tl.float16)
    K_MODE: tl.constexpr = 4 if MODE >= 10 else MODE  # VT_*: K as cvt_f16's
    if MODE == 3:  # per-row e4m3 scale of the query; scores come back times q_scale
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1) / 448.0, 1e-12)
        q = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    if MODE == 11:
        acc = tl.full([HEAD_DIM, BLOCK_G], 0.0, tl.float32)  # transposed: O^T = V^T P^T
    else:
        acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    bt = block_tables + seq * stride_bt
    if MODE == 8 or MODE == 9:  # the first tile's words, before the loop
        w_off = _word_offsets(bt, tl.arange(0, TILE_N), kv_head * stride_head, stride_blk,
                              stride_tok, d4, BLOCK_SIZE)  # fmt: skip
        kw_next = tl.load(k_words + w_off)
        vw_next = tl.load(v_words + w_off)
    for start in range(0, seq_len, TILE_N):
        if MODE == 8 or MODE == 9:
            # Words loaded an iteration ahead (a register double buffer, no shared-memory
            # staging); the last iteration reloads the last tile instead of masking.
            kw = kw_next
            vw = vw_next
            pos = tl.minimum(start + TILE_N, seq_len - TILE_N) + tl.arange(0, TILE_N)
            w_off = _word_offsets(bt, pos, kv_head * stride_head, stride_blk, stride_tok, d4,
                                  BLOCK_SIZE)  # fmt: skip
            kw_next = tl.load(k_words + w_off)
            vw_next = tl.load(v_words + w_off)
            k = _unpack(kw, HEAD_DIM, MODE)
        else:
            pos = start + tl.arange(0, TILE_N)
            blk = tl.load(bt + pos // BLOCK_SIZE)
            off = blk * stride_blk + (pos % BLOCK_SIZE) * stride_tok + kv_head * stride_head
            k = _tile(k_cache, k_words, off, d, d4, HEAD_DIM, K_MODE)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MODE == 3:
            s = s * q_scale[:, None]
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 8 or MODE == 9:
            v = _unpack(vw, HEAD_DIM, MODE)
        elif MODE >= 10:
            # V^T [HEAD_DIM, TILE_N]: each row runs along the keys, BLOCK_SIZE bytes at a time
            vt_off = blk * stride_blk + kv_head * (HEAD_DIM * BLOCK_SIZE) + pos % BLOCK_SIZE
            v = tl.load(v_cache + vt_off[None, :] + (d * BLOCK_SIZE)[:, None]).to(tl.float16)
            if MODE == 10:
                v = tl.trans(v)
        else:
            v = _tile(v_cache, v_words, off, d, d4, HEAD_DIM, MODE)
        if MODE == 3:
            p = p.to(tl.float8e4nv)  # p in [0, 1]: e4m3 keeps 3 mantissa bits
        else:
            p = p.to(v.dtype)
        if MODE == 11 and UPCAST:
            acc = tl.dot(v.to(tl.float32), tl.trans(p).to(tl.float32), acc * alpha[None, :],
                         input_precision="ieee")
        elif MODE == 11:
            acc = tl.dot(v, tl.trans(p), acc * alpha[None, :])
        elif UPCAST:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None],
                         input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    if MODE == 11:
        acc = tl.trans(acc)
    out = acc * v_scale / l_i[:, None]
    o_off = seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


@triton.jit
def _carried(t):
    """A prefetched tile as the loop carries it: e4m3 as float16 (exact; one packed convert it
    needs anyway), since a loop-carried e4m3 tile costs byte permutes (PRMT) every iteration
    in the sm_90 SASS (~20% more loop instructions); 16-bit tiles as loaded."""
    if t.dtype == tl.float8e4nv:
        t = t.to(tl.float16)
    return t


@triton.jit
def decode_fma_kernel(
    out_ptr, q_ptr, k_cache, v_cache, block_tables, seq_len, scale_log2, v_scale,
    stride_q_seq, stride_q_head, stride_blk, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    ROWS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """Decode without ``tl.dot``: the same grid and problem as ``decode_variant_kernel``, the
    products on CUDA cores in float32 (exact for e4m3 and bf16 inputs).

    Shape, chosen from offline sm_90 compiles (TTGIR and SASS with Triton 3.6, which the H200
    runs used, and 3.9; no GPU needed): a K or V tile keeps the layout its coalesced load
    gets (16 bytes per thread along HEAD_DIM, the remaining lanes and the warps along the
    keys), viewed as [TILE_N // ROWS, ROWS, HEAD_DIM] with key
    j * ROWS + r. Each of the ROWS key columns r keeps its own online softmax (m, l, acc) for
    every query head, merged once after the loop as split-K decode merges its splits: when
    ROWS matches the rows the load spreads over lanes and warps (``run`` computes it), the
    loop has no shared memory, no barrier, and only the HEAD_DIM reduction of the scores
    crosses lanes (shuffles among the 8-16 lanes of a row). The products go one query head at
    a time (``tl.static_range``), each head's state in a tuple, so every tensor keeps the
    tile's layout. Rejected: one [G, TILE_N, HEAD_DIM] broadcast (Triton gives the product a
    default layout with HEAD_DIM over all lanes and warps, converts each tile into it through
    shared memory and reduces the scores across warps: hundreds of shuffles and shared
    stores per tile, 255 registers and spills at TILE_N 64), and [G, ...] state merged per
    head with ``tl.where`` (cross-warp reductions and layout conversions, i.e. barriers, per
    head and tile).

    Cost: per K or V value a thread issues ~8-9 instructions at fp8, ~10-11 at bf16 (4 FMAs
    for the 4 heads, the conversion, shuffles, softmax; the sm_90 loop at TILE_N 32, 4 warps:
    553 and 657 per warp and tile under Triton 3.6). At the H200's copy bandwidth (4.15 TB/s,
    ~16 B per SM and clock) an SM can issue ~0.25 instructions per byte: fp8 needs about all
    of it (0.27), bf16 ~65% (0.16); the dot kernels need 0.02 (bf16), 0.10 (``cvt_f16``,
    ``fp8_mma``), 0.15 (``cvt``), 0.25 (``bits_f16``). So compare ``fma`` and ``fma_bf16`` in
    microseconds: the same arithmetic per value on half the bytes.

    AHEAD: 0 loads V after the softmax; 1 loads V with K, before the scores (both tiles in
    flight at once); 2 also loads the next tile's K and V an iteration ahead (a register
    double buffer; the last iteration reloads the last tile instead of masking). Triton's
    software pipeliner only stages loads that feed ``tl.dot``, so num_stages does nothing
    here and AHEAD is the only way to ask for more than one tile in flight per program. Only
    ask: ptxas schedules the loads itself. In the sm_90 SASS at TILE_N 32 and 4 warps, AHEAD
    0 already issues the V loads next to K's at the top of the loop (for bf16 earlier than
    AHEAD 1 does), and AHEAD 2's next-tile loads sink below the score products (fp8: they
    still overlap the softmax and P.V) or to the loop's end (bf16: little overlap); a
    ``tl.debug_barrier()`` after them does not pin them."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    J: tl.constexpr = TILE_N // ROWS
    q_row = q_ptr + seq.to(tl.int64) * stride_q_seq + kv_head * G * stride_q_head
    # Per query head: q [1, 1, HEAD_DIM] float32 and the softmax state of each key column.
    # Tuples grow by concatenation: Triton's code generator rejects `(*t, x)` (RUF005), which
    # only the interpreter accepts.
    qs = ()
    ms = ()
    ls = ()
    accs = ()
    for i in tl.static_range(G):
        q = tl.load(q_row + i * stride_q_head + d).to(tl.float32)
        qs = qs + (tl.reshape(q, [1, 1, HEAD_DIM]),)  # noqa: RUF005
        ms = ms + (tl.full([ROWS], float("-inf"), tl.float32),)  # noqa: RUF005
        ls = ls + (tl.full([ROWS], 0.0, tl.float32),)  # noqa: RUF005
        accs = accs + (tl.full([ROWS, HEAD_DIM], 0.0, tl.float32),)  # noqa: RUF005
    bt = block_tables + seq * stride_bt
    head_off = kv_head * stride_head
    if AHEAD == 2:
        pos = tl.arange(0, TILE_N)
        off = tl.load(bt + pos // BLOCK_SIZE) * stride_blk + (pos % BLOCK_SIZE) * stride_tok
        k_next = _carried(tl.load(k_cache + (off + head_off)[:, None] + d[None, :]))
        v_next = _carried(tl.load(v_cache + (off + head_off)[:, None] + d[None, :]))
    for start in range(0, seq_len, TILE_N):
        if AHEAD == 2:
            k = k_next
            v = v_next
            pos = tl.minimum(start + TILE_N, seq_len - TILE_N) + tl.arange(0, TILE_N)
            off = tl.load(bt + pos // BLOCK_SIZE) * stride_blk + (pos % BLOCK_SIZE) * stride_tok
            k_next = _carried(tl.load(k_cache + (off + head_off)[:, None] + d[None, :]))
            v_next = _carried(tl.load(v_cache + (off + head_off)[:, None] + d[None, :]))
        else:
            pos = start + tl.arange(0, TILE_N)
            off = tl.load(bt + pos // BLOCK_SIZE) * stride_blk + (pos % BLOCK_SIZE) * stride_tok
            k = tl.load(k_cache + (off + head_off)[:, None] + d[None, :])
            if AHEAD == 1:
                v = tl.load(v_cache + (off + head_off)[:, None] + d[None, :])
        k3 = tl.reshape(k.to(tl.float32), [J, ROWS, HEAD_DIM])
        ps = ()
        alphas = ()
        new_ms = ()
        new_ls = ()
        for i in tl.static_range(G):
            s = tl.sum(k3 * qs[i], 2) * scale_log2  # [J, ROWS], log2 units
            m_new = tl.maximum(ms[i], tl.max(s, 0))
            p = tl.exp2(s - m_new[None, :])
            alpha = tl.exp2(ms[i] - m_new)
            new_ms = new_ms + (m_new,)  # noqa: RUF005
            new_ls = new_ls + (ls[i] * alpha + tl.sum(p, 0),)  # noqa: RUF005
            ps = ps + (p,)  # noqa: RUF005
            alphas = alphas + (alpha,)  # noqa: RUF005
        ms = new_ms
        ls = new_ls
        if AHEAD == 0:
            v = tl.load(v_cache + (off + head_off)[:, None] + d[None, :])
        v3 = tl.reshape(v.to(tl.float32), [J, ROWS, HEAD_DIM])
        new_accs = ()
        for i in tl.static_range(G):
            pv = tl.sum(ps[i][:, :, None] * v3, 0)  # [ROWS, HEAD_DIM]
            new_accs = new_accs + (accs[i] * alphas[i][:, None] + pv,)  # noqa: RUF005
        accs = new_accs
    out_row = out_ptr + seq.to(tl.int64) * stride_q_seq + kv_head * G * stride_q_head
    for i in tl.static_range(G):  # merge the key columns (once, across lanes and warps)
        m = tl.max(ms[i], 0)
        w = tl.exp2(ms[i] - m)
        o = tl.sum(accs[i] * w[:, None], 0) * (v_scale / tl.sum(ls[i] * w, 0))
        tl.store(out_row + i * stride_q_head + d, o.to(out_ptr.dtype.element_ty))


class Problem:
    """Batch x context of random K/V in shuffled blocks of 16, bf16 and its e4m3 copy (unit
    scales); the bf16 copy holds the e4m3 values, so every variant attends the same numbers."""

    def __init__(self, batch: int, context: int, device: str, heads: int = 32,
                 kv_heads: int = 8, head_dim: int = 128, block: int = 16, seed: int = 0):  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context, self.block = batch, context, block
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        per_seq = -(-context // block)
        shape = (batch * per_seq, block, kv_heads, head_dim)
        k = torch.randn(shape, generator=gen, device=device)
        v = torch.randn(shape, generator=gen, device=device)
        self.k8, self.v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        self.k16, self.v16 = self.k8.to(torch.bfloat16), self.v8.to(torch.bfloat16)
        self.v8t = self.v8.permute(0, 2, 3, 1).contiguous()  # the VT_* variants' V
        perm = torch.randperm(batch * per_seq, generator=gen, device=device)
        self.tables = perm.view(batch, per_seq).to(torch.int32)
        self.q = torch.randn(batch, heads, head_dim, generator=gen, device=device)
        self.q = self.q.to(torch.bfloat16)
        self.scale = head_dim**-0.5

    def kv_bytes(self, itemsize: int) -> int:
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * itemsize


def fma_rows(head_dim: int, itemsize: int, tile_n: int, warps: int) -> int:
    """ROWS for ``decode_fma_kernel``: the keys one load of a [tile_n, head_dim] tile spreads
    over lanes and warps, as Triton's coalescing lays it out (16 bytes per thread along
    head_dim, the rest of the warp and the warps along the keys). Any power of two up to
    tile_n gives the same result; this one keeps the kernel's loop free of cross-warp work."""
    lanes_d = min(32, max(1, head_dim * itemsize // 16))
    return max(1, min(tile_n, warps * 32 // lanes_d))


def run(p: Problem, mode: str, tile_n: int, warps: int, stages: int, out: torch.Tensor):
    if mode in FMA_MODES:
        return run_fma(p, mode, tile_n, warps, stages, out)
    m = MODES[mode]
    k, v = (p.k16, p.v16) if m == BF16 else (p.k8, p.v8t if m in VT else p.v8)
    # bits_f16 and packed_bits tiles hold the value times 2^-8
    unit = 256.0 if m in (BITS_F16, PACKED_BITS, PACKED_BITS_PF) else 1.0
    g = p.heads // p.kv_heads

    def call():
        decode_variant_kernel[(p.batch, p.kv_heads)](
            out, p.q, k, v, p.tables, p.context, p.scale * 1.4426950408889634 * unit, unit,
            p.q.stride(0), p.q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            p.tables.stride(0),
            G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), HEAD_DIM=p.head_dim,
            BLOCK_SIZE=p.block, TILE_N=tile_n, MODE=m, UPCAST=p.q.device.type == "cpu",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return call


def run_fma(p: Problem, mode: str, tile_n: int, warps: int, stages: int, out: torch.Tensor):
    bf16, ahead = FMA_MODES[mode]
    k, v = (p.k16, p.v16) if bf16 else (p.k8, p.v8)
    rows = fma_rows(p.head_dim, k.element_size(), tile_n, warps)
    assert tile_n % rows == 0 and p.context % tile_n == 0, (tile_n, rows, p.context)

    def call():
        decode_fma_kernel[(p.batch, p.kv_heads)](
            out, p.q, k, v, p.tables, p.context, p.scale * 1.4426950408889634, 1.0,
            p.q.stride(0), p.q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            p.tables.stride(0),
            G=p.heads // p.kv_heads, HEAD_DIM=p.head_dim, BLOCK_SIZE=p.block, TILE_N=tile_n,
            ROWS=rows, AHEAD=ahead, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return call


def shipped(p: Problem, out: torch.Tensor):
    import pagedattn_kernels as pk

    lens = torch.full((p.batch,), p.context, dtype=torch.int32, device=p.q.device)

    def call():
        return pk.paged_decode_attention(p.q, p.k8, p.v8, p.tables, lens,
                                         max_seq_len=p.context, out=out)  # fmt: skip

    return call


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


CONFIGS = [  # (mode, tile_n, warps, stages)
    ("bf16", 128, 4, 2), ("bf16", 64, 2, 3),
    ("cvt", 128, 4, 2), ("cvt", 128, 4, 3), ("cvt", 64, 4, 4),
    ("cvt_f16", 128, 4, 2),  # 196 regs, 8 warps/SM, 810 instr/tile, 0.099 /B: 67% measured
    ("cvt_f16", 128, 4, 3), ("cvt_f16", 64, 4, 4),
    ("bits_f16", 128, 4, 2), ("bits_f16", 128, 4, 3), ("bits_f16", 64, 4, 4),
    ("fp8_mma", 128, 4, 2), ("fp8_mma", 128, 4, 3), ("fp8_mma", 256, 4, 3),
    ("cvt_f16", 64, 2, 2), ("cvt_f16", 32, 1, 3),
    # Word loads. Comments: Triton 3.6 sm_90 offline compiles (registers, warps per SM that
    # registers and shared memory allow, instructions per warp in the loop, per byte read)
    ("packed_asm", 128, 4, 2),  # 127 regs, 12 warps/SM, 677 instr/tile, 0.083 /B
    ("packed_asm", 128, 4, 3),  # 128, 12, 776, 0.095
    ("packed_asm", 64, 4, 2),  # 96, 20, 465, 0.114
    ("packed_asm", 64, 4, 3),  # 102, 16, 478, 0.117
    ("packed_asm", 64, 2, 2),  # 144, 10, 706, 0.086
    ("packed_asm", 32, 1, 3),  # 168, 11, 733, 0.089
    ("packed_bits", 128, 4, 2), ("packed_bits", 64, 4, 2),  # 128 / 96 regs, 0.141 / ~0.17 /B
    # Word loads an iteration ahead (register double buffer; not yet timed on a GPU): plain
    # global loads (LDG) instead of packed_asm's cp.async (LDGSTS) staging, no byte loads
    ("packed_pf", 128, 4, 2),  # 208 regs, 8 warps/SM, 872 instr/tile, 0.106 /B
    ("packed_pf", 64, 4, 2),  # 129, 12, 546, 0.133
    ("packed_pf", 64, 2, 2),  # 235, 8, 870, 0.106
    ("packed_pf", 32, 1, 2),  # 255, 8, 836, 0.102
    # V cached transposed within each block ([blocks, kv_heads, dim, block]: a value row runs
    # along the keys), so P.V finds pairs of consecutive keys side by side in shared memory: no
    # LDS.U8 (LDS.64 instead), K as cvt_f16's. vt_a multiplies O^T = V^T P^T, V^T the A operand
    # from registers, on wgmma. Comments: offline registers and instructions a tile; H200
    # share of the copy bandwidth at 64 x 4k and at 256 x 512 (119317a)
    ("vt_f16", 128, 4, 2),  # 115 regs, 591 instr/tile: 70.2%, 63.1%
    ("vt_f16", 128, 4, 3),  # 116, 661: 68.9%, 62.5%
    ("vt_f16", 128, 8, 2),  # 80, 420 (8 warps): 50.0%, 56.7%
    ("vt_f16", 64, 4, 2),  # 92, 393: 66.6%, 58.2%
    ("vt_f16", 64, 4, 3),  # 94, 501: 64.0%, 55.7%
    ("vt_f16", 64, 2, 2),  # 128, 587: 67.1%, 65.0%
    ("vt_f16", 32, 1, 3),  # 168, 630: 59.4%, 56.0%
    ("vt_a", 128, 4, 2),  # 150 regs, 577 instr/tile (LDS.U16 64, HGMMA 16): 46.6%, 58.4%
    ("vt_a", 64, 4, 2),  # 96, 419: 70.3%, 63.1%
    # CUDA-core variants. num_stages does nothing for them (no tl.dot: Triton pipelines no
    # load; the sm_90 SASS is the same for 1 and 3). Comments: registers per thread from
    # offline sm_90 compiles with Triton 3.6 (G = 4, HEAD_DIM 128; no spills) and the
    # programs per SM they allow (grid 512 programs, 132 SMs: 4/SM runs it in one wave). fp8
    # holds q and the accumulator in float32 for 16 columns x 4 heads per thread (128
    # registers) whatever the tile, so it gets 8 warps per SM at most.
    ("fma", 32, 4, 1),  # 254 regs, 2/SM (the plain kernel; V loads issued with K's anyway)
    ("fma", 64, 4, 1),  # 254 regs, 2/SM
    ("fma_ev", 32, 4, 1),  # 254 regs, 2/SM: a control, the same schedule as ("fma", 32, 4)
    ("fma_ev", 32, 2, 1),  # 239 regs, 4/SM
    ("fma_pf", 32, 4, 1),  # 238 regs, 2/SM
    ("fma_pf", 16, 2, 1),  # 245 regs, 4/SM
    # bf16: 8 columns per thread, q and accumulator 64 registers
    ("fma_bf16", 32, 4, 1),  # 158 regs, 3/SM
    ("fma_bf16", 16, 4, 1),  # 128 regs, 4/SM
    ("fma_bf16_ev", 32, 4, 1),  # 128 regs, 4/SM
    ("fma_bf16_ev", 64, 4, 1),  # 168 regs, 3/SM
    ("fma_bf16_pf", 32, 4, 1),  # 168 regs, 3/SM
    ("fma_bf16_pf", 16, 4, 1),  # 128 regs, 4/SM
]


def reference(p: Problem) -> torch.Tensor:
    """float64 attention over the same numbers (the e4m3 values, exact in bf16)."""
    k = p.k16.double()[p.tables.long()].flatten(1, 2)[:, : p.context]  # [B, T, kv, D]
    v = p.v16.double()[p.tables.long()].flatten(1, 2)[:, : p.context]
    g = p.heads // p.kv_heads
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    w = torch.softmax(torch.einsum("bhd,bthd->bht", p.q.double(), k) * p.scale, -1)
    return torch.einsum("bht,bthd->bhd", w, v)


# fma modes under check: (tile_n, warps) on each problem. warps only sets ROWS here (the
# interpreter runs one thread): ROWS = tile_n (one key per column and tile) and ROWS < tile_n
# (several keys per column and tile); several tiles, so the rescale and, for *_pf, the
# clamped last prefetch are exercised.
FMA_CHECK_SHAPES = [(32, 4), (32, 1), (16, 1)]


def check() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = Problem(2, 64, dev, heads=4, kv_heads=2, head_dim=32)
    want = reference(p)
    bad = 0
    for mode in ("bf16", "cvt", "cvt_f16", "bits_f16", "fp8_mma", "packed_bits", "packed_asm",
                 "packed_bits_pf", "packed_pf", "vt_f16", "vt_a"):  # fmt: skip
        if mode in ("packed_asm", "packed_pf") and dev == "cpu":
            log.info("%-11s needs a GPU (inline assembly; packed_bits checks the unpacking)", mode)
            continue
        out = torch.empty_like(p.q)
        try:
            run(p, mode, 32, 4, 1, out)()
        except Exception as exc:  # the interpreter may lack an fp8 dot
            log.warning("%s: %s", mode, repr(exc)[:160])
            continue
        err = rel_err(out, want)
        limit = 0.25 if mode == "fp8_mma" else 0.02  # fp8_mma: e4m3 query and probabilities
        bad += err > limit
        log.info("%-11s rel err vs float64 %.1e %s", mode, err, "ok" if err <= limit else "WRONG")
    # fma modes also on G = 4 (the Llama-3-8B grouping) and head_dim 64.
    p4 = Problem(2, 128, dev, heads=8, kv_heads=2, head_dim=64, seed=1)
    cases = [(p, want), (p4, reference(p4))]
    # Stored in float32, so the check sees the kernel's arithmetic, not the output rounding
    # (which the interpreter does by truncating to bf16: up to 2^-7 relative). Products,
    # softmax and accumulator are float32 over inputs exact in float32 (e4m3, bf16), over at
    # most 128 keys and 64 dims: ~1e-7 relative in norm (1.4e-7 measured). 1e-5 leaves ~70x;
    # real bugs cost far more (tried: either rescale dropped 0.4-1.1, the key columns merged
    # without their weights 0.65, the prefetch one tile off 1.0).
    limit = 1e-5
    for mode in FMA_MODES:
        errs = []
        for prob, ref in cases:
            for tile_n, warps in FMA_CHECK_SHAPES:
                out = torch.empty_like(prob.q, dtype=torch.float32)
                try:
                    run(prob, mode, tile_n, warps, 1, out)()
                except Exception as exc:  # no dot here: the interpreter must run every one
                    log.error("%s tile %d warps %d: %s", mode, tile_n, warps, repr(exc)[:300])
                    errs.append(float("inf"))
                    continue
                errs.append(rel_err(out, ref))
        err = max(errs)
        bad += err > limit
        log.info("%-11s rel err vs float64 %.1e (worst of %d shapes) %s", mode, err, len(errs),
                 "ok" if err <= limit else "WRONG")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--only", default="", metavar="MODE,...",
                    help="time only these variants (e.g. cvt,fma,fma_bf16; default: all)")
    add_common_args(ap, budget_s=240.0)
    args = ap.parse_args()
    wanted = {m.strip() for m in args.only.split(",") if m.strip()}
    if unknown := wanted - set(MODES) - {"shipped"}:
        ap.error(f"--only: unknown variants {sorted(unknown)}; choose from {sorted(MODES)}")
    if (code := check_or_gpu(args, check)) is not None:
        return code
    deadline = time.monotonic() + args.budget_s
    copy_bw = copy_bandwidth_tbps()
    p = Problem(args.batch, args.context, "cuda")
    ref = torch.empty_like(p.q)
    run(p, "bf16", 128, 4, 2, ref)()
    rows = []
    cases = [(c, None) for c in CONFIGS] + [(("shipped", 0, 0, 0), None)]
    if wanted:
        cases = [c for c in cases if c[0][0] in wanted]
    for (mode, tile_n, warps, stages), _ in cases:
        if time.monotonic() > deadline:
            break
        out = torch.empty_like(p.q)
        try:
            fn = shipped(p, out) if mode == "shipped" else run(p, mode, tile_n, warps, stages, out)
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as exc:
            rows.append({"variant": mode, "tile_n": tile_n, "error": repr(exc)[:300]})
            log.info("%s %s: error %s", mode, tile_n, repr(exc)[:200])
            continue
        nbytes = p.kv_bytes(cache_itemsize(mode))
        frac = nbytes / ms / 1e9 / copy_bw
        row = {"variant": mode, "tile_n": tile_n, "num_warps": warps, "num_stages": stages,
               "us": ms * 1e3, "bw_frac": frac, "rel_err_vs_bf16": rel_err(out, ref)}  # fmt: skip
        if mode in FMA_MODES:
            row["rows"] = fma_rows(p.head_dim, cache_itemsize(mode), tile_n, warps)
        rows.append(row)
        log.info("%-11s tile %3d w=%d s=%d: %8.1f us  %5.1f%% of copy  err %.1e", mode, tile_n,
                 warps, stages, ms * 1e3, 100 * frac, row["rel_err_vs_bf16"])
    write_result(args, "decode_fp8_variants", "decode_fp8_variants.py", batch=args.batch,
                 context=args.context, copy_bw_TBps=copy_bw, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
