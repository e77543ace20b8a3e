"""Float64 references of every public op, written for obviousness rather than speed.

Each op's reference lives in its folder, next to the code it checks (``attention/reference.py``,
``cache/reference.py``, ``fused/reference.py``); this module gathers them under one name, so
``pagedattn_kernels.reference.<op>`` is the reference of ``pagedattn_kernels.<op>`` (plus the
folders' helpers, e.g. ``gather_context``). The folders gathered are those that
``pagedattn_kernels.ops`` takes its operations from: a new op folder shows up here by itself.

They loop over tokens, sequences and block-table entries one at a time, so each can be read
against the definitions in docs/dev/kernels-api.md. Attention and the fused ops return float64;
the in-place cache ops write into the tensors they are given (pass clones). They run on any
device.
"""

from __future__ import annotations

import importlib

from pagedattn_kernels import ops as _ops


def _gather() -> dict[str, object]:
    """Every name in ``__all__`` of the ``reference`` module of each op folder."""
    folders = sorted({op.__module__.rpartition(".")[0] for op in _ops.operations().values()})
    found: dict[str, object] = {}
    for folder in folders:
        module = importlib.import_module(f"{folder}.reference")
        found.update({name: getattr(module, name) for name in module.__all__})
    return found


_found = _gather()
globals().update(_found)
__all__ = sorted(_found)
del _found
