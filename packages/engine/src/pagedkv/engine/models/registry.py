"""The model families pagedkv runs: one entry per Hugging Face ``model_type``.

Each entry is a :class:`ModelSpec`: which module and class implement the family (imported by name,
only when a model is built), and what the rest of the engine must know about it without
importing torch or any model code: the model's shape from its Hugging Face config, the sizes
tensor parallelism splits, how its GGUF files name things, and the config checks (RoPE type,
sliding window) that decide before anything is loaded whether pagedkv can run it.

This module imports the standard library only. ``config.py``, ``distributed/parallel_state.py``,
``weights/gguf.py`` and ``model_loader.py`` ask it; the model modules never import it. So the
registry sits below every engine module and no import circle runs through it.

Adding a family: write ``models/<family>.py`` (a class with ``__init__(hf_config, tp=None)``,
``forward``, ``compute_logits`` and ``load_weights``; a Llama-like family subclasses
``LlamaForCausalLM``) and add its entry to :data:`MODEL_SPECS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a whole model (before any tensor-parallel split), read from its config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int  # the longest context its position encoding was trained for


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    """How llama.cpp's GGUF files of one ``general.architecture`` store a family.

    ``config_reader`` names the function of ``weights/gguf.py`` that turns the metadata into the
    keyword arguments of the transformers config class ``config_class``. Tensor names map to
    Hugging Face names: ``blk.{i}.{kind}.{suffix}`` to
    ``{block_prefix}.{i}.{block_names[kind]}.{suffix}``, ``{kind}.{suffix}`` to
    ``{global_names[kind]}.{suffix}`` (``suffix``: ``weight`` or ``bias``).
    """

    architecture: str
    config_class: str
    config_reader: str
    block_prefix: str
    block_names: Mapping[str, str]
    global_names: Mapping[str, str]
    rope_permuted: bool = False  # Q/K rows reordered for llama.cpp's interleaved RoPE
    transposed: tuple[str, ...] = ()  # kinds stored [out, in] where Hugging Face has [in, out]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the engine knows about one family outside its model file.

    ``architecture`` is the implementation family (``ModelConfig.architecture``): Mistral and
    Qwen2 run the Llama code, so they are ``"llama"`` too. ``tp_split`` pairs each size that
    tensor parallelism splits (by its Hugging Face config name) with the :class:`ModelShape`
    field holding it; ``None`` means the family runs on one device only.
    ``sliding_window_switch`` names the config flag without which a ``sliding_window`` value is
    ignored (Qwen2's ``use_sliding_window``); ``None``: the value alone decides.
    """

    architecture: str
    module: str
    class_name: str
    shape: Callable[[Any], ModelShape]
    tp_split: tuple[tuple[str, str], ...] | None = None
    gguf: GGUFLayout | None = None
    check: Callable[[Any], None] | None = None
    sliding_window_switch: str | None = None

    def model_class(self) -> type:
        """The model class, importing its module now."""
        return getattr(importlib.import_module(self.module), self.class_name)

    def tp_split_sizes(self, hf_config: Any) -> dict[str, int] | None:
        """The sizes tensor parallelism splits, by config name (each must divide by the size);
        None when the family does not support tensor parallelism."""
        if self.tp_split is None:
            return None
        shape = self.shape(hf_config)
        return {name: getattr(shape, field) for name, field in self.tp_split}

    def sliding_window(self, hf_config: Any) -> int | None:
        """The attention window the model was trained with, or None for full attention."""
        window = getattr(hf_config, "sliding_window", None)
        if self.sliding_window_switch is not None and not getattr(
            hf_config, self.sliding_window_switch, False
        ):
            return None
        return int(window) if window else None

    def validate(self, hf_config: Any) -> None:
        """Raise ``ValueError`` for a config this family's code cannot run (e.g. a RoPE type)."""
        if self.check is not None:
            self.check(hf_config)


# --------------------------------------------------------------------------- shapes


def _decoder_shape(cfg: Any) -> ModelShape:
    """Llama-style configs (Llama, Mistral, Qwen2): optional GQA and explicit head_dim."""
    heads = cfg.num_attention_heads
    return ModelShape(
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings,
    )


def _opt_shape(cfg: Any) -> ModelShape:
    heads = cfg.num_attention_heads
    return ModelShape(
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=cfg.hidden_size // heads,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings,
    )


def _gpt2_shape(cfg: Any) -> ModelShape:
    heads = cfg.n_head
    return ModelShape(
        num_layers=cfg.n_layer,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=cfg.n_embd // heads,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.n_inner or 4 * cfg.n_embd,
        vocab_size=cfg.vocab_size,
        max_positions=cfg.n_positions,
    )


# --------------------------------------------------------------------------- checks

# RoPE types the Llama code implements (models/layers.py, rope_inv_freq), with the config keys
# each one reads.
ROPE_TYPES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "default": (),
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }
)


