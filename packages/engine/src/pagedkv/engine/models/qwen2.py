"""Qwen2: the Llama decoder with a bias on the Q, K and V projections and none on the output.

Everything else (RMSNorm, RoPE, SwiGLU, grouped-query attention, loading with fused Q/K/V and
gate/up, tensor parallelism) is the Llama code. What the engine needs to know outside the model
is Qwen2's entry in ``models/registry.py``: its shape and tensor-parallel split are Llama's, its
GGUF files say ``qwen2`` and are not RoPE-permuted, and its ``sliding_window`` only applies when
``use_sliding_window`` is set (the paged kernels attend to the whole context, so the config then
limits ``max_model_len`` to the window).
"""

from __future__ import annotations

from typing import Any

from pagedkv.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM over a packed batch with a paged KV cache (Llama's interface)."""

    @staticmethod
    def attention_bias(cfg: Any) -> tuple[bool, bool]:
        return True, False
