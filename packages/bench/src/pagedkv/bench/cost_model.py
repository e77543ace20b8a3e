"""A simple, documented cost model of one forward pass, for the simulator.

Why so simple: the simulator compares memory policies under the same model, so only the broad
shape matters: a decode step is bound by reading the weights, so batching more requests is
almost free until the batch gets compute-bound, and attention reads every cached KV token of
the batch. One iteration that computes ``T`` tokens (prefill chunks + decodes) over ``C`` context
tokens in all takes

    t = overhead + max(W / B, 2 * P * T / F) + kv_bytes_per_token * C / B

with ``P`` parameters of ``W = P * dtype_bytes`` bytes, memory bandwidth ``B`` and matmul
throughput ``F`` (both effective, not peak). For OPT-13B (P = 12.85e9, fp16) on an A100-40GB
(B = 1.3e12 B/s effective of 1.56e12 peak, F = 190e12 FLOP/s effective of 312e12 peak, overhead
1 ms of launches and scheduling): a decode step of 32 requests with 16k cached tokens takes
1 + 19.8 + 10.1 = ~31 ms, a 2048-token prefill 1 + 277 = ~280 ms. Swapping moves
``block bytes`` over PCIe at ``pcie_bandwidth`` (25e9 B/s effective), added to the step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel", "GPUSpec", "ModelSpec", "get_gpu", "get_model", "gpu_names", "model_names"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the cost model and the memory model need to know about a transformer."""

    name: str
    num_params: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_model_len: int = 2048

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """Effective (achievable, not peak) figures of one accelerator."""

    name: str
    mem_bandwidth: float  # bytes/s
    flops: float  # FLOP/s, dense fp16 matmuls
    pcie_bandwidth: float = 25e9  # bytes/s, host <-> device (swapping)
    overhead_s: float = 1e-3  # per iteration: kernel launches, scheduling, sampling


def _models() -> dict[str, ModelSpec]:
    return {
        # OPT-13B: 40 layers, hidden 5120 = 40 heads x 128 -> 800 KiB of KV per token (fp16).
        "opt-13b": ModelSpec("opt-13b", 12.85e9, 40, 40, 128),
        "opt-6.7b": ModelSpec("opt-6.7b", 6.66e9, 32, 32, 128),
        "opt-66b": ModelSpec("opt-66b", 65.7e9, 64, 72, 128),
        "llama-2-7b": ModelSpec("llama-2-7b", 6.74e9, 32, 32, 128, max_model_len=4096),
    }


def _gpus() -> dict[str, GPUSpec]:
    return {
        "a100-40gb": GPUSpec("a100-40gb", 1.3e12, 190e12),
        "a100-80gb": GPUSpec("a100-80gb", 1.7e12, 190e12),
        "h100-sxm": GPUSpec("h100-sxm", 2.8e12, 600e12),
    }


def model_names() -> list[str]:
    return sorted(_models())


def gpu_names() -> list[str]:
    return sorted(_gpus())


def get_model(name: str) -> ModelSpec:
    m = _models().get(name)
    if m is None:
        raise ValueError(f"unknown model {name!r}; use one of {model_names()}")
    return m


def get_gpu(name: str) -> GPUSpec:
    g = _gpus().get(name)
    if g is None:
        raise ValueError(f"unknown GPU {name!r}; use one of {gpu_names()}")
    return g


@dataclass(frozen=True, slots=True)
class CostModel:
    """Iteration time of ``model`` on ``gpu`` (see the module docstring for the formula)."""

    model: ModelSpec
    gpu: GPUSpec

    def iteration_time(
        self, batched_tokens: int, context_tokens: int, swapped_blocks_bytes: float = 0.0
    ) -> float:
        """Seconds for one forward pass computing ``batched_tokens`` over ``context_tokens``."""
        m, g = self.model, self.gpu
        weights = m.weight_bytes / g.mem_bandwidth
        compute = 2.0 * m.num_params * batched_tokens / g.flops
        attention = m.kv_bytes_per_token * context_tokens / g.mem_bandwidth
        swap = swapped_blocks_bytes / g.pcie_bandwidth
        return g.overhead_s + max(weights, compute) + attention + swap
