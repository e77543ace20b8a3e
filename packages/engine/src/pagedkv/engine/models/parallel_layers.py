"""Megatron-style tensor-parallel layers, and loading each rank's shard of a checkpoint.

* :class:`ColumnParallelLinear`: the output features are split over the ranks; each rank
  computes its slice of the output, no communication. A fused projection (Q/K/V, gate/up) splits
  each of its parts separately, so that rank ``r`` holds its heads of Q, of K and of V.
* :class:`RowParallelLinear`: the input features are split; each rank multiplies its slice of
  the input (the column-parallel output it already has) and an all-reduce sums the partial
  outputs. The bias is added once, by rank 0, before the sum.
* :class:`VocabParallelEmbedding`: the vocabulary rows are split (padded to a multiple of the
  size); ids outside a rank's range give zeros there, and an all-reduce assembles the rows.
  The same sharding serves as the LM head (:func:`vocab_parallel_logits`): each rank computes
  the logits of its vocabulary slice and rank 0 gathers them.

At size 1 every layer is a plain ``nn.Linear`` / ``nn.Embedding`` with the same parameter names
and runs exactly the same operations as one.

The two linear layers are the ones ``--quantization fp8`` quantizes (``quantizable``; see
``pagedkv.engine.models.quantization``): they hold a ``weight_scale`` buffer, None until then,
and multiply through ``fp8_linear`` once it is set.

Each layer loads its parameters with ``load_shard(leaf, source, shard)``: ``source`` is the full
checkpoint tensor (a ``torch.Tensor``, or a lazy safetensors slice with ``shape`` and
``narrow``), and only this rank's slice of it is read and copied, so no rank ever holds another
rank's weights on its device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.engine.distributed.communication import (
    TPInfo,
    all_reduce,
    gather_last_dim,
    tp_rank_size,
)
from pagedkv.engine.models.cpu_matmul import packed_linear
from pagedkv.engine.models.dense_linear import dense_linear, dense_linear_silu_and_mul
from pagedkv.engine.models.layers import copy_weight
from pagedkv.engine.models.quantization import Fp8Rows, fp8_linear


def materialize(source: Any) -> torch.Tensor:
    """The whole tensor of a checkpoint source."""
    return source if isinstance(source, torch.Tensor) else source.materialize()


def _check_shape(source: Any, expected: tuple[int, ...], name: str) -> None:
    if tuple(source.shape) != tuple(expected):
        raise ValueError(
            f"weight {name!r} has shape {tuple(source.shape)}, the model expects {tuple(expected)}: "
            "the checkpoint does not match its config"
        )


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(
            f"{what} ({total}) is not divisible by the tensor-parallel size {size}; "
            "choose a size that divides it"
        )
    return total // size


class ColumnParallelLinear(nn.Linear):
    """``y = x Wᵀ + b`` with the output features (of each fused part) split over the ranks."""

    quantizable = True

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        tp: TPInfo | None = None,
        what: str = "output features",
    ):
        rank, size = tp_rank_size(tp)
        self.output_sizes = tuple(int(s) for s in output_sizes)
        self.local_sizes = tuple(divide(s, size, what) for s in self.output_sizes)
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        self.tp = tp
        self.tp_rank, self.tp_size = rank, size
        self.register_buffer("weight_scale", None)
        self.packed_weight: torch.Tensor | None = None  # on the CPU: see cpu_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.is_cpu:
            return packed_linear(x, self.packed_weight, self.bias)
        if self.weight_scale is None:
            return dense_linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def silu_and_mul_in_kernel(self, x: torch.Tensor | Fp8Rows,
                               fp8_out: bool) -> torch.Tensor | Fp8Rows | None:  # fmt: skip
        """For a fused gate/up projection of 16-bit weights (two parts of one size, no
        bias): SwiGLU's ``silu(gate) * up`` of this layer's output, made in the matmul's own
        kernel where the rows go to ``pagedattn_kernels.matmul_16bit`` (decode batches on a
        GPU); else None (the caller runs the layer, then the activation).

        fp8 weights keep the matmul, the activation and its quantization apart: on an H200
        ``fp8_matmul_silu_and_mul`` made a decode step of Llama-3-8B 3.5% slower at 8
        sequences and 0.5% at 32 (its epilogue scales, takes each tile's maxima, and leaves
        the quantization 448 maxima a row to read), 1.5% faster at 64
        (``bash scripts/gpu_fp8.sh stepab``, e47b26b)."""
        sizes = self.local_sizes
        if self.bias is not None or len(sizes) != 2 or sizes[0] != sizes[1]:
            return None
        if self.weight_scale is not None or fp8_out or isinstance(x, Fp8Rows):
            return None
        return dense_linear_silu_and_mul(x, self.weight)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        total = sum(self.output_sizes)
        return (total, self.in_features) if leaf == "weight" else (total,)

    def load_shard(self, leaf: str, source: Any, shard: int | None = None, name: str = "") -> None:
        """Copy this rank's rows of part ``shard`` (None: the whole fused output)."""
        param = getattr(self, leaf)
        name = name or leaf
        if shard is None:
            _check_shape(source, self.full_shape(leaf), name)
            start = 0
            for k, full in enumerate(self.output_sizes):
                self._copy_part(param, source, k, start, name)
                start += full
            return
        _check_shape(source, (self.output_sizes[shard], *param.shape[1:]), name)
        self._copy_part(param, source, shard, 0, name)

    def _copy_part(self, param: torch.Tensor, source: Any, k: int, start: int, name: str) -> None:
        local = self.local_sizes[k]
        dst = param.narrow(0, sum(self.local_sizes[:k]), local)
        copy_weight(dst, source.narrow(0, start + self.tp_rank * local, local), name)

    def extra_repr(self) -> str:
        return super().extra_repr() + (
            f", tp={self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        )


class RowParallelLinear(nn.Linear):
    """``y = x Wᵀ + b`` with the input features split over the ranks, then an all-reduce."""

    quantizable = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tp: TPInfo | None = None,
        what: str = "input features",
    ):
        rank, size = tp_rank_size(tp)
        self.full_in_features = in_features
        super().__init__(divide(in_features, size, what), out_features, bias=bias)
        self.tp = tp
        self.tp_rank, self.tp_size = rank, size
        self.register_buffer("weight_scale", None)
        self.packed_weight: torch.Tensor | None = None  # on the CPU: see cpu_matmul

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None and x.is_cpu:
            return packed_linear(x, self.packed_weight, bias)
        if self.weight_scale is None:
            return dense_linear(x, self.weight, bias)
        return fp8_linear(x, self.weight, self.weight_scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        y = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y, self.tp)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        return (
            (self.out_features, self.full_in_features) if leaf == "weight" else (self.out_features,)
        )

    def load_shard(self, leaf: str, source: Any, shard: int | None = None, name: str = "") -> None:
        param = getattr(self, leaf)
        name = name or leaf
        _check_shape(source, self.full_shape(leaf), name)
        if leaf == "bias":
            copy_weight(param, materialize(source), name)
            return
        local = self.in_features
        copy_weight(param, source.narrow(1, self.tp_rank * local, local), name)

    def extra_repr(self) -> str:
        return super().extra_repr() + (
            f", tp={self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        )


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding with the vocabulary rows split over the ranks (also the LM head's
    weight). With a vocabulary not divisible by the size, the last rank's slice ends in zero
    padding rows that no id reaches and whose logits are cut."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPInfo | None = None):
        rank, size = tp_rank_size(tp)
        per_rank = math.ceil(num_embeddings / size)
        super().__init__(per_rank, embedding_dim)
        self.full_num_embeddings = num_embeddings
        self.vocab_start = min(rank * per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.tp = tp
        self.tp_rank, self.tp_size = rank, size
        self.packed_weight: torch.Tensor | None = None  # as the LM head, on the CPU: cpu_matmul
        # As the LM head with --quantize-lm-head: the output matrix in e4m3 and its per-row
        # scales [1, rows], which the logits multiply by (quantization.quantize_lm_head)
        self.fp8_head: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)

    def full_shape(self, leaf: str) -> tuple[int, ...]:
        return (self.full_num_embeddings, self.embedding_dim)

    def load_shard(self, leaf: str, source: Any, shard: int | None = None, name: str = "") -> None:
        name = name or leaf
        _check_shape(source, self.full_shape(leaf), name)
        rows = self.vocab_end - self.vocab_start
        if rows == self.num_embeddings:
            copy_weight(self.weight, source.narrow(0, self.vocab_start, rows), name)
            return
        copy_weight(self.weight.narrow(0, 0, rows), source.narrow(0, self.vocab_start, rows), name)
        with torch.no_grad():
            self.weight[rows:].zero_()

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.tp_size > 1:
            text += f", vocab [{self.vocab_start}, {self.vocab_end}) of {self.full_num_embeddings}"
        return text


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output matrix, sharded like the embedding (used through
    :func:`vocab_parallel_logits`, never called)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead holds the output matrix; use vocab_parallel_logits")


def vocab_parallel_logits(
    hidden: torch.Tensor, head: VocabParallelEmbedding, float32: bool = True
) -> torch.Tensor | None:
    """Logits ``[N, vocab]`` of ``hidden [N, dim]``: on rank 0 the whole vocabulary, gathered
    from the ranks' slices; None on the other ranks (only rank 0 samples). float32, or with
    ``float32=False`` in the product's own dtype (what an argmax needs: see
    ``Model.compute_logits``)."""
    if head.tp_size == 1:
        logits = _head_product(hidden, head)
    else:
        logits = gather_last_dim(_head_product(hidden, head), head.tp)
        if logits is None:
            return None
        logits = logits[:, : head.full_num_embeddings]
    return logits.float() if float32 else logits


def _head_product(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """``hidden @ W.T`` for this rank's rows of the output matrix: in fp8 where the head was
    quantized, else packed for the CPU or as ``F.linear``."""
    if head.fp8_head is not None:
        return fp8_linear(hidden, *head.fp8_head)
    if head.packed_weight is not None and hidden.is_cpu:
        return packed_linear(hidden, head.packed_weight)
    return F.linear(hidden, head.weight)


def load_parameter(
    modules: Mapping[str, nn.Module], target: str, source: Any, shard: int | None, name: str
) -> None:
    """Load checkpoint tensor ``source`` (named ``name``) into the model parameter ``target``:
    through its layer's ``load_shard`` for a parallel layer, whole for a replicated one."""
    module_name, _, leaf = target.rpartition(".")
    module = modules[module_name]
    loader = getattr(module, "load_shard", None)
    if loader is not None:
        loader(leaf, source, shard, name)
    elif shard is not None:
        raise ValueError(
            f"{target!r} is not a fused parameter; cannot load {name!r} into part {shard}"
        )
    else:
        copy_weight(getattr(module, leaf), materialize(source), name)