def rope_settings(hf_config: Any) -> Mapping[str, Any]:
    """The config's RoPE settings with ``rope_type`` filled in, whatever the transformers version
    (v5 ``rope_parameters``, v4 ``rope_scaling``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not (isinstance(params, Mapping) and params):
        params = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return {**params, "rope_type": rope_type}


def check_rope(hf_config: Any) -> None:
    """Raise ``ValueError`` unless the RoPE type is one the Llama code implements, with the
    keys it needs."""
    params = rope_settings(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} in the model config; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    missing = [key for key in ROPE_TYPES[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(
            f"rope type {rope_type!r} in the model config lacks {', '.join(missing)}; "
            "fix the config's rope_scaling / rope_parameters"
        )


# --------------------------------------------------------------------------- GGUF layouts

_LLAMA_GGUF_BLOCK = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
_LLAMA_GGUF_GLOBAL = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)


def _llama_like_gguf(architecture: str, config_class: str, *, rope_permuted: bool) -> GGUFLayout:
    """GGUF files of a Llama-style decoder (llama.cpp's tensor names are shared)."""
    return GGUFLayout(
        architecture=architecture,
        config_class=config_class,
        config_reader="decoder_config",
        block_prefix="model.layers",
        block_names=_LLAMA_GGUF_BLOCK,
        global_names=_LLAMA_GGUF_GLOBAL,
        rope_permuted=rope_permuted,
    )


_GPT2_GGUF = GGUFLayout(
    architecture="gpt2",
    config_class="GPT2Config",
    config_reader="gpt2_config",
    block_prefix="transformer.h",
    block_names=MappingProxyType(
        {
            "attn_norm": "ln_1",
            "attn_qkv": "attn.c_attn",
            "attn_output": "attn.c_proj",
            "ffn_norm": "ln_2",
            "ffn_up": "mlp.c_fc",
            "ffn_down": "mlp.c_proj",
        }
    ),
    global_names=MappingProxyType(
        {
            "token_embd": "transformer.wte",
            "position_embd": "transformer.wpe",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        }
    ),
    transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
)

# --------------------------------------------------------------------------- the table

_DECODER_TP = (
    ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"),
    ("intermediate_size", "intermediate_size"),
)
_OPT_TP = (("num_attention_heads", "num_heads"), ("ffn_dim", "intermediate_size"))
_LLAMA_GGUF = _llama_like_gguf("llama", "LlamaConfig", rope_permuted=True)
_QWEN2_GGUF = _llama_like_gguf("qwen2", "Qwen2Config", rope_permuted=False)

# Hugging Face model_type -> spec, one entry per family. llama.cpp writes Mistral models as GGUF
# "llama" files, which run as "llama".
MODEL_SPECS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "llama": ModelSpec(
            "llama", "pagedkv.engine.models.llama", "LlamaForCausalLM", _decoder_shape,
            tp_split=_DECODER_TP, gguf=_LLAMA_GGUF, check=check_rope,
        ),
        "mistral": ModelSpec(
            "llama", "pagedkv.engine.models.llama", "LlamaForCausalLM", _decoder_shape,
            tp_split=_DECODER_TP, check=check_rope,
        ),
        "qwen2": ModelSpec(
            "llama", "pagedkv.engine.models.qwen2", "Qwen2ForCausalLM", _decoder_shape,
            tp_split=_DECODER_TP, gguf=_QWEN2_GGUF, check=check_rope,
            sliding_window_switch="use_sliding_window",
        ),
        "opt": ModelSpec(
            "opt", "pagedkv.engine.models.opt", "OPTForCausalLM", _opt_shape, tp_split=_OPT_TP,
        ),
        "gpt2": ModelSpec(
            "gpt2", "pagedkv.engine.models.gpt2", "GPT2LMHeadModel", _gpt2_shape, gguf=_GPT2_GGUF,
        ),
    }
)  # fmt: skip

# --------------------------------------------------------------------------- lookups


def supported_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values pagedkv runs, sorted."""
    return sorted(MODEL_SPECS)


def get_spec(model_type: str) -> ModelSpec:
    """The spec of a Hugging Face ``model_type``; ``ValueError`` listing the supported ones."""
    try:
        return MODEL_SPECS[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None


def load_model_class(model_type: str) -> type:
    """The model class of a Hugging Face ``model_type`` (its module is imported now)."""
    return get_spec(model_type).model_class()


def gguf_architectures() -> list[str]:
    """The GGUF ``general.architecture`` values pagedkv reads, sorted."""
    return sorted(s.gguf.architecture for s in MODEL_SPECS.values() if s.gguf is not None)


def get_gguf_layout(architecture: str) -> GGUFLayout:
    """The layout of GGUF files saying ``general.architecture = architecture``; ``ValueError``
    listing the supported ones."""
    for spec in MODEL_SPECS.values():
        if spec.gguf is not None and spec.gguf.architecture == architecture:
            return spec.gguf
    raise ValueError(
        f"GGUF architecture {architecture!r} is not supported; supported GGUF architectures: "
        f"{', '.join(gguf_architectures())}"
    )


def tensor_parallel_architectures() -> list[str]:
    """The families (``ModelSpec.architecture``) that can be split over several devices."""
    return sorted({s.architecture for s in MODEL_SPECS.values() if s.tp_split is not None})


__all__ = [
    "MODEL_SPECS",
    "ROPE_TYPES",
    "GGUFLayout",
    "ModelShape",
    "ModelSpec",
    "check_rope",
    "get_gguf_layout",
    "get_spec",
    "gguf_architectures",
    "load_model_class",
    "rope_settings",
    "supported_model_types",
    "tensor_parallel_architectures",
]
