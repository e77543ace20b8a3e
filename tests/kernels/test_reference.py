"""The float64 reference itself, checked against an independent formulation (dense attention
on the contiguous context, written as one masked matrix product per sequence), and the
flash-decoding split choice."""

from __future__ import annotations

import dataclasses

import torch

from pagedattn_kernels import reference
from pagedattn_kernels.attention.triton_launch import _partition, choose_num_splits
from pagedattn_kernels.testing import random_paged_batch


def _dense(query, k, v, q_len, scale):
    """Attention of the last q_len positions of a contiguous context, all heads at once."""
    seq_len, num_kv_heads, _ = k.shape
    group = query.shape[1] // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq, dim]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q = query.transpose(0, 1)  # [heads, q_len, dim]
    scores = q @ k.transpose(1, 2) * scale
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def test_reference_matches_dense_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    lens, q_lens = [1, 17, 40, 33], [1, 17, 5, 1]
    b = random_paged_batch(gen, lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                           block_size=4, dtype=torch.float64)  # fmt: skip
    out = reference.paged_attention(
        b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_query_lens,
        scale=0.37,
    )  # fmt: skip
    cu = b.cu_query_lens.tolist()
    for i, (n, q) in enumerate(zip(lens, q_lens)):
        blocks = b.block_tables[i, : -(-n // 4)].long()
        k = b.key_cache[blocks].reshape(-1, 2, 16)[:n]
        v = b.value_cache[blocks].reshape(-1, 2, 16)[:n]
        want = _dense(b.query[cu[i] : cu[i + 1]], k, v, q, 0.37)
        assert torch.allclose(out[cu[i] : cu[i + 1]], want, rtol=1e-12, atol=1e-12)


def test_reference_cache_ops():
    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros(2, 4, 1, 2)
    key = torch.arange(6.0).reshape(3, 1, 2)
    reference.reshape_and_cache(key, -key, kc, vc, torch.tensor([5, -1, 0]))
    assert kc[1, 1].tolist() == [[0.0, 1.0]] and kc[0, 0].tolist() == [[4.0, 5.0]]
    assert vc[1, 1].tolist() == [[-0.0, -1.0]] and int((kc != 0).sum()) == 3
    kv = torch.arange(2 * 3 * 2.0).reshape(2, 3, 1, 1, 2)
    reference.copy_blocks(kv, torch.tensor([[0, 2]]))
    assert torch.equal(kv[:, 2], kv[:, 0])


def test_fp8_decode_tiles_by_pairs():
    """On fp8 caches, 256 (sequence, KV head) pairs or more take 64-token tiles of two warps,
    four programs per SM, and 512 or more 32-token tiles of one warp, eight per SM (faster
    on an H200 with many programs, slower with few); by a plan, one warp from 64 pairs;
    16-bit caches are unaffected; only 16-bit caches take the ragged tile into the loop."""
    from pagedattn_kernels.attention.triton_launch import (
        FP8_LONG,
        FP8_LONG_PAIR_TOKENS,
        FP8_NARROW_TILE_PAIRS,
        FP8_ONE_WARP,
        FP8_ONE_WARP_PAIRS,
        FP8_PLANNED_ONE_WARP,
        FP8_PLANNED_ONE_WARP_PAIRS,
        decode_config,
    )  # fmt: skip

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    narrow = decode_config(128, bf16, kv_dtype=fp8, num_pairs=FP8_NARROW_TILE_PAIRS)
    assert (narrow.tile_n, narrow.num_warps, narrow.num_stages, narrow.per_sm) == (64, 2, 3, 4)
    assert decode_config(128, bf16, kv_dtype=fp8, num_pairs=FP8_ONE_WARP_PAIRS - 1) == narrow
    one = decode_config(128, bf16, kv_dtype=fp8, num_pairs=FP8_ONE_WARP_PAIRS)
    assert (one.tile_n, one.num_warps, one.num_stages, one.per_sm) == (32, 1, 3, 8)
    assert decode_config(128, bf16).one_loop and decode_config(256, torch.float16).one_loop
    assert not decode_config(128, bf16, kv_dtype=fp8, num_pairs=4096).one_loop
    for pairs in (None, FP8_NARROW_TILE_PAIRS - 1, 128):  # 16 x 8k stays wide
        wide = decode_config(128, bf16, kv_dtype=fp8, num_pairs=pairs)
        assert (wide.tile_n, wide.num_warps, wide.num_stages) == (128, 4, 3)
    assert decode_config(128, bf16, num_pairs=4096) == decode_config(128, bf16)
    planned = {pairs: decode_config(128, bf16, kv_dtype=fp8, num_pairs=pairs, planned=True)
               for pairs in (FP8_PLANNED_ONE_WARP_PAIRS - 1, FP8_PLANNED_ONE_WARP_PAIRS, 300)}
    assert planned[FP8_PLANNED_ONE_WARP_PAIRS - 1].tile_n == 128  # 1-7 sequences: wide
    assert planned[FP8_PLANNED_ONE_WARP_PAIRS] == planned[300] == FP8_PLANNED_ONE_WARP
    # by a plan, two pipeline stages (chunks are short); otherwise the same tiles
    assert dataclasses.replace(FP8_PLANNED_ONE_WARP, num_stages=3) == FP8_ONE_WARP
    # 16-bit: the same tiles by a plan, whose lanes are two programs an SM where the split
    # count is sized for the three that fit
    by_plan, alone = decode_config(128, bf16, num_pairs=128, planned=True), decode_config(128, bf16)
    assert (alone.per_sm, alone.saturate_per_sm, by_plan.per_sm) == (3, 2, 2)
    assert dataclasses.replace(by_plan, per_sm=3, saturate_per_sm=2) == alone
    assert decode_config(256, bf16, kv_dtype=fp8, num_pairs=4096).tile_n == 64  # head dim 256
    # without a plan, FP8_LONG from FP8_LONG_PAIR_TOKENS pairs x tokens of the context bound,
    # whatever the pair count (1 x 32k and 64 x 4k; not 16 x 512 nor 1 x 8k); plans keep theirs
    long = {(pairs, bound): decode_config(128, bf16, kv_dtype=fp8, num_pairs=pairs,
                                          context_bound=bound)
            for pairs, bound in ((8, 32768), (512, 4096), (128, 512), (8, 8192))}  # fmt: skip
    assert long[8, 32768] == long[512, 4096] == FP8_LONG
    assert FP8_LONG_PAIR_TOKENS == 8 * 16384
    assert (FP8_LONG.tile_n, FP8_LONG.num_warps, FP8_LONG.num_stages, FP8_LONG.per_sm) == (64, 1, 2, 8)
    assert long[128, 512] == decode_config(128, bf16, kv_dtype=fp8, num_pairs=128)
    assert long[8, 8192].tile_n == 128
    assert decode_config(128, bf16, kv_dtype=fp8, num_pairs=512, planned=True,
                         context_bound=4096) == FP8_PLANNED_ONE_WARP  # fmt: skip
    assert decode_config(128, bf16, num_pairs=512, context_bound=4096) == decode_config(128, bf16)
    assert decode_config(128, bf16, interpreted=True, kv_dtype=fp8, num_pairs=4096).num_stages == 1


def test_split_choice():
    # 1 sequence x 8 KV heads on 132 SMs with 2 program slots each, 32k context: one wave of
    # 32 splits of 1024 tokens (256 programs).
    splits = choose_num_splits(1, 8, 32768, 132)
    size, real = _partition(32768, splits, 128)
    assert (splits, size, real) == (33, 1024, 32)
    # 16 sequences: 2 splits; enough (sequence, KV head) pairs to fill the GPU: no split.
    assert choose_num_splits(16, 8, 4096, 132) == 2
    assert choose_num_splits(64, 8, 4096, 132) == 1
    # 48 or 40 sequences: 384 or 320 pairs fill 1.45 or 1.2 waves of 264 slots; 2 splits
    # fill 2.9 or 2.4 (the fullest last waves within two waves' worth of programs).
    assert choose_num_splits(48, 8, 2048, 132) == 2
    assert choose_num_splits(40, 8, 2048, 132) == 2
    # Two full waves of pairs or more: no split.
    assert choose_num_splits(66, 8, 2048, 132) == 1
    assert choose_num_splits(100, 8, 2048, 132) == 1
    # Short contexts are never split below 256 tokens.
    assert choose_num_splits(1, 1, 600, 132) == 3
    assert choose_num_splits(4, 8, 256, 132) == 1
    assert choose_num_splits(0, 8, 4096, 132) == 1
    assert choose_num_splits(1, 8, 32768, 132, per_sm=4) == 66


def test_split_choice_by_whole_tiles_and_saturation():
    """The 16-bit kernel's counts (three programs an SM, two enough to saturate, 128-token
    tiles), each measured best on an H200 (``gpu_runs/2026-12-04e/splits_bf16_*.log``)."""
    def splits(num_seqs, context):
        return choose_num_splits(num_seqs, 8, context, 132, per_sm=3, saturate_per_sm=2,
                                 tile_n=128)  # fmt: skip

    # one wave at three an SM would be 384 programs: two an SM (256) read as fast
    assert splits(16, 4096) == splits(16, 2048) == 2
    assert splits(8, 4096) == 4
    # more than one wave: the fullest waves, as without saturate_per_sm
    assert splits(32, 4096) == splits(32, 2048) == 3
    assert splits(64, 4096) == splits(64, 1024) == 2
    assert splits(48, 4096) == 1
    # only counts the grid can have: 1 x 32k is never split into 99 partitions of 331
    # tokens (86 of 384 tokens), and 32 partitions of 1,024 fill two an SM
    assert splits(1, 32768) == 32
    assert _partition(32768, 32, 128) == (1024, 32)
    # without saturate_per_sm and with one-token tiles: the counts as before
    assert choose_num_splits(16, 8, 4096, 132, per_sm=3) == 3
