"""From the scheduler's batch to the tensors of one forward pass.

The scheduler speaks in Python lists: per sequence, the positions to compute now, their token
ids and the block table. :class:`StepBatch` is those lists and nothing else (it is also what
travels to tensor-parallel workers); :func:`build_inputs` turns it into the flat token axis
the model runs on: token ids, positions, the slot mapping and the attention metadata.

The slot rule is kvblocks': position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size`` (see ``kvblocks.slot_of``).
:func:`slot_mapping` is that rule over tensors, the one place the runner applies it, for
prefill batches here and for decode batches inside the CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import chain

import torch

from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.worker.decode_plans import DecodePlanner
from pagedkv.engine.worker.staging import host_tensor, stage


@dataclass(slots=True)
class StepBatch:
    """One forward pass as plain host lists (the runner's input; cheap to send to a rank).

    Sequence ``i`` computes positions ``starts[i] .. starts[i] + len(token_ids[i]) - 1`` with
    ``block_tables[i]``; ``sample_idx`` lists the sequences whose last position is sampled.
    Block operations run first: swap out, swap in, then copy (copy-on-write).
    ``placeholders`` lists (flat token row, sequence id) of input tokens the host does not
    know yet (asynchronous scheduling): the runner fills them on the device.
    """

    token_ids: list[list[int]]
    starts: list[int]
    block_tables: list[list[int]]
    sample_idx: list[int]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    placeholders: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (a decode step: CUDA graphs apply)."""
        return all(len(t) == 1 for t in self.token_ids)

    @property
    def samples_every_row(self) -> bool:
        return len(self.sample_idx) == len(self.starts)


def step_batch(out) -> StepBatch:
    """The `StepBatch` of a `pagedkv.scheduler.SchedulerOutput`.

    A sequence scheduled ahead of its last token (asynchronous scheduling: that token is
    still being sampled) gets a placeholder 0 there, listed in ``placeholders``."""
    token_ids: list[list[int]] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    placeholders: list[tuple[int, int]] = []
    row = 0
    for ss in out.scheduled:
        s = ss.start
        n = ss.num_tokens
        toks = ss.all_token_ids[s : s + n]
        row += n
        if len(toks) < n:
            placeholders.append((row - 1, ss.seq_id))
            toks.append(0)
        token_ids.append(toks)
        starts.append(s)
        tables.append(ss.block_table)
    if out.num_samples == len(starts):
        sample_idx = list(range(len(starts)))
    else:
        sample_idx = [k for k, ss in enumerate(out.scheduled) if ss.do_sample]
    return StepBatch(token_ids, starts, tables, sample_idx, out.blocks_to_swap_out,
                     out.blocks_to_swap_in, out.blocks_to_copy, placeholders)


def slot_mapping(
    block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """KV slot of each token: ``block_tables[row, pos // block_size] * block_size + pos %
    block_size`` (int64), for tokens of sequence ``rows[i]`` at ``positions[i]``."""
    blocks = block_tables[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


@dataclass(slots=True)
class StepInputs:
    """The tensors of one forward pass (kept for tests and debugging)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the flat token dimension, one per sampling sequence


def pack_tables(tables: list[list[int]], out: torch.Tensor) -> int:
    """Write ragged block tables into the rows of `out` (left-aligned; the tail of each row
    is left as is, since no kernel reads past a sequence's length). One host tensor for all
    of them instead of one per row. Returns the width used."""
    lens = host_tensor(list(map(len, tables)))
    width = int(lens.max())
    flat = host_tensor(list(chain.from_iterable(tables)), torch.int32)
    cols = torch.arange(width)
    view = out[: len(tables), :width]
    view[cols < lens[:, None]] = flat
    return width


#: Whether decode rows on a GPU order their attention programs (``longest_first``);
#: ``PAGEDKV_DECODE_ORDER=0`` (read at import) keeps batch order, for A/B runs.
DECODE_ORDER = os.environ.get("PAGEDKV_DECODE_ORDER", "1") != "0"
#: The devices whose decode attention takes an order: the Triton kernel's schedule (the
#: CPU's torch attention has none).
ORDER_DEVICES = ("cuda",)


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The rows of a decode batch by context length, longest first (ties in batch order), as
    int32: the order in which the decode attention kernel starts their programs
    (``pagedattn_kernels.paged_decode_attention``'s ``seq_order``). A host sort of at most a
    thousand lengths, a few microseconds; it keeps a long context that comes late in the
    batch from running on alone after every other program has finished."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)


def _decode_order(seq_lens: torch.Tensor, rows: int,
                  device: torch.device) -> torch.Tensor | None:  # fmt: skip
    """``longest_first`` of the first ``rows`` sequences (a decode step's, or the leading
    decode rows of a mixed pass) on ``device``; None without decode rows, off an
    ``ORDER_DEVICES`` device, or with ``DECODE_ORDER`` off. A mixed pass's decode rows take
    the order too: then its decode kernel is the variant the decode graphs compiled at
    start-up, where without an order the first mixed pass of a run compiled another (about a
    second each on an H200, twice on an fp8 cache: ``triton_compiled_during_run`` of
    ``bench.throughput``, 2baf0a1)."""
    if not rows or device.type not in ORDER_DEVICES or not DECODE_ORDER:
        return None
    return stage(longest_first(seq_lens[:rows]), device)


def build_inputs(
    batch: StepBatch, block_size: int, device: torch.device,
    planner: DecodePlanner | None = None,
) -> tuple[StepInputs, list[int]]:  # fmt: skip
    """Flat inputs of a prefill or mixed batch, and the query length of each sequence.

    Positions and slots are computed from a few host tensors, then everything is copied to
    `device` without waiting (`staging.stage`: through pinned memory on a GPU). With a
    `planner`, decode rows where plans pay attend by a plan (`decode_plans`), else in the
    longest-first order."""
    ids = list(chain.from_iterable(batch.token_ids))
    qlens = [len(t) for t in batch.token_ids]
    num_seqs = len(qlens)
    qlens_t = host_tensor(qlens, torch.int32)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(qlens_t, 0, out=cu[1:])
    starts_t = host_tensor(batch.starts, torch.int32)
    seq_lens = starts_t + qlens_t
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs), qlens_t.long())
    total = len(ids)
    positions = torch.arange(total) - cu[:-1].long()[seq_idx] + starts_t.long()[seq_idx]
    width = max(1, max(map(len, batch.block_tables)))
    block_tables = torch.zeros((num_seqs, width), dtype=torch.int32)
    pack_tables(batch.block_tables, block_tables)
    slots = slot_mapping(block_tables, seq_idx, positions, block_size)
    sample_rows = (cu[1:].long() - 1)[host_tensor(batch.sample_idx)]
    max_q = max(qlens)
    num_decode = 0  # leading single-token sequences (running decodes come first)
    if max_q > 1:
        while qlens[num_decode] == 1:
            num_decode += 1
    decode_rows = num_seqs if max_q == 1 else num_decode
    plan = None
    if planner is not None and planner.pays(decode_rows):
        plan = stage(planner.plan(seq_lens[:decode_rows]), device)
    meta = AttentionMetadata(
        slot_mapping=stage(slots, device),
        block_tables=stage(block_tables, device),
        seq_lens=stage(seq_lens, device),
        cu_query_lens=stage(cu, device),
        max_query_len=max_q,
        max_seq_len=int(seq_lens.max()),
        decode_only=max_q == 1,
        num_decode_seqs=num_decode,
        prefill_cu_query_lens=stage(cu[num_decode:] - num_decode, device)
        if num_decode else None,
        decode_order=_decode_order(seq_lens, decode_rows, device) if plan is None else None,
        decode_plan=plan,
    )
    inputs = StepInputs(
        input_ids=stage(host_tensor(ids), device),
        positions=stage(positions, device),
        meta=meta,
        sample_rows=stage(sample_rows, device),
    )
    return inputs, qlens
