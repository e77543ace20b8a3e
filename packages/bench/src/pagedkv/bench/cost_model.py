"""The simulator's iteration time: a roofline from a GPU's *published* peaks, scaled by
*measured* efficiencies. Nothing here is fitted to the PagedAttention paper's results.

Why this shape: the simulator compares memory policies under one model of time, so what must
be right is how time grows with the batch: a decode step is bound by reading the weights, so
batching more requests is almost free until the step gets compute-bound, and attention reads
every cached KV token of the batch. One iteration that computes ``T`` tokens (prefill chunks +
decodes) over ``C`` context tokens in all takes

    t = (max(W / B, 2 * P * T / F) + kv_bytes_per_token * C / B) / eta  +  swapped_bytes / PCIe

with ``P`` parameters of ``W = P * dtype_bytes`` bytes, and

* ``B = bandwidth_efficiency * peak_bandwidth`` and ``F = flops_efficiency * peak_flops``: the
  GPU's published peaks (A100-40GB: 1,555 GB/s HBM2 and 312 TFLOP/s dense fp16/bf16, NVIDIA's
  A100 datasheet) times the fractions a large copy and a large matmul reach. Those fractions
  were measured on our H200 (`docs/performance/throughput_opt13b_sharegpt.json`: 4,244 GB/s of
  4,800 = 0.884, 792 TFLOP/s of 989 = 0.80) and are assumed to carry over to the A100 as
  fractions of its peaks (NVIDIA quotes ~80-90% achievable for both on every recent part).
* ``eta``: how close a whole engine step gets to that bound (host time, kernels below peak,
  small ops): measured on the H200 for our engine on OPT-13B's shape
  (same file: ``decode_roofline_frac`` 0.746 for decode-only steps, ``mixed_roofline_frac``
  0.573 for steps with prefill tokens). Both include the host time between steps, so there is
  no separate per-step overhead.
* ``PCIe``: 25 GB/s host <-> device for swapping (PCIe 4.0 x16, 31.5 GB/s per direction
  peak, at 80%; an assumption, not a measurement).

With these, OPT-13B (P = 12.85e9, fp16) on an A100-40GB: a decode step of 32 requests over 16k
cached tokens takes (18.6 + 9.5) / 0.746 = ~38 ms, a 2048-token prefill 211 / 0.573 = ~368 ms.
The paper's own system (vLLM 0.1, PyTorch eager, no CUDA graphs) had its own efficiencies; the
paper publishes none as a fraction of peak (its kernel microbenchmark, Fig. 18a, puts its paged
attention kernel 20-26% above FasterTransformer's), which is why measured fractions stand in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel", "GPUSpec", "ModelSpec", "get_gpu", "get_model", "gpu_names", "model_names"]

# Measured on one H200 (docs/performance/throughput_opt13b_sharegpt.json, kernels.json).
_BANDWIDTH_EFFICIENCY = 4244.0 / 4800.0  # device copy, of the 4.8 TB/s peak
_FLOPS_EFFICIENCY = 792.0 / 989.0  # 8192^3 bf16 matmul, of the 989 TFLOP/s dense peak
_DECODE_STEP_EFFICIENCY = 0.746  # decode-only engine steps, OPT-13B shape
_MIXED_STEP_EFFICIENCY = 0.573  # steps with prefill tokens, OPT-13B shape


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
    """One accelerator: published peaks, and the measured fractions of them that count."""

    name: str
    peak_mem_bandwidth: float  # bytes/s, datasheet
    peak_flops: float  # FLOP/s, dense fp16/bf16 tensor cores, datasheet
    source: str = ""
    bandwidth_efficiency: float = _BANDWIDTH_EFFICIENCY
    flops_efficiency: float = _FLOPS_EFFICIENCY
    decode_step_efficiency: float = _DECODE_STEP_EFFICIENCY
    mixed_step_efficiency: float = _MIXED_STEP_EFFICIENCY
    pcie_bandwidth: float = 25e9  # bytes/s, host <-> device (swapping)

    @property
    def mem_bandwidth(self) -> float:
        """Achievable bytes/s (peak x measured copy efficiency)."""
        return self.peak_mem_bandwidth * self.bandwidth_efficiency

    @property
    def flops(self) -> float:
        """Achievable FLOP/s (peak x measured matmul efficiency)."""
        return self.peak_flops * self.flops_efficiency


def _models() -> dict[str, ModelSpec]:
    return {
        # OPT-13B: 40 layers, hidden 5120 = 40 heads x 128 -> 800 KiB of KV per token (fp16).
        "opt-13b": ModelSpec("opt-13b", 12.85e9, 40, 40, 128),
        "opt-6.7b": ModelSpec("opt-6.7b", 6.66e9, 32, 32, 128),
        "opt-66b": ModelSpec("opt-66b", 65.7e9, 64, 72, 128),
        "llama-2-7b": ModelSpec("llama-2-7b", 6.74e9, 32, 32, 128, max_model_len=4096),
        # Llama-3-8B: 32 layers, 8 KV heads x 128 (GQA) -> 128 KiB per token (bf16).
        "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 32, 8, 128, max_model_len=8192),
    }


def _gpus() -> dict[str, GPUSpec]:
    return {
        "a100-40gb": GPUSpec("a100-40gb", 1555e9, 312e12, "NVIDIA A100 datasheet (SXM4 40GB)"),
        "a100-80gb": GPUSpec("a100-80gb", 2039e9, 312e12, "NVIDIA A100 datasheet (SXM4 80GB)"),
        "h100-sxm": GPUSpec("h100-sxm", 3350e9, 989e12, "NVIDIA H100 datasheet (SXM5)"),
        "h200": GPUSpec("h200", 4800e9, 989e12, "NVIDIA H200 datasheet (SXM)"),
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

    def roofline(self, batched_tokens: int, context_tokens: int) -> float:
        """The bound: seconds to read the weights (or do the matmuls) and read the KV."""
        m, g = self.model, self.gpu
        weights = m.weight_bytes / g.mem_bandwidth
        compute = 2.0 * m.num_params * batched_tokens / g.flops
        attention = m.kv_bytes_per_token * context_tokens / g.mem_bandwidth
        return max(weights, compute) + attention

    def iteration_time(
        self,
        batched_tokens: int,
        context_tokens: int,
        swapped_blocks_bytes: float = 0.0,
        *,
        prefill: bool | None = None,
    ) -> float:
        """Seconds for one step computing ``batched_tokens`` over ``context_tokens``.

        ``prefill``: whether the step computes prompt tokens (such steps reach a smaller
        fraction of the bound); ``None`` treats a one-token step as decode and a larger one as
        mixed, since a batch of decodes cannot be told from a prompt by its token count alone.
        """
        g = self.gpu
        mixed = prefill if prefill is not None else batched_tokens > 1
        eta = g.mixed_step_efficiency if mixed else g.decode_step_efficiency
        swap = swapped_blocks_bytes / g.pcie_bandwidth
        return self.roofline(batched_tokens, context_tokens) / eta + swap
