"""Which implementation runs an op: the Triton kernels or the plain-torch path.

The choice follows the tensors' device (CUDA -> Triton, CPU -> torch) unless a caller forces
one with the ``backend=`` keyword or the ``PAGEDATTN_BACKEND`` environment variable
(``auto``, ``torch`` or ``triton``). Forcing ``triton`` on CPU tensors runs the very same
kernels in Triton's interpreter, which is how the kernels are tested on machines without a GPU.

Triton decides at *definition* time (when ``@triton.jit`` runs) whether a kernel is compiled or
interpreted: it reads ``TRITON_INTERPRET`` then. So each kernel module (``triton_kernels``:
attention and cache ops; ``fused_kernels``: norms, activation, rotary) is loaded twice at most,
each copy under its own setting of that variable, and each launch picks the copy that fits the
device of its tensors. This keeps one process able to run compiled kernels on CUDA tensors and
interpreted kernels on CPU tensors side by side (the GPU test run does both).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
ENV_VAR = "PAGEDATTN_BACKEND"


def resolve_backend(device: torch.device, backend: str | None) -> Literal["torch", "triton"]:
    """Return the implementation to use for tensors on ``device``.

    ``backend`` None means: read ``PAGEDATTN_BACKEND`` (default ``auto``).
    """
    name = backend if backend is not None else os.environ.get(ENV_VAR, "auto") or "auto"
    name = name.strip().lower()
    if name not in BACKENDS:
        where = "backend=" if backend is not None else f"${ENV_VAR}="
        raise ValueError(f"{where}{name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"the Triton backend runs on CUDA tensors (compiled) or CPU tensors (interpreted), "
            f"not on {device.type!r}; use backend='torch'"
        )
    return name  # type: ignore[return-value]


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


KERNEL_MODULES: tuple[str, ...] = ("triton_kernels", "fused_kernels")


@functools.cache
def triton_kernels(interpret: bool, module: str = "triton_kernels") -> ModuleType:
    """A module of ``@triton.jit`` kernels (one of ``KERNEL_MODULES``), compiled
    (``interpret=False``) or interpreted.

    Cached: each variant is defined once per process.
    """
    if module not in KERNEL_MODULES:
        raise ValueError(f"unknown kernel module {module!r}; one of {', '.join(KERNEL_MODULES)}")
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "the Triton backend needs the 'triton' package (pip install triton); "
            "use backend='torch' to run without it"
        )
    if not interpret:
        # The regular import: compiled unless the user set TRITON_INTERPRET=1 themselves.
        return importlib.import_module(f"pagedattn_kernels.{module}")
    # Triton imports its Gluon frontend lazily at the first launch, and that import asserts it
    # sees either un-patched (compiled) language functions or TRITON_INTERPRET=1; inside an
    # interpreted launch with the variable unset it sees neither. Import it up front.
    with contextlib.suppress(ImportError):
        importlib.import_module("triton.experimental.gluon")
    name = f"pagedattn_kernels._{module}_interpreted"
    spec = importlib.util.find_spec(f"pagedattn_kernels.{module}")
    if spec is None or spec.origin is None:  # pragma: no cover - broken install
        raise RuntimeError(f"pagedattn_kernels.{module} is missing from this install")
    copy_spec = importlib.util.spec_from_file_location(name, spec.origin)
    if copy_spec is None or copy_spec.loader is None:  # pragma: no cover
        raise RuntimeError(f"cannot load {spec.origin}")
    module = importlib.util.module_from_spec(copy_spec)
    sys.modules[name] = module
    with _env("TRITON_INTERPRET", "1"):
        copy_spec.loader.exec_module(module)
    return module


def kernels_for(device: torch.device, module: str = "triton_kernels") -> ModuleType:
    """Compiled kernels for CUDA tensors, interpreted ones for CPU tensors."""
    return triton_kernels(device.type != "cuda", module)
