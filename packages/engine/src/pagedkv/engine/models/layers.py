"""Layers shared by the model families: RMSNorm, rotary embedding, activations, weight copying.

Numerics follow the Hugging Face implementations (norm statistics in float32, RoPE angles in
float32) so that greedy outputs match transformers token for token.

On CUDA the norm (with the residual add fused in), SwiGLU's ``silu(gate) * up`` and the rotary
embedding run as ``pagedattn_kernels``' fused Triton kernels, which repeat the roundings of the
torch code below (see ``pagedattn_kernels.fused``); on CPU the torch code runs, unchanged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pagedattn_kernels
from pagedattn_kernels.ops import MAX_HIDDEN
from pagedkv.engine.models.quantization import Fp8Rows

# The rotary kernel and the cache write as one kernel (``RotaryAngles.apply_and_cache``); 0
# keeps them apart, the baseline a benchmark compares against.
_FUSE_ROPE_AND_CACHE = os.environ.get("PAGEDKV_FUSED_ROPE_CACHE", "1") != "0"


def fused_kernels_enabled(device: torch.device) -> bool:
    """Whether the fused Triton kernels replace the torch code for tensors on ``device``.

    The same switch as the attention kernels' (``PAGEDATTN_BACKEND``): on CUDA by default; on
    CPU only with ``PAGEDATTN_BACKEND=triton`` (Triton's interpreter: slow, for tests), since
    the torch code is the fast path there; ``PAGEDATTN_BACKEND=torch`` runs the unfused torch
    code on a GPU too (the baseline to compare against). ``PAGEDKV_FUSED_OPS=0`` turns off
    only these elementwise kernels and keeps the Triton attention.
    """
    if os.environ.get("PAGEDKV_FUSED_OPS", "1") == "0":
        return False
    return pagedattn_kernels.resolve_backend(device, None) == "triton"


class RMSNorm(nn.Module):
    """Root-mean-square norm: statistics in float32, result cast back, then scaled.

    ``norm(x)`` returns the normed ``x``. ``norm(x, residual)`` is a pre-norm decoder's
    residual step: it returns ``(norm(x + residual), x + residual)``. With the fused kernels
    that is one pass which writes its two results *into* ``x`` and ``residual`` (the caller
    hands both over and uses only the returned tensors), so a decoder layer allocates nothing
    for its norms.

    ``fp8_out`` (set when the linear layer it feeds holds fp8 weights): with the fused kernels
    the normed rows come back quantized per token (``Fp8Rows``, see ``models/quantization``),
    the residual as before.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fp8_out = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Rows | tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        fused = (
            fused_kernels_enabled(x.device)
            and self.weight.dtype == x.dtype
            and x.shape[-1] <= MAX_HIDDEN
        )
        if fused and self.fp8_out:
            if residual is None:
                return Fp8Rows(*pagedattn_kernels.rms_norm_fp8(x, self.weight, self.eps), x.dtype)
            q, scale, residual = pagedattn_kernels.fused_add_rms_norm_fp8(
                x, residual, self.weight, self.eps, residual_out=residual
            )
            return Fp8Rows(q, scale, x.dtype), residual
        if residual is None:
            if fused:
                return pagedattn_kernels.rms_norm(x, self.weight, self.eps)
            return self._norm(x)
        if fused:
            return pagedattn_kernels.fused_add_rms_norm(
                x, residual, self.weight, self.eps, out=x, residual_out=residual
            )
        residual = x + residual
        return self._norm(residual), residual


def silu_and_mul(x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Rows:
    """SwiGLU's activation on a fused gate/up projection output ``[T, 2 * I]``:
    ``silu(gate) * up`` (one fused kernel where :func:`fused_kernels_enabled`; with
    ``fp8_out``, quantized per token by the fused op for an fp8 down projection: on an H200
    as fast as the plain kernel and a separate quantization or faster, from 16 rows to 1,024:
    ``pagedattn_kernels.fused.triton_launch.silu_and_mul`` has the timings)."""
    if fused_kernels_enabled(x.device):
        if fp8_out and x.shape[-1] // 2 <= MAX_HIDDEN:
            return Fp8Rows(*pagedattn_kernels.silu_and_mul_fp8(x), x.dtype)
        return pagedattn_kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# SwiGLU's gate/up matmul and activation as one kernel for decode batches
# (``gate_up_silu_and_mul``); 0 keeps them apart, the baseline a benchmark compares against.
_FUSE_GATE_UP_SILU = os.environ.get("PAGEDKV_FUSED_GATE_UP_SILU", "1") != "0"


def gate_up_silu_and_mul(gate_up: nn.Module, x: torch.Tensor | Fp8Rows,
                         fp8_out: bool = False) -> torch.Tensor | Fp8Rows:  # fmt: skip
    """SwiGLU's fused gate/up projection and activation: ``silu_and_mul(gate_up(x), fp8_out)``.

    Where the fused kernels run and the projection's rows go to a streaming matmul kernel
    (decode batches on a GPU: ``ColumnParallelLinear.silu_and_mul_in_kernel``), the
    activation is made in that kernel's epilogue: each program multiplies the gate and up rows
    of the same products, so the projection (twice the activation's size) is never stored
    and the activation kernel is not launched, one kernel fewer a layer in a step of dozens of
    short ones. The values are the two ops' (the matmul's rounding, then the activation's)."""
    if _FUSE_GATE_UP_SILU and fused_kernels_enabled(_device_of(x)):
        in_kernel = getattr(gate_up, "silu_and_mul_in_kernel", None)
        out = in_kernel(x, fp8_out) if in_kernel is not None else None
        if out is not None:
            return out
    return silu_and_mul(gate_up(x), fp8_out)


def _device_of(x: torch.Tensor | Fp8Rows) -> torch.device:
    return x.q.device if isinstance(x, Fp8Rows) else x.device


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation function by its Hugging Face config name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None


# --------------------------------------------------------------------------- rotary embedding


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings as one dict with ``rope_type`` and ``rope_theta``, whatever the
    transformers version (v5 ``rope_parameters`` or v4 ``rope_theta`` + ``rope_scaling``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU) for the config's RoPE type.

    Supported: ``default``, ``linear`` (positions divided by ``factor``) and ``llama3``
    (Llama 3.1's smooth per-frequency scaling). Other types raise ``ValueError``.
    """
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise ValueError(
        f"unsupported rope type {rope_type!r} in the model config; supported: default, linear, llama3"
    )


def _llama3_scale(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a linear blend
    (in 1/wavelength) in between."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_between, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" (GPT-NeoX / Hugging Face) layout.

    The angles are computed from the positions at each step (a [T, head_dim] product, cheap next
    to the projections), so any position up to ``max_model_len`` works without a table.
    """

    def __init__(self, head_dim: int, inv_freq: torch.Tensor):
        super().__init__()
        self.head_dim = head_dim
        self._host_inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.register_buffer("inv_freq", self._host_inv_freq.clone(), persistent=False)

    def init_buffers(self) -> None:
        """Refill ``inv_freq`` (in float32 whatever the model dtype) after the module was
        materialized from the meta device or cast."""
        self.inv_freq = self._host_inv_freq.to(self.inv_freq.device)

    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency factors (a GGUF ``rope_freqs`` tensor, which
        is how llama.cpp stores Llama 3.1's RoPE scaling)."""
        factors = factors.detach().to("cpu", torch.float32).reshape(-1)
        if factors.numel() != self._host_inv_freq.numel():
            raise ValueError(
                f"rope_freqs has {factors.numel()} entries, expected {self._host_inv_freq.numel()}"
            )
        self._host_inv_freq = self._host_inv_freq / factors
        self.init_buffers()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin [T, 1, head_dim] for broadcasting over heads."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """This step's rotation, prepared once per forward pass for every layer: the cos/sin
        tables, or (fused kernels) just the positions, from which the kernel computes them."""
        if fused_kernels_enabled(positions.device):
            return RotaryAngles(positions, self.inv_freq)
        cos, sin = self.cos_sin(positions, dtype)
        return RotaryAngles(positions, self.inv_freq, cos, sin)


@dataclass(slots=True)
class RotaryAngles:
    """One step's rotary angles (see :meth:`RotaryEmbedding.prepare`)."""

    positions: torch.Tensor  # [T]
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    cos: torch.Tensor | None = None  # [T, 1, head_dim] in the model dtype; None: fused kernel
    sin: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, heads, head_dim]`` and ``k [T, kv_heads, head_dim]`` rotated (the fused
        kernel rotates them in place, e.g. inside the QKV projection's output)."""
        if self.cos is None:
            pagedattn_kernels.rotary_embedding(self.positions, q, k, self.inv_freq)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def apply_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        **scales: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`apply`, then the rotated keys and the values written into their cache slots
        (``reshape_and_cache``): what attention does to a step's new tokens. With the fused
        kernels both happen in one kernel (``rotary_embedding_and_cache``): the same values,
        one launch fewer per layer (``PAGEDKV_FUSED_ROPE_CACHE=0``: two kernels, as before)."""
        key_cache, value_cache = kv_cache
        if self.cos is None and _FUSE_ROPE_AND_CACHE:
            pagedattn_kernels.rotary_embedding_and_cache(
                self.positions, q, k, v, self.inv_freq, key_cache, value_cache, slot_mapping,
                **scales,
            )  # fmt: skip
            return q, k
        q, k = self.apply(q, k)
        pagedattn_kernels.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, **scales)
        return q, k


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the angles ``cos``/``sin [T, 1, head_dim]``."""
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- weight loading


def copy_weight(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (converting dtype and device), shape-checked."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}: "
            "the checkpoint does not match its config"
        )
    with torch.no_grad():
        param.copy_(tensor)


def check_all_loaded(model: nn.Module, loaded: set[str], optional: set[str] = frozenset()) -> None:
    """Raise ``ValueError`` listing parameters the checkpoint did not provide."""
    missing = sorted(
        n for n, _ in model.named_parameters() if n not in loaded and n not in optional
    )
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of the model: {shown}")
