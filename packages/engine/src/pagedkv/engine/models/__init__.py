"""Model families pagedkv implements, and which Hugging Face ``model_type`` maps to which.

Every model class has the same interface: ``__init__(hf_config)``,
``forward(input_ids, positions, kv_caches, meta) -> hidden``, ``compute_logits(hidden)`` (float32)
and ``load_weights(iterable of (Hugging Face name, tensor))``.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

# Hugging Face model_type -> our architecture (one implementation per family)
MODEL_TYPE_TO_ARCHITECTURE = MappingProxyType(
    {
        "llama": "llama",
        "mistral": "llama",
        "qwen2": "llama",
        "opt": "opt",
        "gpt2": "gpt2",
    }
)

ARCHITECTURES = ("llama", "opt", "gpt2")


def architecture_for(model_type: str) -> str:
    """Our architecture for a Hugging Face ``model_type``; ``ValueError`` naming it if unsupported."""
    try:
        return MODEL_TYPE_TO_ARCHITECTURE[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {model_type!r}; supported model types: "
            f"{', '.join(sorted(MODEL_TYPE_TO_ARCHITECTURE))}"
        ) from None


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class of one of :data:`ARCHITECTURES` (imported on demand)."""
    if architecture == "llama":
        from pagedkv.engine.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if architecture == "opt":
        from pagedkv.engine.models.opt import OPTForCausalLM

        return OPTForCausalLM
    if architecture == "gpt2":
        from pagedkv.engine.models.gpt2 import GPT2LMHeadModel

        return GPT2LMHeadModel
    raise ValueError(f"unknown architecture {architecture!r}; expected one of {ARCHITECTURES}")


__all__ = ["ARCHITECTURES", "MODEL_TYPE_TO_ARCHITECTURE", "architecture_for", "get_model_class"]
