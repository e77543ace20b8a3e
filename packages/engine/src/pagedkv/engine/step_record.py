"""`StepRecord`: what one engine step did, for whoever watches (metrics, tutorials, tracing).

`LLMEngine.add_step_observer(fn)` registers `fn(record)`, called after every step that ran a
batch. The record is a snapshot made of plain values: the sequences scheduled and how many
tokens each computed, their block tables as the forward pass used them, the block operations
(swap out, swap in, copy-on-write), the preemptions, the tokens sampled and the forks made, the
requests that finished, the KV cache occupancy after the step, and the host time of each phase.
An observer registered with ``block_tables=True`` also gets every live sequence's blocks *after*
the step (`SeqBlocks`: forks and prunes applied, swapped sequences on the CPU), which the
tutorials draw beside the tables the forward pass used; the others do not pay for that copy.
Observers read; they cannot change the engine. Nothing is recorded while nobody observes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ScheduledSeq:
    """One sequence's share of the step: positions [start, start + num_tokens) computed."""

    seq_id: int
    request_id: str
    start: int
    num_tokens: int
    is_prefill: bool
    do_sample: bool
    block_table: tuple[int, ...]  # physical block ids, logical block order


@dataclass(slots=True, frozen=True)
class SeqBlocks:
    """A live sequence's KV blocks after the step: `num_slots` slots reserved in `block_table`
    (physical block ids, logical block order) on the GPU, or on the CPU while swapped out."""

    seq_id: int
    request_id: str
    num_slots: int
    location: str  # "gpu" | "cpu"
    block_table: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One engine step (see the module docstring). Times are host wall-clock seconds."""

    step: int
    scheduled: tuple[ScheduledSeq, ...]
    blocks_to_swap_out: tuple[tuple[int, int], ...]
    blocks_to_swap_in: tuple[tuple[int, int], ...]
    blocks_to_copy: tuple[tuple[int, int], ...]
    preempted: tuple[tuple[str, str], ...]  # (request id, "recompute" | "swap")
    sampled: dict[int, list[int]]  # sequence id -> tokens applied (several: forks)
    forks: tuple[tuple[int, int], ...]  # (parent, child) sequence ids
    finished: tuple[str, ...]  # request ids that ended in this step
    num_free_blocks: int  # GPU KV blocks free after the step
    num_gpu_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    # Host seconds by phase. One step at a time: schedule, execute (the forward pass and
    # sampling, waited for), update, output. With asynchronous scheduling (the default on a
    # GPU) the device runs a step while the host schedules and launches the next: wait (for
    # this step's tokens), update, output, and the next step's schedule and launch.
    timings: dict[str, float] = field(default_factory=dict)
    num_free_cpu_blocks: int = 0  # CPU (swap) blocks free after the step
    num_cpu_blocks: int = 0
    # After the step, running then swapped groups in arrival order; filled only when an observer
    # asked for it (`add_step_observer(fn, block_tables=True)`), else empty. With asynchronous
    # scheduling the next step is already scheduled then: its slots are counted.
    block_tables: tuple[SeqBlocks, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of GPU KV blocks in use after the step."""
        total = self.num_gpu_blocks
        return (total - self.num_free_blocks) / total if total else 0.0
