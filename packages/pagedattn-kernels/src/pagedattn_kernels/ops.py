"""The public face of pagedattn_kernels: every operation, gathered from its folder.

One folder per operation family, each holding everything about its ops: the public functions
(``ops.py``: check the inputs, then run the backend that fits the tensors' device), the input
checks (``checks.py``), the torch path (``torch_impl.py``), the Triton launchers and kernels
(``triton_launch.py``, ``triton_kernels.py``) and the float64 references (``reference.py``):

- ``attention/``: paged attention over mixed prefill/decode batches, paged decode attention;
- ``cache/``: writing K/V into their slots, copying blocks (copy-on-write), swapping blocks;
- ``fused/``: RMSNorm (with the residual add), SiLU-and-multiply, rotary embedding (alone or
  with the cache write);
- ``quant/``: per-token fp8 quantization of activations (the dynamic side of an fp8 matmul),
  the fp8 matmul that takes them and its kernel on 16-bit operands, each also with SwiGLU's
  activation in its epilogue (a gate/up projection and SiLU-and-multiply in one kernel);
- ``sampling/``: from logits to token ids: the greedy token of each row (``argmax_rows``).

This module imports each op from its folder, and that import line is what makes an op public:
``pagedattn_kernels`` re-exports this module's ``__all__`` and ``pagedattn_kernels.reference``
gathers the references of the folders named here. See docs/dev/kernels-api.md (the contract
the engine is written against) and the README ("How to add an operation").

Every op but ``swap_blocks`` (the copy engine's work on every device) takes ``backend=``
(``"auto"``, ``"torch"``, ``"triton"``; default: the ``PAGEDATTN_BACKEND`` environment variable,
else ``"auto"``): ``auto`` runs the Triton kernels on CUDA tensors and the torch path on CPU
tensors; ``triton`` on CPU tensors runs the kernels in Triton's interpreter (slow; for tests).
Triton itself is imported at the first Triton launch, so CPU users need no triton.
"""

from collections.abc import Callable

from pagedattn_kernels.attention.ops import paged_attention, paged_decode_attention
from pagedattn_kernels.attention.plan import (
    DecodePlan,
    decode_plan_capacity,
    decode_plan_pays,
    plan_decode,
)
from pagedattn_kernels.attention.warm_up import warm_up_decode_attention
from pagedattn_kernels.cache.ops import copy_blocks, reshape_and_cache, swap_blocks, swap_stream
from pagedattn_kernels.common import BACKENDS, FP8_DTYPE, FP8_MAX, resolve_backend
from pagedattn_kernels.fused.ops import (
    MAX_HIDDEN,
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    rms_norm,
    rms_norm_fp8,
    rotary_embedding,
    rotary_embedding_and_cache,
    silu_and_mul,
    silu_and_mul_fp8,
)
from pagedattn_kernels.quant.ops import (
    fp8_matmul,
    fp8_matmul_silu_and_mul,
    matmul_16bit,
    matmul_16bit_silu_and_mul,
    quantize_fp8_per_token,
)
from pagedattn_kernels.sampling.ops import argmax_rows

__all__ = [  # noqa: RUF022 (grouped by folder, not sorted)
    # attention/
    "paged_attention",
    "paged_decode_attention",
    # attention/plan.py: the work plan of a decode call (host code, not an op)
    "DecodePlan",
    "decode_plan_capacity",
    "decode_plan_pays",
    "plan_decode",
    # attention/warm_up.py: compiling the decode kernels at start-up (host code, not an op)
    "warm_up_decode_attention",
    # cache/
    "copy_blocks",
    "reshape_and_cache",
    "swap_blocks",
    "swap_stream",
    # fused/
    "MAX_HIDDEN",
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "silu_and_mul_fp8",
    # quant/
    "fp8_matmul",
    "fp8_matmul_silu_and_mul",
    "matmul_16bit",
    "matmul_16bit_silu_and_mul",
    "quantize_fp8_per_token",
    # sampling/
    "argmax_rows",
    # fp8 (common): the cache dtype of an fp8 KV cache and its largest magnitude
    "FP8_DTYPE",
    "FP8_MAX",
    # backend choice (common)
    "BACKENDS",
    "resolve_backend",
]


def operations() -> dict[str, Callable[..., object]]:
    """The public operations by name: every function in ``__all__`` defined in an op folder's
    ``ops`` module (not the plumbing: ``resolve_backend``, ``swap_stream``, the constants).
    The structural test requires a torch path and a float64 reference for each."""
    found: dict[str, Callable[..., object]] = {}
    for name in __all__:
        value = globals()[name]
        if callable(value) and getattr(value, "__module__", "").endswith(".ops"):
            found[name] = value
    return found
