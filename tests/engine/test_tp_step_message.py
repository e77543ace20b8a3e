"""The tensor-parallel step message and the greedy argmax over vocabulary slices, in one
process: what every rank decodes is the driver's batch, only changed block-table entries
travel, and the argmax of the slices is the argmax of the whole logits (ties included)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine.distributed.communication import pick_best, slice_best
from pagedkv.engine.distributed.step_message import (
    HEADER_LEN,
    Kind,
    Mode,
    StepDecoder,
    StepEncoder,
    common_prefix,
    control_message,
    message_kind,
    payload_len,
)
from pagedkv.engine.worker.inputs import StepBatch


def _roundtrip(encoder: StepEncoder, decoder: StepDecoder, batch: StepBatch, seq_ids, **kw):
    msg = encoder.encode(batch, seq_ids, kw.pop("mode", Mode.TOKENS), **kw)
    header, payload = msg[:HEADER_LEN], msg[HEADER_LEN:]
    assert message_kind(header) == Kind.STEP and payload_len(header) == payload.numel()
    return decoder.decode(header, payload), payload.numel()


def _decode_batch(tables: list[list[int]], starts: list[int], ids: list[int]) -> StepBatch:
    return StepBatch([[t] for t in ids], starts, tables, list(range(len(tables))))


def test_a_decode_step_sends_only_the_table_entries_that_changed():
    enc, dec = StepEncoder(), StepDecoder()
    tables = [[4, 5], [7], [9, 10, 11]]
    msg, size = _roundtrip(enc, dec, _decode_batch(tables, [20, 3, 40], [1, 2, 3]), [10, 11, 12])
    assert msg.batch.block_tables == tables and msg.step == 1
    assert size == 3 * 3 + 3 * 3 + 6  # ids/starts/tokens, (row, keep, count) per table, entries
    # next step: nothing changed, then one block appended and one replaced by copy-on-write
    msg, size = _roundtrip(enc, dec, _decode_batch(tables, [21, 4, 41], [4, 5, 6]), [10, 11, 12])
    assert size == 3 * 3
    same = msg.batch.block_tables
    tables[0].append(6)  # the scheduler's live lists change in place
    tables[2][-1] = 99
    msg, size = _roundtrip(enc, dec, _decode_batch(tables, [22, 5, 42], [7, 8, 9]), [10, 11, 12])
    assert msg.batch.block_tables == [[4, 5, 6], [7], [9, 10, 99]]
    assert size == 3 * 3 + 2 * 3 + 2
    assert msg.batch.block_tables[1] is same[1], "an unchanged table is the list held before"
    assert msg.batch.token_ids == [[7], [8], [9]] and msg.batch.starts == [22, 5, 42]


def test_a_sequence_that_leaves_the_batch_is_sent_whole_when_it_comes_back():
    enc, dec = StepEncoder(), StepDecoder()
    _roundtrip(enc, dec, _decode_batch([[1, 2], [3]], [0, 0], [5, 5]), [1, 2])
    _roundtrip(enc, dec, _decode_batch([[3]], [1], [5]), [2])  # sequence 1 swapped out
    msg, size = _roundtrip(enc, dec, _decode_batch([[8, 9], [3]], [2, 2], [5, 5]), [1, 2])
    assert msg.batch.block_tables == [[8, 9], [3]]
    assert size == 3 * 2 + 3 + 2


def test_mixed_step_with_block_operations_and_pending_tokens_round_trips():
    enc, dec = StepEncoder(), StepDecoder()
    batch = StepBatch(
        token_ids=[[0], [5, 6, 7], [8, 9]],
        starts=[9, 0, 16],
        block_tables=[[1], [2], [3, 4]],
        sample_idx=[0, 1],
        swap_out=[(5, 0), (6, 1)],
        swap_in=[(2, 7)],
        copies=[(3, 8)],
    )
    msg, _ = _roundtrip(enc, dec, batch, [4, 5, 6], pending_rows=[0], pending_sources=[3])
    got = msg.batch
    assert (got.token_ids, got.starts, got.block_tables, got.sample_idx) == (
        batch.token_ids, batch.starts, batch.block_tables, batch.sample_idx)
    assert (got.swap_out, got.swap_in, got.copies) == (batch.swap_out, batch.swap_in, batch.copies)
    assert (msg.pending_rows, msg.pending_sources, msg.mode) == ([0], [3], Mode.TOKENS)


def test_a_rank_out_of_step_fails_at_once():
    enc, dec = StepEncoder(), StepDecoder()
    first = enc.encode(_decode_batch([[1]], [0], [5]), [1], Mode.LOGITS)
    second = enc.encode(_decode_batch([[1]], [1], [5]), [1], Mode.LOGITS)
    with pytest.raises(RuntimeError, match="step message 2 arrived after step 0"):
        dec.decode(second[:HEADER_LEN], second[HEADER_LEN:])
    dec.decode(first[:HEADER_LEN], first[HEADER_LEN:])
    with pytest.raises(RuntimeError, match="payload of 2 ints, the header says 3"):
        dec.decode(second[:HEADER_LEN], second[HEADER_LEN:-1])
    # a decoder that never saw sequence 1's table cannot make one up
    with pytest.raises(RuntimeError, match=r"no block table for sequences \[1\]"):
        StepDecoder().decode(*_renumbered(second, 1))
    with pytest.raises(ValueError, match="not a step message"):
        dec.decode(control_message(Kind.STOP), torch.empty(0, dtype=torch.long))


def _renumbered(msg: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    header = msg[:HEADER_LEN].clone()
    header[2] = step
    return header, msg[HEADER_LEN:]


def test_bad_encoder_input_is_a_clear_error_and_changes_nothing():
    enc, dec = StepEncoder(), StepDecoder()
    batch = _decode_batch([[1], [2]], [0, 0], [5, 6])
    with pytest.raises(ValueError, match="1 sequence ids for a batch of 2 sequences"):
        enc.encode(batch, [1], Mode.TOKENS)
    with pytest.raises(ValueError, match="same length"):
        enc.encode(batch, [1, 2], Mode.TOKENS, pending_rows=[0], pending_sources=[])
    msg, _ = _roundtrip(enc, dec, batch, [1, 2])  # still step 1, every table sent
    assert msg.step == 1 and msg.batch.block_tables == [[1], [2]]


# ---- property: any sequence of steps round-trips ------------------------------------------

_table = st.lists(st.integers(0, 500), min_size=1, max_size=12)
_change = st.sampled_from(["same", "same", "append", "cow", "rewrite", "shrink"])


@st.composite
def _steps(draw):
    """A run of steps over up to 8 sequences: each step takes some of them in some order,
    and each table may stay, grow, have its last block replaced, or change anywhere."""
    tables = {sid: draw(_table) for sid in range(8)}
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        ids = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
        for sid in ids:
            t = tables[sid]
            how = draw(_change)
            if how == "append":
                t = [*t, draw(st.integers(0, 500))]
            elif how == "cow":
                t = [*t[:-1], draw(st.integers(0, 500))]
            elif how == "rewrite":
                t = draw(_table)
            elif how == "shrink" and len(t) > 1:
                t = t[:-1]
            tables[sid] = t
        qlens = draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
        tokens = [[draw(st.integers(0, 2**40)) for _ in range(q)] for q in qlens]
        starts = draw(st.lists(st.integers(0, 4000), min_size=len(ids), max_size=len(ids)))
        sample = sorted(draw(st.sets(st.integers(0, len(ids) - 1))))
        pairs = st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=3)
        batch = StepBatch(tokens, starts, [list(tables[s]) for s in ids], sample,
                          draw(pairs), draw(pairs), draw(pairs))
        steps.append((batch, ids, draw(st.sampled_from(list(Mode)))))
    return steps


@given(_steps())
def test_every_step_decodes_to_the_drivers_batch(steps):
    enc, dec = StepEncoder(), StepDecoder()
    for k, (batch, ids, mode) in enumerate(steps, 1):
        msg, _ = _roundtrip(enc, dec, batch, ids, mode=mode)
        got = msg.batch
        assert msg.step == k and msg.mode == mode
        assert got.token_ids == batch.token_ids and got.starts == batch.starts
        assert got.block_tables == batch.block_tables and got.sample_idx == batch.sample_idx
        assert (got.swap_out, got.swap_in, got.copies) == (
            batch.swap_out, batch.swap_in, batch.copies)


@given(_table, _table)
def test_common_prefix_is_the_longest(old, new):
    k = common_prefix(old, new)
    assert old[:k] == new[:k]
    assert k == min(len(old), len(new)) or old[k] != new[k]


# ---- the argmax over vocabulary slices ------------------------------------------------------


@given(
    st.integers(1, 5),
    st.integers(1, 37),
    st.integers(1, 4),
    st.data(),
)
def test_argmax_over_vocabulary_slices_is_the_whole_argmax(rows, vocab, ranks, data):
    """Small integer logits make ties common: the lowest id must win, as torch.argmax's."""
    values = data.draw(st.lists(st.integers(-3, 3), min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(rows, vocab).to(torch.bfloat16)
    per_rank = math.ceil(vocab / ranks)
    pairs = []
    for r in range(ranks):
        start = min(r * per_rank, vocab)
        part = torch.full((rows, per_rank), float("-inf"), dtype=logits.dtype)
        width = min(start + per_rank, vocab) - start
        part[:, :width] = logits[:, start : start + width]
        pairs.append(slice_best(part, start))
    got = pick_best(torch.stack(pairs))
    assert got.tolist() == logits.float().argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- over gloo


def _echo_messages(rank: int, store_path: str, sizes: list[int]) -> None:
    """Rank 0 sends a message of each payload size; rank 1 receives it and sends back what it
    got (header and payload flattened), which rank 0 compares with what it sent."""
    import torch.distributed as dist

    from pagedkv.engine.distributed.step_message import recv_message, send_message

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        for size in sizes:
            if rank == 0:
                msg = torch.arange(HEADER_LEN + size, dtype=torch.long) * 7 - 3
                msg[:HEADER_LEN] = control_message(Kind.STEP)
                msg[1] = size  # the payload length field
                send_message(msg, None)
                back = torch.empty(HEADER_LEN + size, dtype=torch.long)
                dist.broadcast(back, src=1)
                if not torch.equal(back, msg):
                    raise AssertionError(f"payload of {size} ints arrived changed")
            else:
                header, payload = recv_message(None)
                if payload.numel() != size:
                    raise AssertionError(f"{payload.numel()} ints arrived, {size} sent")
                dist.broadcast(torch.cat((header, payload)), src=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_messages_of_every_size_arrive_whole_over_gloo(tmp_path):
    """A message travels in one broadcast when it fits FIRST_LEN ints, else in two: every size
    around that boundary (and none) arrives exactly as sent."""
    import torch.multiprocessing as tmp

    from pagedkv.engine.distributed.step_message import FIRST_LEN

    edge = FIRST_LEN - HEADER_LEN
    sizes = [0, 1, 3000, edge - 1, edge, edge + 1, 3 * FIRST_LEN + 5, 2]
    tmp.spawn(_echo_messages, args=(str(tmp_path / "store"), sizes), nprocs=2, join=True)
