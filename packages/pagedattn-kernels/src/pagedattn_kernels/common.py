"""Plumbing shared by every op folder: backend choice, the interpreter switch, common input checks
and launch helpers. Nothing here knows about a particular operation.

Backend choice: the tensors' device picks the implementation (CUDA -> Triton, CPU -> torch)
unless a caller forces one with the ``backend=`` keyword or the ``PAGEDATTN_BACKEND``
environment variable (``auto``, ``torch`` or ``triton``). Forcing ``triton`` on CPU tensors runs
the very same kernels in Triton's interpreter, which is how the kernels are tested on machines
without a GPU.

The interpreter switch: Triton decides at *definition* time (when ``@triton.jit`` runs) whether
a kernel is compiled or interpreted: it reads ``TRITON_INTERPRET`` then. So each op folder's
kernel module (``<folder>/triton_kernels.py``) is loaded twice at most, each copy under its own
setting of that variable, and each launch picks the copy that fits the device of its tensors
(:func:`kernels_for`). This keeps one process able to run compiled kernels on CUDA tensors and
interpreted kernels on CPU tensors side by side (the GPU test run does both). A kernel module
(and with it triton) is first imported at the first Triton launch, so CPU users need no triton.

Input checks: shapes, dtypes and devices are always checked. Values (slot ids, block ids,
lengths) are checked only when they live on the CPU, where reading them is free; on CUDA that
would cost a device sync per call, so there the caller is trusted (documented in the README).
Every check runs before anything is written, so a rejected call changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

# --------------------------------------------------------------------------- backend choice

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


# --------------------------------------------------------------------------- interpreter switch


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


@functools.cache
def load_kernels(module: str, interpret: bool) -> ModuleType:
    """The module of ``@triton.jit`` kernels named ``module`` (e.g.
    ``"pagedattn_kernels.attention.triton_kernels"``), compiled (``interpret=False``) or
    interpreted.

    Cached: each variant is defined once per process.
    """
    if not module.startswith("pagedattn_kernels.") or not module.endswith(".triton_kernels"):
        raise ValueError(
            f"{module!r} is not a kernel module; kernels live in "
            "pagedattn_kernels.<folder>.triton_kernels"
        )
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "the Triton backend needs the 'triton' package (pip install triton); "
            "use backend='torch' to run without it"
        )
    if not interpret:
        # The regular import: compiled unless the user set TRITON_INTERPRET=1 themselves.
        return importlib.import_module(module)
    # Triton imports its Gluon frontend lazily at the first launch, and that import asserts it
    # sees either un-patched (compiled) language functions or TRITON_INTERPRET=1; inside an
    # interpreted launch with the variable unset it sees neither. Import it up front.
    with contextlib.suppress(ImportError):
        importlib.import_module("triton.experimental.gluon")
    package, _, leaf = module.rpartition(".")
    name = f"{package}._{leaf}_interpreted"
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:  # pragma: no cover - broken install
        raise RuntimeError(f"{module} is missing from this install")
    copy_spec = importlib.util.spec_from_file_location(name, spec.origin)
    if copy_spec is None or copy_spec.loader is None:  # pragma: no cover
        raise RuntimeError(f"cannot load {spec.origin}")
    copy = importlib.util.module_from_spec(copy_spec)
    sys.modules[name] = copy
    with _env("TRITON_INTERPRET", "1"):
        copy_spec.loader.exec_module(copy)
    return copy


def kernels_for(device: torch.device, module: str) -> ModuleType:
    """The kernels of ``module``: compiled for CUDA tensors, interpreted for CPU tensors."""
    return load_kernels(module, device.type != "cuda")


def is_interpreted(kernel: object) -> bool:
    """Whether a kernel from :func:`kernels_for` runs in Triton's interpreter (launchers pick
    tile sizes and numerics workarounds by it)."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------- input checks

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

# fp8 KV cache: e4m3 ("fn": finite, no infinities), largest magnitude 448. A cache of this dtype
# holds each K (V) element as fp8(clamp(x / k_scale, -448, 448)), rounded to nearest even; the
# kernels read it back as fp8 * k_scale, in registers.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)



