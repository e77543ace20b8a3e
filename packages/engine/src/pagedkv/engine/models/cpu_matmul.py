"""Linear layers on the CPU through oneDNN, with weights packed once at load time.

A decode step on the CPU is mostly matrix products (79% of a step's time in a profile of the
embedded model). ``F.linear`` on float32 goes to MKL's sgemm, which on this project's AMD
machines runs at 34-44 GFLOP/s per core for the model's shapes; oneDNN, given the weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
``torch.compile`` does for CPU linear layers), runs the same products at 45-76 GFLOP/s, and
2.2-2.5x faster for the LM head and for small batches. So every linear layer of a model on the
CPU keeps a ``packed_weight`` beside its ``weight`` (which stays: the embedding shares it with
the LM head, and weight loading, fp8 quantization and tensor parallelism read it) and
multiplies through :func:`packed_linear`.

The products are the same up to float32 rounding (a different summation order, ~1e-4 on
logits of magnitude ~10). Nothing is packed where oneDNN is not built into torch, for fp8
layers, or off the CPU; a layer whose input is not on the CPU (a model moved after loading)
multiplies its ``weight`` as before. The packed copy is made once the weights are loaded: code
that changes ``weight`` afterwards must pack again (:func:`pack_model`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The batch-size hint of the packed layout: decode batches of tens of rows.
_BATCH_HINT = 64
_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., in] @ weight.T + bias`` with the weight given packed.

    Batch-invariant: a row's result does not depend on the other rows. oneDNN's packed
    products give each row the same bits for any number of rows from two up (MKL's sgemm does
    not), but a single row takes another kernel; so a lone row is computed as two. Seeded
    sampling relies on it: a request's tokens must not depend on what else is in the batch."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows == 1:
        x2 = x2.expand(2, -1)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    if rows == 1:
        y = y[:1]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def pack_model(model: nn.Module) -> int:
    """Give every linear layer of ``model`` (modules with a ``packed_weight`` attribute: the
    decoder's linear layers and the LM head) its packed weight, where it lives on the CPU in a
    float dtype. Returns how many were packed."""
    if not available():
        return 0
    head = getattr(model, "lm_head", None)  # None: the embedding is the LM head (tied)
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        if isinstance(module, nn.Embedding) and head is not None and module is not head:
            continue  # an embedding that only embeds: no product to speed up
        weight = module.weight
        fp8 = getattr(module, "weight_scale", None) is not None
        fp8 = fp8 or getattr(module, "fp8_head", None) is not None  # logits from an fp8 copy
        if fp8 or weight.device.type != "cpu" or weight.dtype not in _DTYPES:
            continue
        module.packed_weight = pack(weight)
        count += 1
    logger.info("oneDNN: %d linear layers packed for the CPU", count)
    return count
