"""The Triton kernels of the attention ops (device code only; the launchers are in
``triton_launch``): flash-decoding (``decode_kernel`` + ``decode_reduce_kernel``) and causal
attention over mixed batches of prefill chunks (``prefill_kernel``), both reading K/V through
the block table with one shared tile step (``_attend_tile``).

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a unit stride on the
head dim; a token's keys for one KV head are one contiguous row of ``head_dim`` elements.
Rows are gathered through the block table one tile of ``TILE_N`` tokens at a time (a tile spans
several cache blocks), so every load is a wide, coalesced row read whatever the block size.

Head dims that are not powers of two (80, 96) are padded to the next power of two inside the
kernel (``HEAD_DIM_PAD``) and masked; no padding ever reaches memory.

Softmax runs in the log2 domain: scores are multiplied by ``scale * log2(e)`` and exponentiated
with ``exp2``. All programs handle every query head of one KV head (the "group"), so each K/V
row is read once per sequence whatever the GQA ratio.

This file is loaded twice when both compiled and interpreted kernels are needed (see
``pagedattn_kernels.common.load_kernels``); it must stay free of import-time side effects. For
the same reason the kernels call only Triton *builtins* and the jit helpers defined here, never
the jit functions of ``triton.language.standard`` (``tl.zeros``, ``tl.max``, ``tl.sum``,
``tl.cdiv``): those are compiled-or-interpreted according to ``TRITON_INTERPRET`` when triton
itself was imported, and the wrong kind cannot be called. Reductions go through
``tl.reduce`` with the standard combine functions, which the interpreter recognises and runs
in numpy (the functions themselves are never called there). Small helpers are written inline:
the interpreter re-patches ``triton.language`` at every jit-function call, which costs
milliseconds each time.

Arguments that change from call to call are marked ``do_not_specialize``: integers (sequence
counts, partition sizes, the block-table width) and the per-batch metadata pointers (a mixed
batch passes block tables and lengths sliced at its number of decode rows, which may leave them
unaligned). Triton would otherwise compile a variant for each of "1", "a multiple of 16" and
"other" integer, and for 16-byte aligned or unaligned pointers; a serving run stalled mid-pass
for each first occurrence (about a second each on an H200).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_rows(ptrs, in_range, d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """A [TILE_N, HEAD_DIM_PAD] tile of keys or values at ``ptrs``: rows past the end
    (MASKED) and padding columns read as zeros."""
    if MASKED:
        if HEAD_DIM == HEAD_DIM_PAD:
            mask = in_range[:, None]
        else:
            mask = in_range[:, None] & (d < HEAD_DIM)[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _e4m3_words_to_f16(w, ASM: tl.constexpr):
    """float16 values of the e4m3 bytes packed in int32 words ``w`` [rows, n]: [rows, 4 n],
    byte j of word i (little-endian) becoming column 4 i + j. Exact.

    ASM: sm_89+'s packed conversion, two bytes per ``cvt.rn.f16x2.e4m3x2`` (what ``.to``
    does for an e4m3 tensor, here on registers loaded as words); else each byte is
    extracted with shifts, for the interpreter, which runs no inline assembly."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
                "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            constraints="=h,=h,=h,=h,r", args=[w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        b0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    # join(join(b0, b2), join(b1, b3))[r, i, k, j] is byte 2 k + j of word [r, i]
    t = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(t, [w.shape[0], 4 * w.shape[1]])


