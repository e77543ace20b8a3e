"""Each step's inputs as one int64 tensor: what the driver sends the other ranks.

Every rank runs the same forward pass, so every rank needs the step's inputs: token ids,
positions, block tables, block operations. Pickling the whole `StepBatch` each step makes the
driver and every worker touch every block-table entry of the batch (about 30,000 for 1,024
sequences of 500 tokens) twice. Here the driver sends a flat int64 tensor instead, and only the
block-table entries that changed since the step before (one block appended every `block_size`
tokens, a block replaced by copy-on-write), because every rank keeps the tables of the last
step's sequences (:class:`StepDecoder`), as one GPU keeps them staged (``worker/staging.py``).

A message is a header of :data:`HEADER_LEN` ints, then a payload whose length the header gives:

==============  =========================================================================
header          kind, payload length, step number, mode, sequences, tokens, decode flag,
                sampling rows, swap-out pairs, swap-in pairs, copy pairs, pending tokens,
                changed tables, new table entries
payload         sequence ids; first positions; query lengths (not in a decode step, where
                each is 1); token ids; sampling rows (not when every row samples); swap-out,
                swap-in and copy pairs; pending tokens' rows, then their source rows; per
                changed table (row, entries kept, entries sent); the new entries
==============  =========================================================================

A message travels in one gloo broadcast of :data:`FIRST_LEN` ints when it fits (a decode step
of up to about 1,600 sequences), else in two (:func:`send_message`). The step number travels too, so a rank that missed or repeated a step fails at once instead of
running the wrong tables. Messages other than a step (stop, collect statistics or timings) are a header
alone (:func:`control_message`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate, chain, compress, islice
from operator import ne

import torch
import torch.distributed as dist

from pagedkv.engine.worker.inputs import StepBatch

HEADER_LEN = 16
# Ints of the first broadcast of every message (64 KiB): header and payload together when the
# payload fits, which a decode step of up to about 1,600 sequences does (see `send_message`).
FIRST_LEN = 8192


class Kind(IntEnum):
    """What a message asks the workers to do."""

    STEP = 1  # run this forward pass
    STOP = 2  # leave the loop (the engine shuts down)
    STATS = 3  # send rank statistics to the driver (`RankRunner.stats`)
    TIMINGS = 4  # send per-step timings to the driver (`RankRunner.timing_summary`)


class Mode(IntEnum):
    """What a step computes after the forward pass."""

    LOGITS = 0  # the logits of the sampling rows, gathered on the driver, which samples
    TOKENS = 1  # the argmax token of each sampling row, computed on every rank alike


# header fields
_KIND, _LEN, _STEP, _MODE, _SEQS, _TOKENS, _DECODE, _SAMPLE = range(8)
_SWAP_OUT, _SWAP_IN, _COPIES, _PENDING, _UPDATES, _VALUES = range(8, 14)


@dataclass(slots=True)
class StepMessage:
    """A decoded step: the batch, and what the rank does with it."""

    step: int
    mode: Mode
    batch: StepBatch
    # asynchronous scheduling: flat input row pending_rows[i] takes the token of sampling row
    # pending_sources[i] of the step before (computed on every rank, never seen by the host)
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)


def control_message(kind: Kind) -> torch.Tensor:
    """A message without a step (`Kind.STOP`, `Kind.STATS`, `Kind.TIMINGS`)."""
    msg = torch.zeros(HEADER_LEN, dtype=torch.long)
    msg[_KIND] = int(kind)
    return msg


def send_message(msg: torch.Tensor, group) -> None:
    """Rank 0: broadcast `msg` to the ranks of `group`, in one broadcast of :data:`FIRST_LEN`
    ints (the header and the start of the payload, padded) and, only for a payload longer than
    that, a second one with the rest.

    Every gloo broadcast is a round trip in which the receiver must first say it is ready, so
    a worker gets a step one round trip sooner than with a header and a payload sent apart:
    a decode step of up to about 1,600 sequences is a single broadcast."""
    first = torch.zeros(FIRST_LEN, dtype=torch.long)
    n = min(msg.numel(), FIRST_LEN)
    first[:n] = msg[:n]
    dist.broadcast(first, src=0, group=group)
    if msg.numel() > FIRST_LEN:
        dist.broadcast(msg[FIRST_LEN:].contiguous(), src=0, group=group)


def recv_message(group) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks > 0: the next message of rank 0 over `group`, as (header, payload)."""
    first = torch.empty(FIRST_LEN, dtype=torch.long)
    dist.broadcast(first, src=0, group=group)
    header = first[:HEADER_LEN]
    size = payload_len(header)
    if HEADER_LEN + size <= FIRST_LEN:
        return header, first[HEADER_LEN : HEADER_LEN + size]
    rest = torch.empty(HEADER_LEN + size - FIRST_LEN, dtype=torch.long)
    dist.broadcast(rest, src=0, group=group)
    return header, torch.cat((first[HEADER_LEN:], rest))


def message_kind(header: torch.Tensor | list[int]) -> Kind:
    return Kind(int(header[_KIND]))


def payload_len(header: torch.Tensor | list[int]) -> int:
    return int(header[_LEN])


