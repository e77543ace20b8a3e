"""A buddy allocator over KV token slots: how the PagedAttention paper's Orca baselines place
each request's contiguous KV reservation ("we use the buddy allocation algorithm to determine
the memory address to store KV cache", its Section 6.1).

Every allocation gets a power-of-two chunk aligned to its size (the rounding is *internal
fragmentation*); a freed chunk merges with its free buddy into the next size up. Free slots
scattered over chunks too small for the next request are *external fragmentation*: the
request waits although enough slots are free in all.

The slots need not be a power of two: they are covered by aligned root chunks, largest first
(``max_chunk``-sized ones, then the binary digits of the rest), and chunks never merge across
roots. Torch-free; plain ints.
"""

from __future__ import annotations

__all__ = ["BuddyAllocator"]


def _order_of(size: int) -> int:
    """Smallest k with 2**k >= size."""
    return max(0, (size - 1).bit_length())


class BuddyAllocator:
    """Power-of-two chunks of ``capacity`` slots, at most ``max_chunk`` (a power of two) each."""

    def __init__(self, capacity: int, max_chunk: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if (
            isinstance(max_chunk, bool)
            or not isinstance(max_chunk, int)
            or max_chunk < 1
            or max_chunk & (max_chunk - 1)
        ):
            raise ValueError(f"max_chunk must be a power of two >= 1, got {max_chunk!r}")
        self.capacity = capacity
        self.max_order = _order_of(max_chunk)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._root_order: dict[int, int] = {}  # root start -> its order
        self._allocated: dict[int, int] = {}  # start -> order
        self.num_free = capacity
        start = 0
        for order in range(self.max_order, -1, -1):
            while capacity - start >= 1 << order:
                self._root_order[start] = order
                self._free[order].add(start)
                start += 1 << order
                if order < self.max_order:
                    break  # the rest is below this size: one root per binary digit

    @property
    def largest_chunk(self) -> int:
        """The largest chunk this allocator can ever hand out (its largest root)."""
        return 1 << max(self._root_order.values())

    @staticmethod
    def chunk_size(size: int) -> int:
        """The slots an allocation of ``size`` takes: the next power of two."""
        return 1 << _order_of(size)

    def _root_limit(self, start: int) -> int:
        """The largest order a chunk containing ``start`` may merge up to (its root's)."""
        best = 0
        for root, order in self._root_order.items():
            if root <= start < root + (1 << order):
                best = order
                break
        return best

    def largest_free_chunk(self) -> int:
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def can_allocate(self, size: int) -> bool:
        order = _order_of(size)
        return any(self._free[o] for o in range(order, len(self._free)))

    def allocate(self, size: int) -> int | None:
        """Start slot of a chunk of ``chunk_size(size)`` slots, or None when no free chunk is
        large enough (whatever the total of free slots)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        want = _order_of(size)
        if 1 << want > self.largest_chunk:
            raise ValueError(f"{size} slots exceed the largest chunk ({self.largest_chunk})")
        for order in range(want, self.max_order + 1):
            if self._free[order]:
                start = min(self._free[order])  # lowest address first: deterministic
                self._free[order].remove(start)
                while order > want:  # split, keeping the lower half
                    order -= 1
                    self._free[order].add(start + (1 << order))
                self._allocated[start] = want
                self.num_free -= 1 << want
                return start
        return None

    def free(self, start: int) -> None:
        order = self._allocated.pop(start, None)
        if order is None:
            raise ValueError(f"slot {start} is not the start of an allocated chunk")
        self.num_free += 1 << order
        limit = self._root_limit(start)
        while order < limit:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)
