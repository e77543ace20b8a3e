"""The checks after each "your turn" cell.

A check cell is ordinary code (asserts against the real package) inside ``with
checking("1.2"):``. Until the exercise is solved the check raises :class:`NotSolved`, which
names the exercise, says what went wrong and where the solution is; once solved it prints a
line saying so. The test suite runs every check twice: on the blank cell (it must raise) and
with the solution from ``tutorials/solutions/`` filled in (it must pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class NotSolved(Exception):
    """An exercise's check failed: the cell above it still needs work."""


@contextmanager
def checking(exercise: str, solutions: str = "tutorials/solutions/") -> Iterator[None]:
    """Run a check; any exception in it becomes :class:`NotSolved` for ``exercise``."""
    try:
        yield
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise NotSolved(
            f"exercise {exercise} is not solved yet ({reason}). Change the cell above and run "
            f"it and this check again; a solution is in {solutions}"
        ) from exc
    print(f"✓ exercise {exercise} solved")
