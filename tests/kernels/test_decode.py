"""paged_decode_attention (and paged_attention's all-decode route) against the float64
reference: every head size, dtype, block size and GQA ratio, contexts of one token, exact
block multiples and ragged lengths, and long contexts that take the flash-decoding split path."""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import (
    ATTENTION_CASES,
    TOLERANCE,
    attention_case_id,
    poisoned_like,
    random_paged_batch,
    rel_error,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _lens(block_size: int, full: bool, gen: torch.Generator) -> list[int]:
    # One token, exact multiples of the block size, ragged lengths.
    lens = [1, block_size, 3 * block_size, 2 * block_size + 5, 37]
    if full:  # plus long contexts (split path) and a spread of random lengths
        lens += [1000, 4099, 8205]
        lens += torch.randint(1, 3000, (8,), generator=gen, device=gen.device).tolist()
    return lens


def _check(out, ref, dtype, seed, what):
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: rel error {err:.2e} (seed={seed})"


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=attention_case_id)
def test_decode_matches_reference(target, seed, case):
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    num_kv_heads = 4 if target.full else 1
    lens = _lens(block_size, target.full, gen)
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    out = pk.paged_decode_attention(*args, out=poisoned_like(batch.query), backend=target.backend)
    ref = reference.paged_decode_attention(*args)
    _check(out, ref, dtype, seed, "decode")
    # The same batch through paged_attention: the decode route (max_query_len=1) and the
    # general kernel with q_len = 1 everywhere.
    for hint in (1, None):
        out2 = pk.paged_attention(
            *args, batch.cu_query_lens, max_query_len=hint,
            out=poisoned_like(batch.query), backend=target.backend,
        )  # fmt: skip
        _check(out2, ref, dtype, seed, f"paged_attention max_query_len={hint}")


SPLIT_CASES = [(80, BF16, 16, 3), (128, F16, 8, 4), (256, F32, 32, 1), (64, BF16, 32, 8)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=attention_case_id)
def test_decode_split_path(target, seed, case):
    """Contexts long enough that flash-decoding splits them, with the automatic split count,
    forced counts (including more splits than a short sequence has tokens for), the
    max_seq_len hint, and a zero-length sequence (batch padding: zeros)."""
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    if target.full:
        lens, num_kv_heads, forced = [20000, 3, 9000, 1, 0], 2, (7, 40)
    else:
        lens, num_kv_heads, forced = [600, 3, 260, 0], 1, (2, 5)
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    assert bool((ref[-1] == 0).all())
    runs = [(None, None), (None, max(lens))]
    if target.backend == "triton":
        runs += [(forced[0], None), (forced[1], max(lens))]
    for splits, hint in runs:
        out = pk.paged_decode_attention(
            *args, max_seq_len=hint, num_splits=splits,
            out=poisoned_like(batch.query), backend=target.backend,
        )  # fmt: skip
        _check(out, ref, dtype, seed, f"num_splits={splits} max_seq_len={hint}")
        assert bool((out[-1] == 0).all()), "a zero-length sequence must give zeros"


def test_decode_scale_and_noncontiguous_query(target, seed):
    """A custom scale, a query that is a strided view (as sliced from a fused QKV tensor), and
    the allocated (not given) output."""
    gen = target.generator(seed)
    head_dim, group, num_kv_heads, block_size = 64, 4, 2, 16
    lens = [5, 40, 17] if not target.full else [5, 4000, 170]
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=F32, device=target.device,
    )  # fmt: skip
    wide = torch.randn(len(lens), 3 * group * num_kv_heads, head_dim, generator=gen,
                       device=target.device)  # fmt: skip
    wide[:, : group * num_kv_heads] = batch.query
    query = wide[:, : group * num_kv_heads]
    assert not query.is_contiguous()
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    out = pk.paged_decode_attention(*args, scale=0.3, backend=target.backend)
    ref = reference.paged_decode_attention(*args, scale=0.3)
    _check(out, ref, F32, seed, "scale=0.3, strided query")


def test_torch_decode_rows_do_not_depend_on_the_batch(seed):
    """On the CPU torch path each sequence's decode attention comes out bit-identical alone
    and in a batch of sequences of other lengths, on two threads (seeded sampling must not
    depend on what else is in the batch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(seed)
        lens = [20, 23, 40, 41, 100, 7]
        batch = random_paged_batch(gen, lens, [1] * len(lens), num_heads=9, num_kv_heads=3,
                                   head_dim=64, block_size=16, dtype=torch.float32)  # fmt: skip
        args = (batch.key_cache, batch.value_cache)
        together = pk.paged_decode_attention(batch.query, *args, batch.block_tables,
                                             batch.seq_lens, backend="torch")  # fmt: skip
        for i in range(len(lens)):
            alone = pk.paged_decode_attention(
                batch.query[i : i + 1], *args, batch.block_tables[i : i + 1],
                batch.seq_lens[i : i + 1], backend="torch",
            )  # fmt: skip
            assert torch.equal(alone, together[i : i + 1]), f"sequence {i} (seed={seed})"
    finally:
        torch.set_num_threads(before)


def _decode_batch(target, gen, lens, dtype):
    """One query token per sequence of ``lens`` over a random paged cache: 8 query heads on 2
    KV heads of 64, blocks of 16 (the order and split tests' shape)."""
    return random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype, device=target.device,
    )  # fmt: skip


def _poisoned_scratch(target, monkeypatch):
    """The Triton launchers with the flash-decoding scratch memory filled with NaN (so that a
    merge reading one partial too many shows); skips the torch backend."""
    if target.backend != "triton":
        pytest.skip("a Triton launch option")
    from pagedattn_kernels.attention import triton_launch

    real = triton_launch._scratch
    monkeypatch.setattr(triton_launch, "_scratch",
                        lambda n, device: real(n, device).fill_(float("nan")))  # fmt: skip
    return triton_launch


