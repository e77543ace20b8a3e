"""The KV cache's layout in one place: the block size, and the slot of a position.

Why a module of its own: every layer of pagedkv (this package, the scheduler, the engine's
runner and its vectorized slot mapping, the kernels' tests) must agree on these two facts, so
they are defined once, here, and the others call or cite them.

* A **block size** is the number of token slots in one KV block. It must be a power of two, so
  that position -> (logical block index, offset) is a shift and a mask on the hot path.
  :func:`check_block_size` is the one validation; call it where the value enters a component.
* The **slot** of position ``p`` of a sequence is
  ``block_table[p // block_size] * block_size + p % block_size`` (:func:`slot_of`): the physical
  block that backs logical block ``p // block_size``, and the offset inside it. A slot mapping
  is this rule applied to every position computed in a step.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_block_size", "slot_of"]


def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is a valid block size, else raise ValueError.

    Valid: an ``int`` (not a ``bool``) that is a power of two (1, 2, 4, 8, 16, 32, ...).
    """
    if type(block_size) is not int or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two (1, 2, 4, 8, 16, 32, ...), got {block_size!r}; "
            "16 is the usual choice"
        )
    return block_size


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The KV slot of ``position``: ``block_table[position // block_size] * block_size +
    position % block_size``. This is *the* slot rule of pagedkv; vectorized versions (the
    runner's slot mapping) compute the same thing.

    No validation (it is used on hot paths): ``position`` must have a reserved slot, i.e.
    ``position // block_size < len(block_table)``.
    """
    return block_table[position // block_size] * block_size + position % block_size
