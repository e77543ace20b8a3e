"""Scheduler configuration, validated once so the hot path never has to check it again."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvblocks import check_block_size

__all__ = ["PreemptionMode", "SchedulerConfig"]


class PreemptionMode(enum.StrEnum):
    """How a preempted sequence group gives back its GPU blocks.

    ``RECOMPUTE`` frees the blocks and prefills the group's known tokens again later (cheap when
    the group is short or memory on the host is scarce); ``SWAP`` copies the blocks to the CPU
    pool and back (keeps the work, and keeps blocks shared between the sequences of the group).
    """

    RECOMPUTE = "recompute"
    SWAP = "swap"


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Everything the scheduler needs to know about memory and batch limits.

    ``num_gpu_blocks`` x ``block_size`` is the KV cache in token slots (``block_size`` is checked
    here, where it enters, by :func:`kvblocks.check_block_size`; at run time everyone reads it from
    ``Scheduler.block_manager.block_size``); ``num_cpu_blocks`` is the
    swap space (0 = no swapping, preemption always recomputes). ``max_num_seqs`` bounds the
    sequences that may be running at once (so also the sequences in one batch),
    ``max_num_batched_tokens`` the tokens of one forward pass (the token budget).
    ``preemption_mode`` None is the default policy: recompute a group of one sequence, swap a
    group of several (their shared blocks would be duplicated by recomputing); if the CPU pool is
    full, recompute anyway. ``watermark`` is the fraction of GPU blocks kept free when admitting
    new work, so a just-admitted request is not preempted at its next decode step.
    """

    block_size: int = 16
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: PreemptionMode | str | None = None
    watermark: float = 0.01

    def __post_init__(self) -> None:
        check_block_size(self.block_size)  # kvblocks' one check; the block manager owns it
        _check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        _check_int("num_cpu_blocks", self.num_cpu_blocks, 0)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit in one batch: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}); raise it or set enable_chunked_prefill=True"
            )
        mode = self.preemption_mode
        if mode is not None:
            try:
                mode = PreemptionMode(mode)
            except ValueError:
                raise ValueError(
                    f"preemption_mode must be 'recompute', 'swap' or None (default policy), "
                    f"got {self.preemption_mode!r}"
                ) from None
            object.__setattr__(self, "preemption_mode", mode)
            if mode is PreemptionMode.SWAP and self.num_cpu_blocks == 0:
                raise ValueError(
                    "preemption_mode='swap' needs a CPU swap pool: set num_cpu_blocks > 0 "
                    "or use preemption_mode='recompute'"
                )
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {w!r}")

    @property
    def num_gpu_slots(self) -> int:
        """KV token slots of the whole GPU cache."""
        return self.num_gpu_blocks * self.block_size

    @property
    def watermark_blocks(self) -> int:
        """GPU blocks kept free when admitting new work."""
        return int(self.watermark * self.num_gpu_blocks)