@triton.jit
def _load_e4m3_words(base, off, in_range, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     MASKED: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """A [TILE_N, HEAD_DIM_PAD] float16 tile of an fp8 cache whose rows start at byte offsets
    ``off`` (multiples of 4), loaded as int32 words (see ``_attend_tile``'s PACKED)."""
    w4 = tl.arange(0, HEAD_DIM_PAD // 4)
    ptrs = base.to(tl.pointer_type(tl.int32)) + (off // 4)[:, None] + w4[None, :]
    if MASKED:
        if HEAD_DIM == HEAD_DIM_PAD:
            mask = in_range[:, None]
        else:
            mask = in_range[:, None] & (w4 < HEAD_DIM // 4)[None, :]
        w = tl.load(ptrs, mask=mask, other=0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(w4 < HEAD_DIM // 4)[None, :], other=0)
    return _e4m3_words_to_f16(w, ASM)


@triton.jit
def _attend_tile(
    m_i,
    l_i,
    acc,
    q,
    k_src,
    v_src,
    bt_row_ptr,
    kv_head_off_k,
    kv_head_off_v,
    start,
    kv_end,
    row_pos,
    scale_log2,
    stride_k_block,
    stride_k_tok,
    stride_v_block,
    stride_v_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOURCE: tl.constexpr,
    OFFS64: tl.constexpr,
    EARLY_V: tl.constexpr,
    PACKED: tl.constexpr = 0,
):
    """Online-softmax update with one tile of TILE_N keys starting at context position ``start``.

    SOURCE says where the tile's K and V come from:
      0 (``FROM_CACHE``): the paged caches ``k_src``/``v_src``, rows gathered through the
        block table ``bt_row_ptr``; ``stride_*_block``/``stride_*_tok`` are the caches'.
      1 (``FROM_NEW``): the rows of this step's own keys and values (``[tokens, kv_heads,
        dim]``, the values just written to the cache): position p is row ``bt_row_ptr + p``
        (the caller passes that row offset in place of a block table), stride ``stride_*_tok``.
      2 (``FROM_NEW_TMA``): the same rows through tensor descriptors ``k_src``/``v_src`` over
        ``[tokens, kv_heads * dim]`` (TMA on Hopper); ``kv_head_off_*`` is the column.
    OFFS64: 64-bit element offsets (a cache of 2^31 elements or more), else 32-bit ones.
    MASKED: the tile may reach past ``kv_end`` (the end of the keys this program reads).
    CAUSAL: also hide key positions greater than each row's own position ``row_pos``.
    Unmasked tiles skip every comparison (the common case in long contexts).
    IEEE: fp32 inputs; dots in 3xTF32 (fp32-accurate) rather than plain tf32.
    UPCAST: interpreter with bfloat16 inputs (see below).
    KV_FP8: the caches hold fp8 e4m3; each tile is converted to the query's dtype in registers
    (exact: every e4m3 value is a float16/bfloat16/float32 value), and the probabilities go to
    that dtype for P.V. The scales are not applied here: the caller folds k_scale into the
    score scale and v_scale into the output. The decode kernel may pass a float16 query in
    place of a bfloat16 one (``_query_as_float16``), so the tiles become float16.
    PACKED (fp8 caches, float16 query, SOURCE 0): load the tiles as int32 words, four e4m3
    values each, and widen them in registers (``_e4m3_words_to_f16``; 2: with the hardware
    conversion, 1: with shifts, for the interpreter). Loaded by element, an e4m3 V tile is
    read back from shared memory one byte per instruction: the P.V product needs pairs of
    consecutive keys in a register and sm_90 has no transposing ldmatrix for bytes. As float16
    the tile takes ldmatrix's transposing path as a 16-bit cache does (offline sm_90 compiles,
    ``tools/compile_sm90.py --fp8 --sass``).
    EARLY_V: issue the V load together with K's, before the scores, so that it overlaps them
    (prefill: on an H200 a kernel that loads V after the softmax ran at 445 TFLOP/s against
    514 at 4k tokens, ``scripts/prefill_variants.py --gap``); else after the softmax, when
    the scores' registers are free again.
    """
    pos = start + tl.arange(0, TILE_N)
    d = tl.arange(0, HEAD_DIM_PAD)
    in_range = pos < kv_end
    if SOURCE == 2:
        # Rows past kv_end (another sequence's, or zeros past the tensor) are masked below.
        k = k_src.load([bt_row_ptr + start, kv_head_off_k])
        if EARLY_V:
            v = v_src.load([bt_row_ptr + start, kv_head_off_v])
    else:
        if SOURCE == 1:
            rows = bt_row_ptr + pos
            if OFFS64:
                rows = rows.to(tl.int64)
            k_off = rows * stride_k_tok + kv_head_off_k
            v_off = rows * stride_v_tok + kv_head_off_v
        else:
            if MASKED:
                blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
            else:
                blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE)
            if OFFS64:
                blk = blk.to(tl.int64)
            tok_off = pos % BLOCK_SIZE
            k_off = blk * stride_k_block + tok_off * stride_k_tok + kv_head_off_k
            v_off = blk * stride_v_block + tok_off * stride_v_tok + kv_head_off_v
        v_ptrs = v_src + v_off[:, None] + d[None, :]
        if PACKED:
            k = _load_e4m3_words(k_src, k_off, in_range, HEAD_DIM, HEAD_DIM_PAD, MASKED,
                                 PACKED == 2)  # fmt: skip
            if EARLY_V:
                v = _load_e4m3_words(v_src, v_off, in_range, HEAD_DIM, HEAD_DIM_PAD, MASKED,
                                     PACKED == 2)  # fmt: skip
        else:
            k = _load_rows(k_src + k_off[:, None] + d[None, :], in_range, d, HEAD_DIM,
                           HEAD_DIM_PAD, MASKED)  # fmt: skip
            if EARLY_V:
                v = _load_rows(v_ptrs, in_range, d, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    if KV_FP8 and not PACKED:
        k = k.to(q.dtype)

    # UPCAST: the interpreter's dot cannot multiply bfloat16 (numpy has no such type and it
    # would multiply the raw bits), so there the operands go to fp32 first.
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    elif IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        keep = in_range[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= row_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    # m_i is kept in scaled (log2) units; the scale folds into one FMA per score. Its
    # unrounded product may exceed the rounded row max by half an ulp of the score: nothing
    # for real scores, but past about 2^24 (log2 units) exp2 of that is inf or 0. On an H200,
    # queries of 1e30 against fp8 keys gave NaN and zero rows; rounding the scaled scores
    # first did not help, as the compiler contracts the multiply and the subtraction anyway.
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)

    if not EARLY_V:
        if SOURCE == 2:
            v = v_src.load([bt_row_ptr + start, kv_head_off_v])
        elif PACKED:
            v = _load_e4m3_words(v_src, v_off, in_range, HEAD_DIM, HEAD_DIM_PAD, MASKED,
                                 PACKED == 2)  # fmt: skip
        else:
            v = _load_rows(v_ptrs, in_range, d, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    if KV_FP8 and not PACKED:
        v = v.to(q.dtype)
    p = p.to(v.dtype)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(p, v, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(p, v, acc)
    return m_new, l_i, acc


@triton.jit
def _query_as_float16(q, scale_log2):
    """A bfloat16 query tile in float16, and the score scale that undoes its power-of-two
    scaling: the decode kernel's products on fp8 caches then run in float16.

    Why: sm_90 converts e4m3 to float16 with one packed instruction per two values, and to
    bfloat16 only through float16 with one more conversion per value. On an H200 a minimal
    decode kernel read an fp8 cache at 66-67% of the copy bandwidth with float16 products
    against 48-54% with bfloat16 ones (``scripts/decode_fp8_variants.py``, ``cvt_f16`` and
    ``cvt``).

    Exact for every query component in float16's normal range: bfloat16's 8-bit significand
    fits float16's 11 bits. float16 overflows at 65,504 where bfloat16 reaches 3e38, so a tile
    whose largest magnitude is 2^15 or more is first divided by the power of two that brings
    it below 2^15 (exact), and the score scale multiplied by the same power. Components below
    2^-14 times that power then round to float16 subnormals: each score is off by at most
    2^-39 times the largest component times the sum of the key's magnitudes. Real queries stay
    far below 2^15; the scaling keeps a huge one from turning into inf and NaN.
    """
    qf = q.to(tl.float32)
    qmax = tl.reduce(tl.reduce(tl.abs(qf), 1, tl.standard._elementwise_max), 0,
                     tl.standard._elementwise_max)  # fmt: skip
    exponent = ((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.maximum(exponent - 14, 0)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return (qf * down).to(tl.float16), scale_log2 * up


@triton.jit
def _split_length(seq_len, num_splits, min_partition, TILE_N: tl.constexpr):
    """Keys per program when a sequence of ``seq_len`` is split over ``num_splits`` programs
    (flash-decoding): its own length divided evenly, rounded up to whole tiles, at least
    ``min_partition``. Per sequence, not one partition of the longest: in a batch of mixed
    lengths (and in CUDA graphs, whose grid is sized for ``max_model_len``) a short sequence
    still spreads over the programs, instead of one program doing all of it while the others
    exit. The decode kernel and its merge compute it alike."""
    per = (seq_len + num_splits - 1) // num_splits
    per = (per + TILE_N - 1) // TILE_N * TILE_N
    return tl.maximum(per, min_partition)


# per-batch metadata: never specialized on (see the module docstring); the fp8 scales are
# per-layer tensors whose addresses may or may not be 16-byte aligned
_BATCH_ARGS = ["block_tables_ptr", "seq_lens_ptr", "stride_bt_seq", "k_scale_ptr", "v_scale_ptr"]


@triton.jit(do_not_specialize=["partition_size", "order_ptr", "work_ptr", *_BATCH_ARGS])
def decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    order_ptr,
    work_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    partition_size,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    stride_bt_seq,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    OFFS64: tl.constexpr,
    EARLY_V: tl.constexpr,
    F16_PRODUCTS: tl.constexpr,
    PACKED: tl.constexpr,
    ONE_LOOP: tl.constexpr = False,
    ORDERED: tl.constexpr = False,
    WORK: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Flash-decoding, phase one. Grid: (num_kv_heads, num_splits, num_seqs): the sequence
    varies slowest, so the GPU starts all programs of a sequence (every KV head, every split)
    together, sequence after sequence: in batch order, or with ORDERED in the order
    ``order_ptr`` lists the rows (see ``triton_launch.paged_decode_attention``'s
    ``seq_order`` for why).

    Program (seq, kv head, split) attends the group's query heads (rows of a BLOCK_G x D tile)
    over context positions [split * P, min(+P, seq_len)), P = ``_split_length(seq_len,
    num_splits, partition_size, TILE_N)``: ``partition_size`` is the smallest P.
    SPLIT=False (one split): writes the normalised output directly.
    SPLIT=True: writes the partial output and its log2-sum-exp for ``decode_reduce_kernel``.
    A sequence of length 0 (batch padding) gets zeros.
    KV_FP8: scores are scaled by k_scale too, and the output by v_scale.
    F16_PRODUCTS (with KV_FP8 and a bfloat16 query): the products run in float16
    (``_query_as_float16``).
    PACKED (KV_FP8, the query float16 or made so): ``_attend_tile``'s, else 0.
    ONE_LOOP: every tile masked, the ragged last one inside the software-pipelined loop (its
    loads issued while earlier tiles compute); else whole tiles unmasked, then the ragged one
    on its own after the loop (its block-table, K and V loads one after the other).
    WORK: a decode plan (``attention.plan``) instead of splits and order. Grid: (num_kv_heads,
    plan capacity, 1); program (kv head, item) attends the item's chunk [start, end) of its
    row and writes the output, or, for a chunk of a split row, the partial output and
    log2-sum-exp at the item's partial row (``decode_merge_kernel`` merges them). Padding
    items (row -1) exit.
    """
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if WORK:
        item = work_ptr + split * 4
        seq = tl.load(item)
        if seq < 0:
            return
        start = tl.load(item + 1)
        end = tl.load(item + 2)
        partial = tl.load(item + 3)
    else:
        if ORDERED:
            seq = tl.load(order_ptr + seq)
        seq_len = tl.load(seq_lens_ptr + seq)
        if SPLIT:
            part = _split_length(seq_len, tl.num_programs(1), partition_size, TILE_N)
            start = split * part
            if start >= seq_len:
                return
            end = tl.minimum(start + part, seq_len)
        else:
            start = 0
            end = seq_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + g
    g_mask = g < QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM_PAD], 0.0, tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_off = kv_head * stride_kc_head
    v_head_off = kv_head * stride_vc_head
    if OFFS64:
        k_head_off = k_head_off.to(tl.int64)
        v_head_off = v_head_off.to(tl.int64)
    row_pos = tl.full([BLOCK_G], 0, tl.int32)  # unused: decode is not causal within a tile
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        if F16_PRODUCTS and q.dtype == tl.bfloat16:
            q, scale_log2 = _query_as_float16(q, scale_log2)
    packed: tl.constexpr = PACKED if KV_FP8 and q.dtype == tl.float16 else 0

    if ONE_LOOP:  # every tile masked, in one loop
        for tile_start in range(start, end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, q, k_cache_ptr, v_cache_ptr, bt_row, k_head_off, v_head_off,
                tile_start, end, row_pos, scale_log2,
                stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, False, IEEE, UPCAST,
                KV_FP8, 0, OFFS64, EARLY_V, packed,
            )  # fmt: skip
    else:  # whole tiles first (no masks), then at most one ragged tile
        # (An `if`, not a second loop over [full_end, end): the compiler would software-pipeline
        # that loop too, and on an fp8 cache the kernel then spills, sm_90 offline compile:
        # 255 registers and 8 bytes of stack, 1,101 instructions a tile against 855.)
        full_end = start + ((end - start) // TILE_N) * TILE_N
        for tile_start in range(start, full_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, q, k_cache_ptr, v_cache_ptr, bt_row, k_head_off, v_head_off,
                tile_start, end, row_pos, scale_log2,
                stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, False, IEEE, UPCAST,
                KV_FP8, 0, OFFS64, EARLY_V, packed,
            )  # fmt: skip
        if full_end < end:
            tile_start = full_end
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, q, k_cache_ptr, v_cache_ptr, bt_row, k_head_off, v_head_off,
                tile_start, end, row_pos, scale_log2,
                stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, False, IEEE, UPCAST,
                KV_FP8, 0, OFFS64, EARLY_V, packed,
            )  # fmt: skip

    store_mask = g_mask[:, None] & d_mask[None, :]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    result = acc / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)
    if WORK:
        if partial >= 0:
            _store_partial(part_out_ptr, part_lse_ptr, partial, 0, heads, d, result, lse,
                           store_mask, g_mask, stride_po_seq, stride_po_head, stride_po_split,
                           stride_pl_seq, stride_pl_head)  # fmt: skip
        else:
            _store_output(out_ptr, seq, heads, d, result, store_mask, stride_o_seq, stride_o_head)
    elif SPLIT:
        _store_partial(part_out_ptr, part_lse_ptr, seq, split, heads, d, result, lse, store_mask,
                       g_mask, stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq,
                       stride_pl_head)  # fmt: skip
    else:
        _store_output(out_ptr, seq, heads, d, result, store_mask, stride_o_seq, stride_o_head)


@triton.jit
def _store_output(out_ptr, seq, heads, d, result, store_mask, stride_o_seq, stride_o_head):
    """A row's normalised output for the group's heads, in the output's dtype."""
    o = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o, result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, row, split, heads, d, result, lse, store_mask,
                   g_mask, stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq,
                   stride_pl_head):  # fmt: skip
    """A program's partial output (normalised by its own sum) and its log2-sum-exp, for the
    merge: at ``row`` (a sequence, or a plan's partial row) and ``split``."""
    po = (part_out_ptr + row.to(tl.int64) * stride_po_seq + heads[:, None] * stride_po_head
          + split * stride_po_split + d[None, :])  # fmt: skip
    tl.store(po, result, mask=store_mask)
    pl = part_lse_ptr + row.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split
    tl.store(pl, lse, mask=g_mask)


@triton.jit(do_not_specialize=["partition_size", "num_splits", "seq_lens_ptr"])
def decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    partition_size,
    num_splits,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Flash-decoding, phase two. Grid: (num_seqs, num_heads).

    Merges the partial outputs of the splits that hold keys (ceil(seq_len / P) of them, P as
    ``decode_kernel`` computed it from ``partition_size`` and its TILE_N), weighting each by
    exp2(lse - max lse).
    """
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    part = _split_length(seq_len, num_splits, partition_size, TILE_N)
    num_valid = tl.minimum((seq_len + part - 1) // part, num_splits)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_valid
    d_mask = d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + s,
        mask=s_mask,
        other=float("-inf"),
    )
    lse_max = tl.reduce(lse, 0, tl.standard._elementwise_max)
    lse_max = tl.where(num_valid > 0, lse_max, 0.0)
    w = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    denom = tl.reduce(w, 0, tl.standard._sum_combine)
    parts = tl.load(
        part_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + s[:, None] * stride_po_split
        + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    result = tl.reduce(parts * w[:, None], 0, tl.standard._sum_combine) / tl.where(
        denom > 0.0, denom, 1.0
    )
    o = out_ptr + seq * stride_o_seq + head * stride_o_head + d
    tl.store(o, result.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["merges_ptr"])
def decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    merges_ptr,
    stride_o_seq,
    stride_o_head,
    stride_po_row,
    stride_po_head,
    stride_pl_row,
    stride_pl_head,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Flash-decoding, phase two, for a decode plan (``attention.plan``). Grid: (merge
    capacity, num_kv_heads). Program (merge, kv head) merges the partial outputs of one split
    row (its ``count`` contiguous partial rows from ``first``) for every query head of the
    group at once, PARTS_PAD partial rows at a time, weighting each by exp2(lse - max lse),
    and writes the row's output. Padding merges (row -1) exit."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    merge = merges_ptr + tl.program_id(0) * 3
    seq = tl.load(merge)
    if seq < 0:
        return
    first = tl.load(merge + 1)
    count = tl.load(merge + 2)
    # one flat axis of (partial row, head of the group) pairs, reshaped for the sums
    r = tl.arange(0, PARTS_PAD * GROUP_PAD)
    part = r // GROUP_PAD
    head = tl.program_id(1) * QUERIES_PER_KV + r % GROUP_PAD
    in_group = r % GROUP_PAD < QUERIES_PER_KV
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_run = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)
    for p0 in range(0, count, PARTS_PAD):
        valid = (p0 + part < count) & in_group
        row = (first + p0 + part).to(tl.int64)
        lse = tl.load(part_lse_ptr + row * stride_pl_row + head * stride_pl_head, mask=valid,
                      other=float("-inf"))  # fmt: skip
        # heads past the group: a finite score, so that their (unused) sums stay finite
        lse = tl.reshape(tl.where(in_group, lse, 0.0), [PARTS_PAD, GROUP_PAD])
        parts = tl.load(
            part_out_ptr + row[:, None] * stride_po_row + head[:, None] * stride_po_head
            + d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # fmt: skip
        parts = tl.reshape(parts, [PARTS_PAD, GROUP_PAD, HEAD_DIM_PAD])
        m_new = tl.maximum(m_run, tl.reduce(lse, 0, tl.standard._elementwise_max))
        w = tl.exp2(lse - m_new[None, :])
        alpha = tl.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.reduce(w, 0, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.reduce(parts * w[:, :, None], 0, tl.standard._sum_combine)
        m_run = m_new
    g = tl.arange(0, GROUP_PAD)
    heads = tl.program_id(1) * QUERIES_PER_KV + g
    o = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o, (acc / l_run[:, None]).to(out_ptr.dtype.element_ty),
             mask=(g < QUERIES_PER_KV)[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_seqs", "cu_q_ptr", *_BATCH_ARGS])
def prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_new,
    v_new,
    block_tables_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    stride_bt_seq,
    stride_kn_tok,
    stride_kn_head,
    stride_vn_tok,
    stride_vn_head,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    OFFS64: tl.constexpr,
    NEW_KV: tl.constexpr,
    F16_PRODUCTS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Causal attention for a packed, mixed batch of query chunks. Grid: (q blocks, kv heads).

    A program takes BLOCK_Q query tokens of one sequence times the QUERIES_PER_KV query heads
    of one KV head: BLOCK_M >= BLOCK_Q * QUERIES_PER_KV rows, row r = (token r // G, head r % G).
    Sequence i owns programs [cu_q[i] // BLOCK_Q + i, cu_q[i+1] // BLOCK_Q + i + 1), which
    covers ceil(q_len_i / BLOCK_Q) blocks (spares exit at once); the sequence of a program is
    found by binary search, so the grid needs no host-side knowledge of the lengths.
    Query token j of a chunk of q_len in a context of seq_len tokens sits at position
    seq_len - q_len + j and sees keys 0..that position.

    NEW_KV: 0 reads every key from the caches. 1 (pointers) or 2 (tensor descriptors, TMA on
    Hopper) read the chunk's own keys, positions seq_len - q_len.., from ``k_new``/``v_new``,
    this step's keys and values, row for row with the queries; only the earlier context comes
    through the block table. Both hold the same values (the caller guarantees it); contiguous
    rows load faster than a gather: on an H200 at 4k tokens, 0.67x cuDNN against 1.0x
    (``scripts/prefill_variants.py``).
    F16_PRODUCTS (with KV_FP8, NEW_KV 0 and a bfloat16 query): the products run in float16
    (``_query_as_float16``). On an fp8 cache with bfloat16 products the sm_90 compile spills
    (255 registers, 64 bytes of stack: ``tools/compile_sm90.py --fp8``); with float16 ones it
    does not (244).
    """
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    # The last query blocks have the most keys to read: start them first (shorter tail).
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    first_tok = local_block * BLOCK_Q
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1

    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV
    row_ok = (r < BLOCK_Q * QUERIES_PER_KV) & (tok <= last_tok)
    # Padding rows take the block's last position so no row is ever fully masked.
    row_pos = context + tl.where(row_ok, tok, last_tok)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt_seq
    k_head_off = kv_head * stride_kc_head
    v_head_off = kv_head * stride_vc_head
    if OFFS64:
        k_head_off = k_head_off.to(tl.int64)
        v_head_off = v_head_off.to(tl.int64)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        # (NEW_KV tiles are 16-bit rows of this step: they would need a 16-bit query as is)
        if F16_PRODUCTS and NEW_KV == 0 and q.dtype == tl.bfloat16:
            q, scale_log2 = _query_as_float16(q, scale_log2)

    kv_end = context + last_tok + 1
    # Keys 0..context+first_tok are visible to every row: whole tiles there need no mask.
    free_end = ((context + first_tok + 1) // TILE_N) * TILE_N
    # The caches serve keys 0..cache_end: all of them, or (NEW_KV) the earlier context only.
    cache_end = kv_end
    if NEW_KV:
        cache_end = context
        free_end = (context // TILE_N) * TILE_N
    for tile_start in range(0, free_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            m_i, l_i, acc, q, k_cache_ptr, v_cache_ptr, bt_row, k_head_off, v_head_off,
            tile_start, cache_end, row_pos, scale_log2,
            stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, True, IEEE, UPCAST, KV_FP8,
            0, OFFS64, True,
        )  # fmt: skip
    for tile_start in range(free_end, cache_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            m_i, l_i, acc, q, k_cache_ptr, v_cache_ptr, bt_row, k_head_off, v_head_off,
            tile_start, cache_end, row_pos, scale_log2,
            stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, True, IEEE, UPCAST, KV_FP8,
            0, OFFS64, True,
        )  # fmt: skip
    if NEW_KV:
        # Position p of the chunk's own keys is row q_start + p - context of k_new / v_new.
        row_base = q_start - context
        if NEW_KV == 2:  # descriptors address [row, column] of the [tokens, kv_heads * dim] view
            kn_off = kv_head * HEAD_DIM
            vn_off = kv_head * HEAD_DIM
        else:
            kn_off = kv_head * stride_kn_head
            vn_off = kv_head * stride_vn_head
        own_free = context + ((first_tok + 1) // TILE_N) * TILE_N
        for tile_start in range(context, own_free, TILE_N):
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, q, k_new, v_new, row_base, kn_off, vn_off,
                tile_start, kv_end, row_pos, scale_log2,
                0, stride_kn_tok, 0, stride_vn_tok,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, True, IEEE, UPCAST, False,
                NEW_KV, OFFS64, True,
            )  # fmt: skip
        for tile_start in range(own_free, kv_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                m_i, l_i, acc, q, k_new, v_new, row_base, kn_off, vn_off,
                tile_start, kv_end, row_pos, scale_log2,
                0, stride_kn_tok, 0, stride_vn_tok,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, True, IEEE, UPCAST, False,
                NEW_KV, OFFS64, True,
            )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    result = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