def fail(op: str, message: str) -> ValueError:
    return ValueError(f"{op}: {message}")


def check_float(
    op: str, name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise fail(op, f"{name} must be one of {names}, got {t.dtype}")


def check_index(op: str, name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """Integer tensor of the given shape (None = any size in that dim)."""
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise fail(op, f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape)
    ):
        want_s = ", ".join("*" if w is None else str(w) for w in shape)
        raise fail(op, f"{name} must have shape [{want_s}], got {tuple(t.shape)}")


def check_same_device(op: str, device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise fail(op, f"{name} is on {t.device} but the caches are on {device}; move it")


def check_caches(
    op: str, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape and dtype
    (a float dtype, or fp8 e4m3)."""
    check_float(op, "key_cache", key_cache, 4, CACHE_DTYPES)
    check_float(op, "value_cache", value_cache, 4, CACHE_DTYPES)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise fail(
            op,
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must match in shape and dtype",
        )
    if value_cache.device != key_cache.device:
        raise fail(op, "key_cache and value_cache must be on one device")
    nb, bs, hkv, d = key_cache.shape
    if bs <= 0 or hkv <= 0 or d <= 0:
        raise fail(op, f"cache shape {tuple(key_cache.shape)} has an empty dimension")
    return nb, bs, hkv, d


def check_unit_stride(op: str, **tensors: torch.Tensor) -> None:
    """The Triton kernels address the head dim with stride 1."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise fail(op, f"{name} needs stride 1 in its last dim (got {t.stride(-1)})")


def check_kv_scales(
    op: str, key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """fp8 caches take ``k_scale`` / ``v_scale``: None (1.0) or a float32 tensor of one element
    on the caches' device (a tensor, not a number, so a CUDA graph reads its current value).
    Caches of a float dtype hold values as they are: no scales."""
    if k_scale is None and v_scale is None:
        return
    if key_cache.dtype != FP8_DTYPE:
        raise fail(op, f"k_scale/v_scale apply to fp8 caches only; these are {key_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            continue
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32:
            got = f"{s.dtype} of {s.numel()} elements" if isinstance(s, torch.Tensor) else s
            raise fail(op, f"{name} must be a float32 tensor of one element, got {got}")
        if s.device != key_cache.device:
            raise fail(op, f"{name} is on {s.device} but the caches are on {key_cache.device}")


def check_fp8_triton(op: str, device: torch.device) -> None:
    """The Triton kernels convert fp8 e4m3 in hardware from compute capability 8.9 (Ada,
    Hopper) on; the interpreter (CPU tensors) converts on any machine."""
    if device.type == "cuda" and capability(device) < (8, 9):
        raise fail(
            op,
            f"fp8 caches need a GPU of compute capability 8.9 or newer for the Triton kernels "
            f"(this one is {capability(device)}); use backend='torch' or a float cache",
        )


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


PDL_ENV = "PAGEDATTN_PDL"


def use_pdl(device: torch.device) -> bool:
    """Whether the Triton kernels launch on ``device`` with programmatic dependent launch (PDL):
    CUDA, compute capability 9.0 (Hopper) or newer, unless ``PAGEDATTN_PDL=0``.

    Why: a decode step is hundreds of short kernels (a layer of Llama-3-8B on an fp8 model is
    twelve, most of them a few microseconds at small batches), and each normally starts only
    after the previous one has finished, been retired and the next one launched and spread over
    the SMs. Launched with PDL, a kernel may start while the previous one in the stream still
    runs: every kernel here then begins with ``griddepcontrol.wait`` (it blocks until the
    previous kernel has finished and its writes are visible, so no kernel reads or overwrites
    anything early) and ``griddepcontrol.launch_dependents`` (the next kernel may launch now).
    What overlaps is the launch and the scheduling of the next kernel's programs, never a read
    or write of their data. A kernel that follows one not launched so (cuBLAS, a copy) just
    starts when that one ends. CUDA graphs keep the dependency (captured as a programmatic
    edge).
    """
    if device.type != "cuda" or os.environ.get(PDL_ENV, "1").strip() == "0":
        return False
    return capability(device) >= (9, 0)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, interpreted: int = 4) -> int:
    """Streaming multiprocessors of a CUDA device (the launchers size grids by it); on the
    CPU, where the interpreter has none, ``interpreted``: a few, so that small tests take the
    paths that split work across programs."""
    if device.type != "cuda":
        return interpreted
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@dataclass(frozen=True, slots=True)
class SmLimits:
    """What one SM holds of resident programs (CUDA's occupancy limits). The defaults are
    sm_90's (H100, H200): 64K 32-bit registers, allocated to warps in units of 256; 228 KB of
    shared memory, of which the runtime reserves 1 KB per program; 64 warps; 32 programs."""

    registers: int = 65536
    register_unit: int = 256
    shared_bytes: int = 228 * 1024
    shared_reserved: int = 1024
    warps: int = 64
    programs: int = 32


def programs_per_sm(registers: int, shared: int, num_warps: int,
                    limits: SmLimits = SmLimits()) -> int:  # fmt: skip
    """How many programs of a compiled kernel (``registers`` a thread, ``shared`` bytes of
    shared memory, ``num_warps`` warps) an SM runs at once: the tightest of its register,
    shared-memory, warp and program limits.

    The launchers size split counts and decode plans by such a count (``DecodeConfig.per_sm``);
    when a compiler change moves a kernel's registers the count moves with them, so the
    configurations' counts are checked against this on the GPU (``tests/kernels``) and printed
    by ``tools/compile_sm90.py``."""
    if num_warps <= 0:
        raise ValueError(f"programs_per_sm: num_warps must be positive, got {num_warps}")
    warp_registers = -(-max(registers, 1) * 32 // limits.register_unit) * limits.register_unit
    by_registers = limits.registers // warp_registers // num_warps
    by_shared = limits.shared_bytes // (shared + limits.shared_reserved)
    return min(by_registers, by_shared, limits.warps // num_warps, limits.programs)


def round_mode(dtype: torch.dtype, interpreted: bool) -> int:
    """The kernels' ROUND for values stored in ``dtype`` (their ``_round`` helpers): 0 none
    (float32), 1 the cast, 2 bfloat16's round-to-nearest-even on the bits (the interpreter's
    cast to bfloat16 truncates)."""
    if dtype == torch.float32:
        return 0
    return 2 if dtype == torch.bfloat16 and interpreted else 1


def e4m3_encoder(kernel: object, device: torch.device) -> int:
    """How a kernel that writes e4m3 encodes it (its ``E4M3`` constexpr): 2, the hardware's
    conversion (``cvt.rn.satfinite.e4m3x2.f32``, sm_89 and later: nearest, ties to even, as
    torch's cast); 1, integer operations, in the interpreter (whose cast does not carry a
    mantissa round-up into the exponent: 7.97 becomes 4.0) and on older GPUs (where Triton
    converts in software)."""
    if is_interpreted(kernel) or device.type != "cuda" or capability(device) < (8, 9):
        return 1
    return 2


_UNITS: dict[torch.device, torch.Tensor] = {}


def scale_or_unit(scale: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The K or V scale tensor a kernel gets for ``cache``: the given one; for an fp8 cache
    without one, a 1.0 kept per device; a 16-bit cache's kernels never read it, so they get the
    cache itself (a valid pointer, and nothing allocated).

    The 1.0 is written by a kernel, which a CUDA graph capture records but does not run: made
    inside a capture, it would hold garbage until the graph first replays. So an fp8 cache
    without scales must first be used outside a capture (the engine always passes scales)."""
    if scale is not None:
        return scale
    if cache.dtype != FP8_DTYPE:
        return cache
    unit = _UNITS.get(cache.device)
    if unit is None:
        if cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "an fp8 cache without k_scale/v_scale reads a 1.0 made at its first use, which "
                "a CUDA graph capture cannot make: pass the scales, or call once outside the "
                "capture first"
            )
        unit = _UNITS[cache.device] = torch.ones(1, dtype=torch.float32, device=cache.device)
    return unit


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (same bytes): torch's indexing and copying ops do not all
    take fp8 (e.g. ``index_copy_`` on the CPU), and a copy moves bytes whatever they encode.
    Other tensors are returned as they are."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
