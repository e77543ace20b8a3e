"""Exceptions raised by kvblocks.

Why a hierarchy of specific exceptions: the scheduler reacts differently to "no memory right now"
(preempt something and retry) and to a programming error (unknown sequence, double free), so each
case gets its own class; all derive from :class:`KVBlocksError` so a caller can catch them in one
place. Every operation validates its input before it changes anything, so an operation that
raises leaves all state exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "BlockLimitError",
    "DoubleFreeError",
    "InvalidBlockError",
    "KVBlocksError",
    "NoFreeBlocksError",
    "SequenceExistsError",
    "SwapError",
    "SwapSpaceError",
    "UnknownSequenceError",
]


class KVBlocksError(Exception):
    """Base class of every error kvblocks raises on purpose."""


class NoFreeBlocksError(KVBlocksError):
    """A pool has fewer free blocks than an operation needs (nothing was allocated).

    Recoverable: free or preempt (swap out / recompute) sequences and retry.
    """


class UnknownSequenceError(KVBlocksError, KeyError):
    """The sequence id is not registered (never allocated, or already freed)."""

    def __str__(self) -> str:
        # KeyError.__str__ would show the message in quotes; keep it readable.
        return str(self.args[0]) if self.args else ""


class SequenceExistsError(KVBlocksError, ValueError):
    """The sequence id is already registered; free it first or choose another id."""


class DoubleFreeError(KVBlocksError):
    """A block whose ref count is already 0 was released again."""


class InvalidBlockError(KVBlocksError, ValueError):
    """A physical block id is out of range, or is used while it is free."""


class BlockLimitError(KVBlocksError):
    """A sequence would need more blocks than ``max_blocks_per_seq`` allows."""


class SwapError(KVBlocksError):
    """A swap (or an operation that needs the sequence on the GPU) was asked for the wrong place.

    For example swapping out a sequence that is already on the CPU, growing a swapped-out
    sequence, or a group that is empty or names a sequence twice.
    """


class SwapSpaceError(SwapError, NoFreeBlocksError):
    """The destination pool of a swap lacks free blocks; nothing moved.

    Both a :class:`SwapError` and a :class:`NoFreeBlocksError`, so either ``except`` catches it.
    """
