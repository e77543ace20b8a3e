"""fp8 weights (``--quantization fp8``): W8A8 matmuls with e4m3 weights and activations.

At load time every linear layer of the decoder stack (the tensor-parallel linear layers: Q/K/V,
output, gate/up and down projections) has its weight quantized *per output channel*:
``scale[n] = amax(|W[n, :]|) / 448`` and ``Wq[n, :] = e4m3(W[n, :] / scale[n])``, which halves
the weight bytes a decode step reads (the embedding and the LM head keep the model dtype, as
in vLLM; ``--quantize-lm-head`` quantizes the LM head too: :func:`quantize_lm_head`). At run
time each activation row (token) is quantized with its own *dynamic* scale
(``pagedattn_kernels.quantize_fp8_per_token``), and the matmul is

    y[t, n] = (sum_k xq[t, k] * Wq[n, k]) * x_scale[t] * w_scale[n]

- on a GPU of compute capability 8.9+ (Ada, Hopper) by ``torch._scaled_mm`` with row-wise
  scales: fp8 tensor cores, fp32 accumulation, the scales applied in the epilogue;
- elsewhere (the CPU, older GPUs) by the same arithmetic in float32: the fp8 operands are
  converted (exactly) and multiplied, then scaled. This is slow (each call converts the
  weight), but it computes what the fp8 kernel computes, so the CPU can measure the accuracy
  of fp8 weights (``python -m pagedkv.bench.fp8_accuracy``).

Few rows (decode batches): cuBLAS's fp8 kernels tile the rows by 128, so at 16 tokens
``torch._scaled_mm`` was only 8% faster than bf16 on an H200 although it reads half the weight
bytes. ``pagedattn_kernels.fp8_matmul`` swaps the operands (weight rows on the tile's long
side) and takes the matmuls of up to ``FP8_MATMUL_MAX_ROWS`` (128) rows: the same arithmetic
(exact products, float32 sums), in another kernel, with tiles picked per shape
(``pagedattn_kernels.quant.triton_launch.pick_config``). On an H200 a Llama-3-8B decoder
layer's four matmuls take 66 / 72 / 89 us at 16 / 64 / 128 rows against 117 / 125 / 135 for
bf16 ``F.linear`` and 101 for ``torch._scaled_mm`` at 128 (in CUDA graphs, weights from HBM;
``scripts/fp8_weight_only_gemm.py``, 6d1d2a1). In the real-ShareGPT run (fp8 weights and
cache) it took the run from 11,282 output tok/s (``_scaled_mm`` for all) to 13,343 (2b5b50b).
The environment variable ``PAGEDKV_FP8_MATMUL_MAX_ROWS`` sets the row limit for a run (0:
``torch._scaled_mm`` for every size).

Why per channel and per token: one scale per tensor lets a single outlier channel or token
flatten the resolution of all others; per-row scales cost one float per row and nothing in the
kernel's inner loop.

Fused quantization: where a linear layer's input comes out of an RMSNorm or SwiGLU's
``silu_and_mul`` (the Q/K/V and gate/up projections, the down projection), that kernel can
quantize its own output (``pagedattn_kernels.rms_norm_fp8`` and friends) and hand the linear
layer :class:`Fp8Rows` instead of 16-bit rows: the activation is then written and read once in
fp8 rather than written in 16 bits, read, quantized and written again. The values are the
same (bit for bit, but for the compiled norm's sum order: ``pagedattn_kernels.rms_norm_fp8``).
A model opts in per layer (``use_fp8_inputs``, called by :func:`quantize_model`); the output
projection's input (attention's output) is still quantized by :func:`fp8_linear` itself.

Fast accumulation (on by default; ``PAGEDKV_FP8_FAST_ACCUM=0`` turns it off): ``torch._scaled_mm``'s
``use_fast_accum`` and ``fp8_matmul``'s ``fast_accum``, Hopper's fp8 tensor-core accumulation
without promoting partial sums to float32 (what vLLM's CUTLASS fp8 kernels for Hopper use).
Measured on an H200:
- speed: the linear layers of a Llama-3-8B decoder layer at 512 rows, with their
  quantization, in CUDA graphs: 1.70x as fast as bf16 with it, 1.54x without (fused with the
  norms and SiLU: 1.66x against 1.52x); the real-ShareGPT run above: 12,630 output tok/s
  against 12,146;
- error of the matmul against exact float32 sums: 2.4e-3 instead of 7e-4 (relative, K =
  4,096), both far below the quantization's own 3.75% against bf16 (3.752% against 3.750%);
- generated tokens (``python -m pagedkv.bench.fp8_accuracy``, the embedded model, 64 prompts x
  64 tokens, teacher-forced top-1 against bf16): 0.9248 against 0.9250 with fp8 weights,
  0.9146 against 0.9150 with fp8 weights and cache (2 and 1 tokens of 4,096). That model's
  K is small (576 and 1,536); the error above was measured at Llama-3-8B's.
  ``fp8_matmul`` (the decode batches) sums this way since 6d1d2a1, after the token figures
  above were measured: 3% faster at 16 rows (86.9 against 89.6 us for the four matmuls, one
  tile config), 23% at 128 (104.7 against 129.2; f534e71).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import pagedattn_kernels

FP8 = torch.float8_e4m3fn
METHODS = ("fp8",)


def row_limit(var: str, default: str) -> int:
    """A row limit from the environment: a whole number >= 0 (unset: ``default``)."""
    text = os.environ.get(var, default)
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{var}={text!r}: expected a whole number of rows >= 0")
    return limit


# Matmuls of at most this many rows go to pagedattn_kernels.fp8_matmul (see above).
FP8_MATMUL_MAX_ROWS = row_limit("PAGEDKV_FP8_MATMUL_MAX_ROWS", "128")
# ... on these devices (the CPU keeps the float32 fallback, which is the same arithmetic).
FP8_MATMUL_DEVICES = ("cuda",)
# torch._scaled_mm's use_fast_accum and fp8_matmul's fast_accum (see above).
FP8_FAST_ACCUM = os.environ.get("PAGEDKV_FP8_FAST_ACCUM", "1") == "1"


class Fp8Rows(NamedTuple):
    """Activation rows already quantized per token, as :func:`fp8_linear` would quantize them:
    ``q [..., in]`` e4m3 and ``scale [..., 1]`` float32, from rows of ``dtype`` (the model
    dtype, which the linear layer's output takes)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``Wq [out, in]`` e4m3, ``scale [1, out]`` float32) with ``Wq * scale.T ~ weight``: one
    scale per output channel (row), the same rule as the activations' per-token one. A weight
    on the meta device gives meta tensors of those shapes and dtypes."""
    if weight.is_meta:
        return (torch.empty(weight.shape, dtype=FP8, device="meta"),
                torch.empty((1, weight.shape[0]), dtype=torch.float32, device="meta"))
    q, scale = pagedattn_kernels.quantize_fp8_per_token(weight.detach())
    return q, scale.reshape(1, -1).contiguous()


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (asked once per GPU: the linear layers ask
    on every call)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` runs ``torch._scaled_mm`` for these operands (a CUDA device
    of compute capability 8.9+, both matrix dims multiples of 16) or the float32 fallback."""
    if not x.is_cuda or not hasattr(torch, "_scaled_mm") or cuda_capability(x.device) < (8, 9):
        return False
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def takes_fp8_matmul(q: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` sends these quantized rows to ``pagedattn_kernels.fp8_matmul``:
    at most ``FP8_MATMUL_MAX_ROWS`` of them, on a device of ``FP8_MATMUL_DEVICES`` and, on a
    GPU, one with fp8 tensor cores (the kernel's e4m3 conversions need compute capability 8.9;
    older GPUs keep the float32 fallback)."""
    if q.shape[0] > FP8_MATMUL_MAX_ROWS or q.device.type not in FP8_MATMUL_DEVICES:
        return False
    return q.device.type != "cuda" or uses_scaled_mm(q, weight)


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., in] @ dequant(weight [out, in]).T + bias`` in ``x.dtype``, with ``x`` quantized
    per token on the way (see the module docstring), or already quantized (:class:`Fp8Rows`)."""
    if isinstance(x, Fp8Rows):
        shape, dtype = x.q.shape, x.dtype
        q, x_scale = x.q.reshape(-1, shape[-1]), x.scale.reshape(-1, 1)
    else:
        shape, dtype = x.shape, x.dtype
        q, x_scale = pagedattn_kernels.quantize_fp8_per_token(x.reshape(-1, shape[-1]))
    if takes_fp8_matmul(q, weight):
        y = pagedattn_kernels.fp8_matmul(q, x_scale, weight, weight_scale, out_dtype=dtype,
                                         fast_accum=FP8_FAST_ACCUM)  # fmt: skip
    elif uses_scaled_mm(q, weight):
        # Row-wise scaling produces bfloat16 only; other model dtypes are cast after.
        y = torch._scaled_mm(
            q, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=torch.bfloat16,
            use_fast_accum=FP8_FAST_ACCUM,
        )
        if y.dtype != dtype:
            y = y.to(dtype)
    else:
        y = F.linear(q.to(torch.float32), weight.to(torch.float32))
        y = (y * x_scale * weight_scale).to(dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], weight.shape[0])


def quantize_model(model: nn.Module, method: str, lm_head: bool = False) -> int:
    """Quantize, in place, every layer of ``model`` that declares ``quantizable = True`` (the
    tensor-parallel linear layers, which hold a ``weight_scale`` buffer, None until then): its
    ``weight`` becomes e4m3, ``weight_scale`` ``[1, out]`` float32, and its forward switches
    to :func:`fp8_linear`; with ``lm_head``, the LM head too (:func:`quantize_lm_head`).
    Returns how many layers were quantized; a model with none raises ``ValueError`` (nothing
    changed)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    layers = [m for m in model.modules() if getattr(m, "quantizable", False)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no linear layers that fp8 quantization supports; "
            "run it without --quantization"
        )
    head = logits_head(model)
    if lm_head and head is None:
        raise ValueError(f"{type(model).__name__} has no LM head that fp8 quantization "
                         "supports; run it without --quantize-lm-head")  # fmt: skip
    for layer in layers:
        q, scale = quantize_weight(layer.weight)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale  # the layer registered a None buffer of that name
        if getattr(layer, "packed_weight", None) is not None:  # a CPU copy of the old weight
            layer.packed_weight = None
    for module in model.modules():  # norms and activations that feed them quantize themselves
        if hasattr(module, "use_fp8_inputs"):
            module.use_fp8_inputs()
    if lm_head:
        quantize_lm_head(model)
        return len(layers) + 1
    return len(layers)


def logits_head(model: nn.Module) -> nn.Module | None:
    """The module whose weight is ``model``'s output matrix (``lm_head``, or the embedding
    when they are tied), where it can hold an fp8 copy (``fp8_head``); else None."""
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(model, "embed_tokens", None)
    return head if hasattr(head, "fp8_head") else None


def quantize_lm_head(model: nn.Module) -> None:
    """The LM head's output matrix in e4m3, one scale per vocabulary row, as the linear layers
    (``--quantize-lm-head``): the logits become ``fp8_linear(hidden, Wq, scale)``, the
    hidden rows quantized per token.

    Why an option, off by default: vLLM's fp8 keeps the LM head in the model dtype, as its
    logits decide every sampled token directly; TensorRT-LLM quantizes it on request
    (``--quantize_lm_head``). Its matrix is large: Llama-3-8B's 128,256 x 4,096 are 12% of what
    a decode step of the fp8 model reads (1.05 GB of 8.5), so in fp8 a step of few sequences
    reads 0.5 GB less. ``python -m pagedkv.bench.fp8_accuracy`` measures what it costs in
    tokens (``weights_lm_head_fp8``).

    An untied head gives up its 16-bit matrix (its weight becomes the e4m3 one); a tied one
    keeps it for the embedding and holds the e4m3 copy beside it (half its bytes more)."""
    head = logits_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no LM head that fp8 quantization supports")
    q, scale = quantize_weight(head.weight)
    if head is getattr(model, "lm_head", None):
        head.weight = nn.Parameter(q, requires_grad=False)
        if getattr(head, "packed_weight", None) is not None:
            head.packed_weight = None
    head.fp8_head = (q, scale)


def lm_head_quantized(model: nn.Module) -> bool:
    """Whether :func:`quantize_lm_head` quantized ``model``'s LM head."""
    head = logits_head(model)
    return head is not None and head.fp8_head is not None


def is_quantized(model: nn.Module) -> bool:
    """Whether :func:`quantize_model` quantized ``model``."""
    return quantization_of(model) is not None


def quantization_of(model: nn.Module) -> str | None:
    """"fp8" for a model quantized by :func:`quantize_model`, else None."""
    for module in model.modules():
        if getattr(module, "weight_scale", None) is not None:
            return "fp8"
    return None
