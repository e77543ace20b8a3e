"""Launchers of the attention kernels (``triton_kernels.py``): tile configurations, the
flash-decoding split choice, grids.

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernels, CPU tensors
the same kernels in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from pagedattn_kernels.attention.plan import DecodePlan
from pagedattn_kernels.common import (
    FP8_DTYPE,
    capability,
    is_interpreted,
    kernels_for,
    next_power_of_2,
    scale_or_unit,
    sm_count,
    use_pdl,
)

KERNELS = "pagedattn_kernels.attention.triton_kernels"

MAX_HEAD_DIM = 256
# Below this many query rows the prefill kernel reads the new rows by pointers: building two
# tensor descriptors costs host time that a short pass does not win back (on an H200 at 1,024
# tokens the descriptor path ran at 125 TFLOP/s, the cache gather at 163).
TMA_MIN_TOKENS = 2048
# Split a sequence no finer than this many tokens: below it the merge costs more than it saves.
MIN_PARTITION = 256
MAX_SPLITS = 256
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension
# (partial row, query head) pairs a program of ``decode_merge_kernel`` loads at once: 16
# partial rows of a group of four heads (Llama-3's), 64 registers a thread in four warps
MERGE_ROWS = 64


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tile shape of the decode kernel: TILE_N keys per loop step. ``per_sm``: how many of
    its programs fit on one SM at once (registers and shared memory), used to size the
    flash-decoding split so that the programs make about one full wave, and a decode plan's
    lanes (``tests/kernels/test_occupancy.py`` checks it against the compiled kernels).
    ``saturate_per_sm``: with fewer splits, as few programs an SM as read at the copy
    bandwidth (``choose_num_splits``). ``early_v``: load
    each V tile with its K tile rather than after the softmax (``_attend_tile``'s EARLY_V;
    the prefill kernel always does). ``f16_products``: on an fp8 cache with bfloat16
    queries, multiply in float16 rather than bfloat16 (``_query_as_float16`` says why and
    what it costs); off, the tiles are converted to bfloat16 as for the other caches.
    ``packed_loads``: on an fp8 cache with 16-bit queries, load K and V tiles as int32 words
    (``_attend_tile``'s PACKED): no byte-wise shared-memory reads. Off by default: slower on an
    H200 (46.7% of the copy bandwidth against 63.8% at 64 x 4k, ``sweep_decode_fp8``): the
    words are loaded into registers, probably outside the compiler's software pipeline.
    ``one_loop``: the ragged last tile inside the pipelined loop, every tile masked
    (``decode_kernel``'s ONE_LOOP), rather than unmasked whole tiles and the ragged one after
    the loop."""

    tile_n: int
    num_warps: int
    num_stages: int
    per_sm: int = 2
    saturate_per_sm: int | None = None
    early_v: bool = False
    f16_products: bool = True
    packed_loads: bool = False
    one_loop: bool = False


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile shape of the prefill kernel: BLOCK_M query rows (tokens x grouped heads) per
    program, TILE_N keys per loop step. ``f16_products``: as ``DecodeConfig``'s, where every
    key comes from an fp8 cache."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    f16_products: bool = True


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16.
    return max(16, next_power_of_2(head_dim))


