"""Large decode batches as two micro-batches on two CUDA streams.

A decode pass of hundreds of sequences does two kinds of work one after the other: matmuls,
which are compute-bound at these row counts, and attention, which is bound by reading the
KV cache. The GPU could do both at once; one stream never lets it, since every kernel waits
for the one before. Split the batch in two halves and replay each half's decode graph on a
stream of its own: while one half reads its KV cache, the other's matmuls can take the SMs
that attention leaves idle (NanoFlow's intra-device parallelism, without its SM partitioning:
the GPU's block scheduler interleaves the two streams' kernels as resources free up).

The halves are independent sequences, so nothing is shared but the weights (read only) and
the KV cache (each half writes its own slots). The first half replays the runner's own
graphs; the second has a `DecodeGraphs` of its own (static inputs, plans and memory pool),
captured for up to half the largest batch. The second stream waits for everything the main
stream queued before the step (the tokens sampled by the step before, which asynchronous
scheduling writes into the inputs on the device), and the main stream waits for the second
before the logits.

Off unless ``PAGEDKV_MICROBATCH_FROM`` (read at import) names the smallest batch to split:
whether it pays is measured (``scripts/overlap_probe.py``, ``docs/performance``).
"""

from __future__ import annotations

import os

import torch

from pagedkv.engine.worker.cuda_graphs import DecodeGraphs


def microbatch_from_env(var: str = "PAGEDKV_MICROBATCH_FROM") -> int:
    """The smallest decode batch to split, from the environment (0, the default: never)."""
    text = os.environ.get(var, "0")
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or value == 1:
        raise ValueError(f"{var} must be 0 (off) or a batch size >= 2, got {text!r}")
    return value


#: Decode batches of at least this many sequences run as two micro-batches (0: never).
MICROBATCH_FROM = microbatch_from_env()


def split_rows(num_seqs: int) -> int:
    """Rows of the first micro-batch (the larger half when the count is odd)."""
    return num_seqs - num_seqs // 2


class TwoStreamDecode:
    """The second half's graphs, the stream it runs on and the events that order the two."""

    def __init__(self, first: DecodeGraphs, second: DecodeGraphs, min_seqs: int,
                 device: torch.device) -> None:  # fmt: skip
        """`first`: the runner's decode graphs; `second`: graphs of its own for up to half
        the largest batch, captured by the caller."""
        if min_seqs < 2:
            raise ValueError(f"a batch of {min_seqs} sequence(s) cannot be split in two")
        self.first = first
        self.second = second
        self.min_seqs = min_seqs
        self.stream = torch.cuda.Stream(device)
        self._ready = torch.cuda.Event()
        self._done = torch.cuda.Event()
        self.replays = 0

    def applies(self, num_seqs: int) -> bool:
        """Whether a decode batch of `num_seqs` sequences runs as two micro-batches."""
        if num_seqs < self.min_seqs:
            return False
        h = split_rows(num_seqs)
        return (self.first.size_for(h) is not None
                and self.second.size_for(num_seqs - h) is not None)  # fmt: skip

    def replay(self, ids: list[int], starts: list[int], tables: list[list[int]],
               pending=None) -> torch.Tensor:  # fmt: skip
        """Hidden states of every row (n, in batch order): the first half on the current
        stream, the second on this one's, joined. `pending`: a `PendingTokens` of the whole
        batch's rows, or None."""
        n = len(ids)
        h = split_rows(n)
        main = torch.cuda.current_stream()
        pa, pb = pending.split(h) if pending is not None else (None, None)
        self._ready.record(main)
        hidden_a = self.first.replay(ids[:h], starts[:h], tables[:h], self.first.size_for(h),
                                     pa.write_into if pa is not None else None)  # fmt: skip
        self.stream.wait_event(self._ready)
        with torch.cuda.stream(self.stream):
            hidden_b = self.second.replay(ids[h:], starts[h:], tables[h:],
                                          self.second.size_for(n - h),
                                          pb.write_into if pb is not None else None)  # fmt: skip
            self._done.record(self.stream)
        main.wait_event(self._done)
        self.replays += 1
        return torch.cat((hidden_a, hidden_b))