@pytest.mark.parametrize("hint", ["exact", "bound"])
def test_split_sequences_divide_their_own_length(target, seed, hint, monkeypatch):
    """Flash-decoding splits each sequence by its own length (``_split_length``), so
    sequences shorter than the longest, or than the ``max_seq_len`` hint (a CUDA graph's
    ``max_model_len``), still spread over the programs, and a sequence may use fewer splits
    than the grid has (520 tokens over 4 splits of 192). The merge must read exactly the
    splits that wrote: the scratch memory is poisoned with NaN, so one partial too many shows."""
    triton_launch = _poisoned_scratch(target, monkeypatch)
    gen = target.generator(seed)
    lens = [520, 130, 1000, 0, 17, 300] + ([4099, 9000] if target.full else [])
    batch = _decode_batch(target, gen, lens, F32)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    bound = max(lens) if hint == "exact" else 4 * max(lens)
    for splits in (None, 2, 4, 7):
        out = triton_launch.paged_decode_attention(
            *args, 64**-0.5, bound, poisoned_like(batch.query), num_splits=splits,
        )  # fmt: skip
        _check(out, ref, F32, seed, f"hint {hint}, num_splits={splits}")


@pytest.mark.parametrize("splits", [None, 3])
def test_decode_in_any_sequence_order(target, seed, splits):
    """``seq_order`` only schedules: longest context first, reversed or shuffled, the output
    is bit-identical to batch order, split or not, a padding row (length 0) included, with the
    16-bit and the fp8 cache."""
    gen = target.generator(seed)
    lens = [520, 0, 17, 1000, 130, 64, 1, 300] + ([4099, 9000] if target.full else [])
    batch = _decode_batch(target, gen, lens, BF16)
    fp8 = {"k_scale": torch.tensor([0.25], device=target.device),
           "v_scale": torch.tensor([0.5], device=target.device)}  # fmt: skip
    caches = [((batch.key_cache, batch.value_cache), {}),
              (((4 * batch.key_cache.float()).to(torch.float8_e4m3fn),
                (4 * batch.value_cache.float()).to(torch.float8_e4m3fn)), fp8)]  # fmt: skip
    longest = sorted(range(len(lens)), key=lambda i: -lens[i])
    shuffled = torch.randperm(len(lens), generator=gen, device=gen.device).tolist()
    for (kc, vc), scales in caches:
        args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens)
        ref = reference.paged_decode_attention(*args, **scales)
        plain = pk.paged_decode_attention(*args, num_splits=splits, backend=target.backend,
                                          **scales)  # fmt: skip
        _check(plain, ref, BF16, seed, f"{kc.dtype}, batch order")
        for order in (longest, longest[::-1], shuffled):
            out = pk.paged_decode_attention(
                *args, num_splits=splits, backend=target.backend, out=poisoned_like(batch.query),
                seq_order=torch.tensor(order, dtype=torch.int32, device=target.device), **scales,
            )  # fmt: skip
            assert torch.equal(out, plain), f"{kc.dtype}, order {order} (seed={seed})"


def test_forced_splits_keep_a_least_partition(target, seed, monkeypatch):
    """``min_partition``: with a forced split count only sequences longer than it split, in
    shares of at least that many tokens, and their partial outputs merge as any split's do
    (scratch poisoned with NaN), in batch order and longest first, under a CUDA graph's
    bound."""
    triton_launch = _poisoned_scratch(target, monkeypatch)
    gen = target.generator(seed)
    lens = [1300, 20, 600, 0, 513, 1, 2048, 90]
    batch = _decode_batch(target, gen, lens, BF16)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    cfg = triton_launch.DecodeConfig(tile_n=32, num_warps=1, num_stages=1, per_sm=1)
    longest = torch.tensor(sorted(range(len(lens)), key=lambda i: -lens[i]), dtype=torch.int32,
                           device=target.device)  # fmt: skip
    for order in (None, longest):
        out = triton_launch.paged_decode_attention(
            *args, 64**-0.5, 2048, poisoned_like(batch.query), num_splits=4, config=cfg,
            seq_order=order, min_partition=512,
        )  # fmt: skip
        _check(out, ref, BF16, seed, f"4 splits of at least 512 tokens, order {order}")


@pytest.mark.parametrize("option", ["early_v", "one_loop"])
@pytest.mark.parametrize("case", [(128, BF16, 16, 4), (80, F16, 8, 3)], ids=attention_case_id)
def test_decode_with_tile_loop_options(target, seed, case, option):
    """The decode kernel with ``DecodeConfig(early_v=True)`` (each V tile loaded with its K
    tile, as the prefill kernel does) or ``one_loop=True`` (the ragged last tile inside the
    loop, every tile masked): the same outputs, split or not, ragged tiles included."""
    if target.backend != "triton":
        pytest.skip("a Triton tile option")
    from pagedattn_kernels.attention import triton_launch

    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    lens = [1, 37, 3 * block_size, 600] if not target.full else [1, 37, 4099, 20000]
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    tiles = 64 if not target.full else 128
    cfg = triton_launch.DecodeConfig(tile_n=tiles, num_warps=4, num_stages=1 if not target.full
                                     else 2, **{option: True})  # fmt: skip
    for splits in (1, 3):
        out = triton_launch.paged_decode_attention(
            *args, head_dim**-0.5, max(lens), poisoned_like(batch.query), num_splits=splits,
            config=cfg,
        )  # fmt: skip
        _check(out, ref, dtype, seed, f"{option}, num_splits={splits}")