#: fp8 caches: from this many (sequence, KV head) pairs on, the decode kernel takes narrow
#: tiles (``decode_config``): ``FP8_NARROW``, 64 tokens and two warps per program (255
#: registers and 22 KB of shared memory at head dim 128 on sm_90: four programs per SM) ...
FP8_NARROW_TILE_PAIRS = 256
FP8_NARROW = DecodeConfig(tile_n=64, num_warps=2, num_stages=3, per_sm=4)
#: ... and from this many on ``FP8_ONE_WARP``, 32 tokens and one warp per program (212
#: registers and 12 KB of shared memory: nine programs fit an SM, but splits and plans sized
#: for nine ran slower on an H200 than for eight: 68.6 against 50.5 us at 16 x 4k, 29.0
#: against 24.2 by plans at 16 x 1,400, 43.6 against 36.9 at 64 x 700; ``gpu_runs/2026-12-04e/``).
#: ``PAGEDATTN_FP8_ONE_WARP_PAIRS`` (read at import) moves the threshold, for A/B runs of a
#: whole benchmark (a huge value: never one warp).
FP8_ONE_WARP_PAIRS = int(os.environ.get("PAGEDATTN_FP8_ONE_WARP_PAIRS", "512"))
FP8_ONE_WARP = DecodeConfig(tile_n=32, num_warps=1, num_stages=3, per_sm=8)
#: Without a plan, once the batch holds this many (sequence, KV head) pairs x tokens of its
#: context bound (16k tokens a KV head at Llama-3's eight), ``FP8_LONG`` instead of all the
#: above: one warp, 64-token tiles, two pipeline stages (250 registers, 20 KB of shared memory:
#: eight programs an SM). On an H200 (CUDA graphs, ``gpu_runs/2026-12-04e/fp8_*.log``) it took
#: 138.9 us at 64 x 4k against 148.8 for ``FP8_ONE_WARP`` (93.6% of the script's copy
#: bandwidth), 262.5 against 287.4 at 256 x 2k, 110.5-225.3 against 121.8-243.0 over the
#: contexts of a ShareGPT run at 256-768 sequences, and against the tiles chosen before:
#: 79.2 against 97.4 at 32 x 4k (``FP8_NARROW``), 79.5 against 103.2 at 16 x 8k, 19.5 against
#: 25.8 at 4 x 4k, 27.6 against 34.8 at 1 x 32k (wide tiles). Below the threshold it lost:
#: 15.4 against 10.9 us at 1 x 2k, 17.8 against 16.0 at 1 x 8k, 22.9 against 15.1 at 16 x 512.
#: Decode plans keep 32-token tiles (``FP8_PLANNED_ONE_WARP``; 64-token ones were slower
#: there: 51.5 against 46.2 us at 128 sequences). ``PAGEDATTN_FP8_LONG_PAIR_TOKENS`` (read at
#: import; a huge value: never) moves the threshold, for A/B runs.
FP8_LONG_PAIR_TOKENS = int(os.environ.get("PAGEDATTN_FP8_LONG_PAIR_TOKENS", str(8 * 16384)))
FP8_LONG = DecodeConfig(tile_n=64, num_warps=1, num_stages=2, per_sm=8)
#: ... but by a decode plan (``planned``) from this many pairs on: a plan cuts the contexts
#: into chunks for all the lanes of eight programs an SM, which the automatic splits do not.
FP8_PLANNED_ONE_WARP_PAIRS = 64
#: By a plan, the one-warp tiles take two pipeline stages, not three (206 registers, nine
#: programs an SM as with three): chunks of a plan are short (128+ tokens, four to eight
#: tiles), so a third stage in flight mostly fills the pipeline at each chunk's start. On an
#: H200 (CUDA graphs, the contexts of the real ShareGPT run, plans of min chunk 128, two
#: rounds interleaved; ``gpu_runs/2026-12-04f/planned_onewarp_stages_fb6d201.log``) 15.2 /
#: 18.2 / 29.7 / 45.5 / 67.7 us at 16 / 32 / 64 / 128 / 256 sequences against 15.4-15.6 /
#: 18.5 / 30.4 / 46.3-46.4 / 68.4 with three: faster at every size, by 1-2.6%.
#: ``PAGEDATTN_FP8_PLANNED_STAGES`` (read at import) sets the stages, for A/B runs.
FP8_PLANNED_ONE_WARP = DecodeConfig(
    tile_n=32, num_warps=1, num_stages=int(os.environ.get("PAGEDATTN_FP8_PLANNED_STAGES", "2")),
    per_sm=8,
)