class StepEncoder:
    """The driver's side: one message per step, with the block tables as changes against the
    tables of the step before, which every rank holds."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}  # seq id -> its table as last sent (a copy)
        self._step = 0

    def encode(
        self,
        batch: StepBatch,
        seq_ids: list[int],
        mode: Mode,
        pending_rows: list[int] = (),
        pending_sources: list[int] = (),
    ) -> torch.Tensor:
        """The message of `batch`, whose row ``i`` is sequence ``seq_ids[i]``."""
        n = batch.num_seqs
        if len(seq_ids) != n:
            raise ValueError(f"{len(seq_ids)} sequence ids for a batch of {n} sequences")
        if len(pending_rows) != len(pending_sources):
            raise ValueError("pending_rows and pending_sources must have the same length")
        tables = batch.block_tables
        held = self._tables
        prev = list(map(held.get, seq_ids))
        sent = dict(zip(seq_ids, prev))  # the tables every rank holds after this step
        updates: list[int] = []
        values: list[int] = []
        for i in compress(range(n), map(ne, tables, prev)):  # new or changed tables
            table = tables[i]
            old = prev[i]
            keep = 0 if old is None else common_prefix(old, table)
            updates += (i, keep, len(table) - keep)
            values += table[keep:]
            sent[seq_ids[i]] = table.copy()
        self._tables = sent
        self._step += 1

        token_ids = batch.token_ids
        decode = batch.is_decode
        num_tokens = n if decode else sum(map(len, token_ids))
        sample = batch.sample_idx if len(batch.sample_idx) != n else []
        msg = array("q", bytes(8 * HEADER_LEN))
        msg.extend(seq_ids)
        msg.extend(batch.starts)
        if not decode:
            msg.extend(map(len, token_ids))
        msg.extend(chain.from_iterable(token_ids))
        msg.extend(sample)
        for pairs in (batch.swap_out, batch.swap_in, batch.copies):
            msg.extend(chain.from_iterable(pairs))
        msg.extend(pending_rows)
        msg.extend(pending_sources)
        msg.extend(updates)
        msg.extend(values)
        msg[:HEADER_LEN] = array("q", (
            Kind.STEP, len(msg) - HEADER_LEN, self._step, mode, n, num_tokens, decode,
            len(batch.sample_idx), len(batch.swap_out), len(batch.swap_in), len(batch.copies),
            len(pending_rows), len(updates) // 3, len(values), 0, 0,
        ))  # fmt: skip
        return torch.frombuffer(msg, dtype=torch.long)


class StepDecoder:
    """A worker's side: the `StepMessage` of each message, with the block tables rebuilt from
    the ones it holds. A table that did not change is the very list of the step before, so
    the runner's staging finds it unchanged at once."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._step = 0

    def decode(self, header: torch.Tensor | list[int], payload: torch.Tensor) -> StepMessage:
        h = [int(x) for x in header]
        if h[_KIND] != Kind.STEP:
            raise ValueError(f"not a step message (kind {h[_KIND]})")
        if h[_STEP] != self._step + 1:
            raise RuntimeError(
                f"step message {h[_STEP]} arrived after step {self._step}: the ranks are out "
                "of step"
            )
        if payload.numel() != h[_LEN]:
            raise RuntimeError(f"step payload of {payload.numel()} ints, the header says {h[_LEN]}")
        vals = iter(payload.tolist())
        n, num_tokens = h[_SEQS], h[_TOKENS]

        def take(k: int) -> list[int]:
            return list(islice(vals, k))

        def pairs(k: int) -> list[tuple[int, int]]:
            flat = take(2 * k)
            return list(zip(flat[::2], flat[1::2]))

        seq_ids = take(n)
        starts = take(n)
        decode = bool(h[_DECODE])
        if decode:
            token_ids = [[t] for t in take(num_tokens)]
        else:
            qlens = take(n)
            flat = take(num_tokens)
            ends = list(accumulate(qlens))
            token_ids = [flat[e - q : e] for q, e in zip(qlens, ends)]
        num_sample = h[_SAMPLE]
        sample_idx = list(range(n)) if num_sample == n else take(num_sample)
        swap_out, swap_in, copies = pairs(h[_SWAP_OUT]), pairs(h[_SWAP_IN]), pairs(h[_COPIES])
        pending_rows = take(h[_PENDING])
        pending_sources = take(h[_PENDING])
        updates = take(3 * h[_UPDATES])
        values = take(h[_VALUES])

        held = self._tables
        tables = list(map(held.get, seq_ids))
        at = 0
        for k in range(0, len(updates), 3):
            row, keep, count = updates[k : k + 3]
            old = tables[row] or []
            tables[row] = old[:keep] + values[at : at + count]
            at += count
        if None in tables:
            missing = [sid for sid, t in zip(seq_ids, tables) if t is None]
            raise RuntimeError(f"no block table for sequences {missing[:5]}: the ranks are out of step")
        self._tables = dict(zip(seq_ids, tables))
        self._step = h[_STEP]
        batch = StepBatch(token_ids, starts, tables, sample_idx, swap_out, swap_in, copies)
        return StepMessage(h[_STEP], Mode(h[_MODE]), batch, pending_rows, pending_sources)


def common_prefix(old: list[int], new: list[int]) -> int:
    """The length of the longest common prefix of two block tables. The usual changes are
    cheap: blocks appended (all of `old`), the last block replaced (copy-on-write)."""
    k = min(len(old), len(new))
    if old[:k] == new[:k]:
        return k
    if k > 1 and old[: k - 1] == new[: k - 1]:
        return k - 1
    return next(j for j, (a, b) in enumerate(zip(old, new)) if a != b)