def decode_config(
    head_dim: int, dtype: torch.dtype, interpreted: bool = False,
    kv_dtype: torch.dtype | None = None, num_pairs: int | None = None, planned: bool = False,
    context_bound: int | None = None,
) -> DecodeConfig:  # fmt: skip
    """Wide key tiles (32 KB of K per step in 16-bit types), two pipeline stages: measured on
    an H200 (bench sweeps) at 96% of copy bandwidth for batch 64 x 4k context, against 71% for
    64-token tiles with three stages. Three such programs fit an SM at head dim 128 (72 KB of
    shared memory each; 128 registers a thread unsplit, 160 split, Triton 3.6 on sm_90), so
    the split count is sized for three (``per_sm``; until 2026-12-04 it said two, from a
    kernel of 190 registers: 64 sequences then ran as 1.3 waves). On an H200 (CUDA graphs)
    that took 64 x 4k from 274.7 to 249.1 us, 64 x 8k from 542.2 to 488.6, 64 x 32k from
    2,319 to 1,981 and 32 x 4k from 171.7 to 134.3 (two or three splits where there were
    none); with ``saturate_per_sm`` = 2, one-wave splits stay at two programs an SM, which
    read as fast (``choose_num_splits``; ``gpu_runs/2026-12-04e/``). By a decode plan the
    lanes stay two programs an SM: three were no faster over the contexts of a ShareGPT run
    (4-64 sequences: 126.1 against 125.0 us summed) and slower where equal contexts fell
    just over a chunk (32 x 1,000: 42.6 against 37.7 us).
    Every tile is masked and the ragged last one is loaded inside the pipelined loop
    (``one_loop``) rather than on its own after it: in the engine's graphs (bound 2,048) on an
    H200 that took Llama-3-8B's decode attention from 23.5 to 22.5 us at 16 x 900, 58.2 to
    53.9 at 48 x 900, 74.0 to 67.0 at 128 x 500 and 140.0 to 129.5 (98% of the copy
    bandwidth) at 256 x 500 (8c1dddc); long contexts, where the ragged tile is a small share,
    are unchanged: 280.8 against 280.7 us at 64 x 4k, 129.8 against 130.3 at 16 x 8k
    (2b5b50b; ``scripts/decode_fp8_engine_shapes.py``).

    fp8 caches (``kv_dtype``): the same 128-token tiles hold half the bytes, so a third
    pipeline stage keeps as many bytes in flight (3 x 32 KB of K and V per program). With
    ``num_pairs`` (sequences x KV heads) of ``FP8_NARROW_TILE_PAIRS`` or more, narrower
    programs instead: many small programs, several per SM for the split count. On an H200
    (Llama-3-8B heads, CUDA graphs) 64-token tiles of two warps (``FP8_NARROW``) read 74.0%
    of the copy bandwidth at 64 x 4k against 69.3% for the wide tiles, 66.5% against 59.3% at
    256 x 512, and took 43.4 us against 51.2 at 48 x 900 at the engine's bound of 2,048
    (``docs/performance/gpu_runs/2026-12-01f/decode_key_major_28a3833.log``, 8c1dddc).

    From ``FP8_ONE_WARP_PAIRS`` on, one warp per program and 32-token tiles
    (``FP8_ONE_WARP``), eight programs per SM: programs that never wait for one another. In
    a program of several warps each tile's scores are split across the warps, so every
    tile's row maximum and sum, and the probabilities on their way to the P.V operand, cross
    warps through shared memory behind barriers; a single warp keeps all of that in its
    registers and shuffles. On an H200 (``gpu_runs/2026-12-02e/decode_bigshapes_tiles_*.log``,
    ``decode_onewarp_*.log``) one warp read 82.4% of the copy bandwidth at 384 x 600 against
    66.0% for ``FP8_NARROW`` (139.0 against 173.4 us; the bfloat16 cache took 221.5),
    79.7% against 62.2% at 768 x 450 and 72.9% against 60.1% at 128 x 500; two warps of 32
    tokens ran at 48-52%, four warps of 64 at 42-45%. With fewer pairs it gains nothing: 47.0
    against 44.3 us at 48 x 900 (384 pairs), 36.6 against 37.5 at 64 x 700 (512), 32.2
    against 31.8 at 32 x 900 (256). With fewer than ``FP8_NARROW_TILE_PAIRS`` pairs the wide
    tiles stay (narrow ones lost there: 43.0% against 61.7% at 16 x 8k, 36.1% against 47.3%
    at 1 x 32k). The ragged tile stays after the loop on fp8 caches: inside it was slower
    there (8c1dddc).

    ``context_bound`` (the call's bound on its contexts; the launcher passes it without a
    plan): once ``num_pairs`` x ``context_bound`` reaches ``FP8_LONG_PAIR_TOKENS``,
    ``FP8_LONG`` (one warp, 64-token tiles, two stages), faster than each of the above there
    (its comment has the figures).

    ``planned`` (the call runs by a decode plan, ``attention.plan``): one warp from
    ``FP8_PLANNED_ONE_WARP_PAIRS`` (64) pairs on, in two pipeline stages
    (``FP8_PLANNED_ONE_WARP``). Without a plan one warp lost below 512 pairs
    (above), but a plan balances the batch's contexts over all the lanes of eight programs an
    SM. On an H200 (d6eeae7, ``scripts/gpu_tail_tile_call.sh attn``: Llama-3-8B heads, the
    contexts of the real ShareGPT run's last decode steps, plans of min chunk 128, CUDA
    graphs) one warp took 18.3 us against 19.6 for the wide tiles at 8 x 1,500, 24.1 against
    27.8 at 16 x 1,400, 29.2 against 34.0 at 32 x 1,000 (at 64 x 700, 512 pairs, one warp was
    already the choice: 36.9 against 46.2), and lost at 1-4 sequences (13.8 against 11.1 us at 1 x 1,800, 15.5 against 14.6 at 4 x
    1,600). In the fp8 run the passes of 1-64 sequences took 3.46 against 3.52 ms (14,954
    against 14,848 tok/s, one round each)."""
    if interpreted:  # the interpreter pays per operation: few, wide tiles
        return DecodeConfig(tile_n=64, num_warps=4, num_stages=1)
    dpad = padded_head_dim(head_dim)
    if kv_dtype == FP8_DTYPE and dtype.itemsize == 2:
        if dpad <= 128 and num_pairs is not None:
            if (not planned and context_bound is not None
                    and num_pairs * context_bound >= FP8_LONG_PAIR_TOKENS):  # fmt: skip
                return FP8_LONG
            if planned and num_pairs >= FP8_PLANNED_ONE_WARP_PAIRS:
                return FP8_PLANNED_ONE_WARP
            if not planned and num_pairs >= FP8_ONE_WARP_PAIRS:
                return FP8_ONE_WARP
            if num_pairs >= FP8_NARROW_TILE_PAIRS:
                return FP8_NARROW
        return DecodeConfig(tile_n=128 if dpad <= 128 else 64, num_warps=4, num_stages=3)
    if dtype.itemsize == 4:  # fp32: tf32x3 dots hold split operands in registers: small tiles
        return DecodeConfig(tile_n=32 if dpad <= 128 else 16, num_warps=4, num_stages=2)
    # lanes of two programs an SM by a plan (measured; see the docstring), three without
    return DecodeConfig(tile_n=128 if dpad <= 128 else 64, num_warps=4, num_stages=2,
                        per_sm=2 if planned else 3, saturate_per_sm=None if planned else 2,
                        one_loop=True)  # fmt: skip


def prefill_config(
    head_dim: int, dtype: torch.dtype, queries_per_kv: int, interpreted: bool = False
) -> PrefillConfig:
    dpad = padded_head_dim(head_dim)
    if interpreted:  # the interpreter pays per operation: few, large tiles
        cfg = PrefillConfig(64, 64, 4, 1)
    elif dtype.itemsize == 2:  # H200 sweep at 4k tokens: 128x128 tiles 341 TFLOP/s, 128x64 300
        cfg = PrefillConfig(128, 128, 8, 3) if dpad <= 128 else PrefillConfig(64, 64, 8, 2)
    else:  # fp32 (tf32x3 dots, ~fp32 accurate) is for correctness, not speed: small tiles
        cfg = PrefillConfig(32, 32, 4, 2) if dpad <= 128 else PrefillConfig(16, 32, 4, 1)
    block_m = max(cfg.block_m, next_power_of_2(queries_per_kv), 16)
    return PrefillConfig(block_m, cfg.tile_n, cfg.num_warps, cfg.num_stages)


@functools.lru_cache(maxsize=4096)  # pure in its ints; weighing 100 counts costs ~50 us
def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, per_sm: int = 2,
    saturate_per_sm: int | None = None, tile_n: int = 1,
) -> int:  # fmt: skip
    """How many programs share one (sequence, KV head) in flash-decoding.

    The programs run in waves of ``per_sm * num_sms`` (the program slots); a partial last
    wave costs about as much as a full one (a sweep on an H200 put 48 splits of a 32k
    context ahead of 64 and 66; at 16 x 4k, 2 splits ran at 90% of the copy bandwidth, 3 at
    82%). So take the split count whose programs fill their waves best (the fewest splits
    among equals), never splitting a sequence below MIN_PARTITION tokens nor going past two
    waves' worth of programs; with two full waves of (sequence, KV head) pairs or more, no
    split: the GPU balances that many programs itself. (Before, pairs that filled one wave
    were not split: 48 sequences x 8 KV heads made 1.45 waves, and a Llama-3-8B decode step
    of 48 sequences read its cache at 72% of the bandwidth; 2 splits make 2.9 waves.)

    ``saturate_per_sm``: how many programs an SM needs to read at the copy bandwidth, when
    fewer than ``per_sm``. If the fullest split count makes one wave (every program resident
    at once), fewer splits that give every SM about that many (90-100% of
    ``saturate_per_sm * num_sms`` programs) are taken instead:
    each SM reads the same bytes, in fewer, longer programs, with fewer partial results to
    merge and fewer ragged last tiles. On an H200 the 16-bit kernel (three programs an SM)
    took 71.3 us at 16 x 4k with 2 splits (256 programs) against 77.0 with 3 (384, the
    fullest wave), 40.6 against 43.3 at 16 x 2k, 39.4 against 43.3 at 8 x 4k with 4 splits
    against 6 (``gpu_runs/2026-12-04e/splits_bf16_*.log``).

    ``tile_n``: the kernel's tile; a split sequence's partitions are whole tiles, so a split
    count can give fewer partitions than it says (``_partition``): only counts the grid can
    really have are weighed, and the count returned is one of them.
    """
    base = num_seqs * num_kv_heads
    slots = per_sm * num_sms
    if base == 0 or max_seq_len <= MIN_PARTITION or base >= 2 * slots:
        return 1
    most = min(-(-max_seq_len // MIN_PARTITION), MAX_SPLITS, -(-2 * slots // base))

    def filled(splits: int) -> float:
        programs = base * splits
        return programs / (-(-programs // slots) * slots)

    # the split counts the grid can have: partitions are whole tiles (_partition)
    counts = sorted({_partition(max_seq_len, s, tile_n)[1] for s in range(1, most + 1)})
    best = max(counts, key=lambda splits: (filled(splits), -splits))
    if saturate_per_sm and saturate_per_sm < per_sm and base * best <= slots:
        few = saturate_per_sm * num_sms  # no SM given more than saturate_per_sm programs
        best = next((s for s in counts if s < best and 0.9 * few <= base * s <= few), best)
    return best


def _partition(max_seq_len: int, num_splits: int, tile_n: int) -> tuple[int, int]:
    """The longest sequence's partition (a multiple of tile_n) and the split count it really
    gives: the grid's. (Each sequence divides its own length, ``_split_length``.)"""
    size = -(-max(max_seq_len, 1) // num_splits)
    size = -(-size // tile_n) * tile_n
    return size, -(-max(max_seq_len, 1) // size)


def _needs_64bit_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into any of ``tensors`` (from its own start) can pass 2^31 - 1,
    so that the kernels must compute offsets in 64 bits. 32-bit offsets save registers and
    address arithmetic: the prefill kernel ran 7-13% faster with them on an H200
    (``scripts/prefill_variants.py``)."""
    return any(_span_needs_64bit(t.shape, t.stride()) for t in tensors)


@functools.lru_cache(maxsize=256)  # a cache's layout rarely changes: skip the arithmetic
def _span_needs_64bit(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    if 0 in shape:
        return False
    return sum((size - 1) * abs(stride) for size, stride in zip(shape, strides)) >= 2**31 - 1


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """float32 working memory of the flash-decoding split (partial outputs and their
    log-sum-exps), left uninitialised: the merge reads only what the splits wrote (the tests
    poison it with NaN to check that)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def _word_aligned(cache: torch.Tensor) -> bool:
    """Rows of ``cache`` can be read as 4-byte words: base, strides and head dim (fp8: bytes)
    multiples of 4."""
    return (cache.data_ptr() % 4 == 0 and cache.shape[-1] % 4 == 0
            and all(st % 4 == 0 for st in cache.stride()[:-1]))  # fmt: skip


def _packed(kernels, cfg: DecodeConfig, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The decode kernel's PACKED: ``cfg.packed_loads`` where the caches allow it."""
    if (cfg.packed_loads and key_cache.dtype == FP8_DTYPE and _word_aligned(key_cache)
            and _word_aligned(value_cache)):  # fmt: skip
        return 1 if is_interpreted(kernels.decode_kernel) else 2
    return 0


def _dot_ieee(dtype: torch.dtype) -> bool:
    # fp32 inputs: fp32-accurate products (3xTF32 on tensor cores; plain tf32 would cost
    # ~1e-3 relative error).
    return dtype == torch.float32


def _upcast(kernel: object, dtype: torch.dtype) -> bool:
    """bfloat16 dots must run in fp32 under the interpreter (see ``_attend_tile``)."""
    return dtype == torch.bfloat16 and is_interpreted(kernel)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
    out: torch.Tensor,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    seq_order: torch.Tensor | None = None,
    min_partition: int | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """``plan`` (a ``DecodePlan`` on the query's device, built by ``plan_decode`` for these
    rows): which program attends which chunk of which row, in place of the split count and
    ``seq_order`` (``attention.plan`` says why).

    ``seq_order`` (int32 [num_seqs], a permutation of the rows): the order in which the
    GPU starts the sequences' programs; the output is the same in any order.

    Why an order: the GPU starts a kernel's programs in grid order as program slots free up,
    and the grid puts all of a sequence's programs (every KV head and split) next to each
    other, sequence after sequence. A decode batch mixes contexts of tens and of
    thousands of tokens, and without a split a sequence's program runs for as long as its
    context: a long one that comes late in the batch keeps a few slots busy after every
    other program has finished. Longest first (list scheduling's classic rule), the long
    programs start at once and the short ones fill in around them. On an H200, 384 sequences
    with the contexts of a real ShareGPT run (``scripts/decode_fp8_engine_shapes.py
    --lengths``) on an fp8 cache took 155.9 us in batch order and 113.0 longest first (46.8%
    and 64.6% of the copy bandwidth; the same bytes in equal contexts: 94.8 us); on a
    bfloat16 cache 157.0 and 144.2 (``docs/performance/gpu_runs/2026-12-02f/``). Splitting
    the long sequences as well (four programs of at least 512 tokens) was slower: 169.5 us.

    ``min_partition``: the fewest tokens a split sequence gives one program (rounded up to
    whole tiles); None: ``MIN_PARTITION`` with the automatic split count, one tile with a
    forced one (tests split short contexts on purpose)."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    if num_seqs > MAX_GRID_Z:  # the sequences are the grid's third dimension
        raise ValueError(f"paged_decode_attention: at most {MAX_GRID_Z} sequences a call, got "
                         f"{num_seqs}")  # fmt: skip
    _, block_size, num_kv_heads, _ = key_cache.shape
    kernels = kernels_for(query.device, KERNELS)
    # Without a hint, the block table's width bounds every context (no device sync needed).
    bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    cfg = config or decode_config(head_dim, query.dtype, is_interpreted(kernels.decode_kernel),
                                  key_cache.dtype, num_seqs * num_kv_heads,
                                  planned=plan is not None, context_bound=bound)  # fmt: skip
    if plan is not None:
        return _planned_decode(kernels, cfg, plan, query, key_cache, value_cache, block_tables,
                               seq_lens, scale, out, k_scale, v_scale)  # fmt: skip
    # The smallest share of a split sequence (the kernel's partition_size). Unused without a
    # split.
    least = min_partition or cfg.tile_n
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, bound, sm_count(query.device),
                                       cfg.per_sm, cfg.saturate_per_sm, cfg.tile_n)  # fmt: skip
        least = min_partition or MIN_PARTITION
    min_partition = -(-least // cfg.tile_n) * cfg.tile_n
    _, num_splits = _partition(bound, max(1, num_splits), cfg.tile_n)
    split = num_splits > 1
    if split:  # one allocation for both partial buffers (host time matters at small sizes)
        rows = num_seqs * num_heads * num_splits
        work = _scratch(rows * (head_dim + 1), query.device)
        part_out = work[: rows * head_dim].view(num_seqs, num_heads, num_splits, head_dim)
        part_lse = work[rows * head_dim :].view(num_seqs, num_heads, num_splits)
    else:
        part_out = part_lse = out  # unused by the kernel
    pdl = use_pdl(query.device)
    _launch_decode(
        kernels, cfg, (num_kv_heads, num_splits, num_seqs), out, part_out, part_lse, query,
        key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
        min_partition, part_out.stride(2) if split else 0,
        order=seq_order, pdl=pdl, SPLIT=split, ORDERED=seq_order is not None,
    )  # fmt: skip
    if split:
        os_, po, pl = out.stride(), part_out.stride(), part_lse.stride()
        kernels.decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, min_partition, num_splits, os_[0], os_[1],
            po[0], po[1], po[2], pl[0], pl[1],
            HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim),
            SPLITS_PAD=max(2, next_power_of_2(num_splits)), TILE_N=cfg.tile_n, PDL=pdl,
            launch_pdl=pdl, num_warps=4,
        )  # fmt: skip
    return out


def _launch_decode(
    kernels, cfg: DecodeConfig, grid: tuple[int, int, int], out: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, query: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, partition_size: int, stride_po_split: int,
    *, pdl: bool, order: torch.Tensor | None = None, work: torch.Tensor | None = None,
    **modes: bool,
) -> None:  # fmt: skip
    """One ``decode_kernel`` launch over ``grid``, the partial buffers' strides taken from
    ``part_out`` / ``part_lse`` (rows, heads[, split]); ``modes``: its SPLIT / ORDERED / WORK
    flags. The unused pointers (``order``, ``work``) get ``seq_lens``. ``pdl``: the caller's
    ``use_pdl``, which its own merge launch needs too. Each tensor's strides are read once, as
    a tuple: an eager call's host time is mostly such Python (``scripts/decode_host_time.py``)."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    qpk = num_heads // num_kv_heads
    qs, os_, ks, vs = query.stride(), out.stride(), key_cache.stride(), value_cache.stride()
    po, pl = part_out.stride(), part_lse.stride()
    kernel = kernels.decode_kernel
    kernel[grid](
        out, part_out, part_lse, query, key_cache, value_cache, block_tables, seq_lens,
        seq_lens if order is None else order, seq_lens if work is None else work,
        scale_or_unit(k_scale, key_cache), scale_or_unit(v_scale, value_cache),
        scale * 1.4426950408889634, partition_size,
        qs[0], qs[1], os_[0], os_[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        block_tables.stride(0), po[0], po[1], stride_po_split, pl[0], pl[1],
        QUERIES_PER_KV=qpk, BLOCK_G=max(16, next_power_of_2(qpk)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), BLOCK_SIZE=block_size,
        TILE_N=cfg.tile_n, IEEE=_dot_ieee(query.dtype),
        UPCAST=_upcast(kernel, query.dtype), KV_FP8=key_cache.dtype == FP8_DTYPE,
        OFFS64=_needs_64bit_offsets(key_cache, value_cache), EARLY_V=cfg.early_v,
        F16_PRODUCTS=cfg.f16_products, PACKED=_packed(kernels, cfg, key_cache, value_cache),
        ONE_LOOP=cfg.one_loop, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **modes,
    )  # fmt: skip


def decode_lanes(
    num_seqs: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    kv_dtype: torch.dtype, device: torch.device,
) -> tuple[DecodeConfig, int]:  # fmt: skip
    """The decode kernel's configuration for ``num_seqs`` rows by a plan (``decode_config``'s
    ``planned``), and how many of its programs of one KV head the GPU runs at once (the plan's
    lanes: program slots over KV heads)."""
    kernels = kernels_for(device, KERNELS)
    cfg = decode_config(head_dim, dtype, is_interpreted(kernels.decode_kernel), kv_dtype,
                        num_seqs * num_kv_heads, planned=True)  # fmt: skip
    return cfg, max(1, cfg.per_sm * sm_count(device) // num_kv_heads)


def _planned_decode(kernels, cfg: DecodeConfig, plan: DecodePlan, query: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``paged_decode_attention`` by a plan: one decode program per (KV head, item), then one
    merge program per (split row, KV head)."""
    if plan.tile_n != cfg.tile_n:
        raise ValueError(f"paged_decode_attention: the plan's chunks are in tiles of "
                         f"{plan.tile_n} tokens, the kernel's tiles {cfg.tile_n}: plan with "
                         f"the same rows, dtypes and device")  # fmt: skip
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    qpk = num_heads // num_kv_heads
    items, merges = plan.work.shape[0], plan.merges.shape[0]
    rows = items * num_heads
    work = _scratch(rows * (head_dim + 1), query.device)
    part_out = work[: rows * head_dim].view(items, num_heads, head_dim)
    part_lse = work[rows * head_dim :].view(items, num_heads)
    pdl = use_pdl(query.device)
    _launch_decode(
        kernels, cfg, (num_kv_heads, items, 1), out, part_out, part_lse, query, key_cache,
        value_cache, block_tables, seq_lens, scale, k_scale, v_scale, cfg.tile_n, 0,
        work=plan.work, pdl=pdl, SPLIT=False, WORK=True,
    )  # fmt: skip
    if merges:
        group = next_power_of_2(qpk)
        kernels.decode_merge_kernel[(merges, num_kv_heads)](
            out, part_out, part_lse, plan.merges, out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
            QUERIES_PER_KV=qpk, GROUP_PAD=group, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_power_of_2(head_dim), PARTS_PAD=max(1, MERGE_ROWS // group),
            PDL=pdl, launch_pdl=pdl, num_warps=4,
        )  # fmt: skip
    return out


def compiled_as(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` with only what the kernel is compiled for: ``per_sm`` and ``saturate_per_sm``
    size the grid, they are no compile-time argument."""
    return dataclasses.replace(cfg, per_sm=0, saturate_per_sm=None)


def decode_variants(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, num_kv_heads: int,
    max_num_seqs: int, max_seq_len: int,
) -> tuple[list[DecodeConfig], list[tuple[DecodeConfig, int]], int]:  # fmt: skip
    """What ``warm_up_decode`` must compile for calls of at most ``max_num_seqs`` rows and
    contexts of at most ``max_seq_len``: the configurations ``decode_config`` can pick without
    a plan (by the pair count and the context bound), those it picks by a plan with the
    fewest rows that select each, and the most splits ``choose_num_splits`` can give. Two
    configurations that differ only in ``per_sm`` compile to the same kernel: one of them."""
    alone: dict[DecodeConfig, DecodeConfig] = {}
    planned: dict[DecodeConfig, tuple[DecodeConfig, int]] = {}
    for n in range(1, max_num_seqs + 1):
        pairs = n * num_kv_heads
        for bound in (1, max_seq_len):  # FP8_LONG depends on the bound, nothing else does
            cfg = decode_config(head_dim, dtype, False, kv_dtype, pairs, context_bound=bound)
            alone.setdefault(compiled_as(cfg), cfg)
        cfg = decode_config(head_dim, dtype, False, kv_dtype, pairs, planned=True)
        planned.setdefault(compiled_as(cfg), (cfg, n))
    most = min(-(-max(max_seq_len, 1) // MIN_PARTITION), MAX_SPLITS)
    return list(alone.values()), list(planned.values()), most


def warm_up_decode(
    num_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype,
    max_num_seqs: int, max_seq_len: int, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """Compile now every variant of the decode kernels that calls on these caches can need,
    and return how many calls that took (0 in the interpreter: nothing to compile).

    Triton compiles a kernel the first time it meets a new combination of its compile-time
    arguments, about a second each on an H200 host. A CUDA graph's capture compiles what
    its replays run, but eager calls (a mixed pass's decode rows) pick their tiles and their
    split count from the batch in hand: the configuration (``decode_config``), split or not,
    ordered or not, and the merge kernel's padded split count, with the partial buffers'
    strides (the split count's own divisibility by 16 is specialized). So each configuration
    is launched here once with every split count from 1 to the most a call can have, with
    and without an order, on rows of length 0 (every program exits at once), and by a plan
    with the rows that select each planned configuration."""
    kernels = kernels_for(key_cache.device, KERNELS)
    if is_interpreted(kernels.decode_kernel):
        return 0
    from pagedattn_kernels.attention.plan import plan_decode

    _, block_size, num_kv_heads, head_dim = key_cache.shape
    device = key_cache.device
    alone, planned, most = decode_variants(head_dim, dtype, key_cache.dtype, num_kv_heads,
                                           max_num_seqs, max_seq_len)  # fmt: skip
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(query)
    lens = torch.zeros(1, dtype=torch.int32, device=device)
    order = torch.zeros(1, dtype=torch.int32, device=device)
    tables = torch.zeros(1, -(-max(max_seq_len, 1) // block_size), dtype=torch.int32,
                         device=device)  # fmt: skip
    calls = 0
    for cfg in alone:
        for splits in range(1, most + 1):
            for seq_order in (None, order):  # a bound of `splits` tiles gives `splits` splits
                paged_decode_attention(query, key_cache, value_cache, tables, lens, 1.0,
                                       splits * cfg.tile_n, out, num_splits=splits, config=cfg,
                                       k_scale=k_scale, v_scale=v_scale, seq_order=seq_order)  # fmt: skip
                calls += 1
    for cfg, n in planned:  # one row split into chunks (the merge kernel too), the rest short
        rows = [max_seq_len] + [1] * (n - 1)
        plan = plan_decode(rows, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                           kv_dtype=key_cache.dtype, device=device).to(device)  # fmt: skip
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        paged_decode_attention(q, key_cache, value_cache, tables.repeat(n, 1),
                               torch.tensor(rows, dtype=torch.int32, device=device), 1.0,
                               max_seq_len, torch.empty_like(q), config=cfg, k_scale=k_scale,
                               v_scale=v_scale, plan=plan)  # fmt: skip
        calls += 1
    return calls


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: PrefillConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """``key``/``value``: this step's keys and values, row for row with ``query`` (see
    ``prefill_kernel``'s NEW_KV). ``tma``: read them through tensor descriptors (None: where
    the GPU has TMA and the rows suit it)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _, block_size, num_kv_heads, _ = key_cache.shape
    qpk = num_heads // num_kv_heads
    kernel = kernels_for(query.device, KERNELS).prefill_kernel
    cfg = config or prefill_config(head_dim, query.dtype, qpk, is_interpreted(kernel))
    block_q = cfg.block_m // qpk
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    new_kv, k_new, v_new = 0, key_cache, value_cache  # unused by the kernel when new_kv == 0
    if key is not None and value is not None:
        if tma is None:
            tma = num_tokens >= TMA_MIN_TOKENS and _tma_suits(key, value)
        if tma:
            k_new, v_new = _descriptor(key, cfg.tile_n), _descriptor(value, cfg.tile_n)
        else:
            k_new, v_new = key, value
        new_kv = 2 if tma else 1
    strides_new = (
        (key.stride(0), key.stride(1), value.stride(0), value.stride(1)) if new_kv else (0,) * 4
    )
    offs64 = _needs_64bit_offsets(key_cache, value_cache, *((key, value) if new_kv else ()))
    pdl = use_pdl(query.device)
    kernel[grid](
        out, query, key_cache, value_cache, k_new, v_new, block_tables, seq_lens, cu_query_lens,
        scale_or_unit(k_scale, key_cache), scale_or_unit(v_scale, value_cache),
        scale * 1.4426950408889634, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), *strides_new,
        QUERIES_PER_KV=qpk, BLOCK_Q=block_q, BLOCK_M=cfg.block_m,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), BLOCK_SIZE=block_size,
        TILE_N=cfg.tile_n, IEEE=_dot_ieee(query.dtype), UPCAST=_upcast(kernel, query.dtype),
        KV_FP8=key_cache.dtype == FP8_DTYPE, OFFS64=offs64, NEW_KV=new_kv,
        F16_PRODUCTS=cfg.f16_products, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _tma_suits(key: torch.Tensor, value: torch.Tensor) -> bool:
    """TMA (Hopper and later) takes a [rows, kv_heads * dim] view whose row stride is a
    multiple of 16 bytes, 16-byte aligned, with a power-of-two head dim."""
    if key.device.type != "cuda" or capability(key.device) < (9, 0):
        return False
    d = key.shape[2]
    return all(
        t.stride(2) == 1 and t.stride(1) == d and d == padded_head_dim(d)
        and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (key, value)
    )  # fmt: skip


def _descriptor(rows: torch.Tensor, tile_n: int):
    """A host-side tensor descriptor over ``rows`` [tokens, kv_heads, dim] seen as
    [tokens, kv_heads * dim], one tile = TILE_N rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = rows.view(rows.shape[0], rows.shape[1] * rows.shape[2])
    return TensorDescriptor.from_tensor(flat, [tile_n, rows.shape[2]])
