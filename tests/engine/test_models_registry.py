"""The model registry: stdlib only, one spec per Hugging Face ``model_type``, and what each spec
says about a family (shape, tensor-parallel split, GGUF layout, RoPE and sliding-window rules)
agrees with the model code and with transformers."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pagedkv.engine.distributed.communication import TPInfo
from pagedkv.engine.distributed.parallel_state import check_tensor_parallel, valid_tp_sizes
from pagedkv.engine.models import layers, registry
from pagedkv.engine.models.registry import (
    MODEL_SPECS,
    ROPE_TYPES,
    check_rope,
    get_gguf_layout,
    get_spec,
    gguf_architectures,
    load_model_class,
    supported_model_types,
)
from pagedkv.engine.weights import gguf as gguf_weights

TYPES = ("gpt2", "llama", "mistral", "opt", "qwen2")

# --------------------------------------------------------------------------- no imports


def test_registry_source_imports_the_standard_library_only():
    tree = ast.parse(Path(registry.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in the registry"
            imported.add(node.module.split(".")[0])
    assert imported, "the check found no import at all"
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_importing_the_registry_in_a_fresh_interpreter_loads_no_torch_and_no_model():
    code = (
        "import json, sys\n"
        "from pagedkv.engine.models import registry as r\n"
        "r.get_spec('qwen2').tp_split_sizes\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    modules = set(json.loads(out.strip().splitlines()[-1]))
    assert "pagedkv.engine.models.registry" in modules
    assert not {"torch", "transformers", "numpy", "pagedattn_kernels"} & modules
    engine = {m for m in modules if m.startswith("pagedkv.")}
    assert engine == {
        "pagedkv.engine",
        "pagedkv.engine.__about__",
        "pagedkv.engine.models",
        "pagedkv.engine.models.registry",
    }


# --------------------------------------------------------------------------- lookups


def test_supported_model_types_and_the_error_for_an_unknown_one():
    assert supported_model_types() == sorted(TYPES)
    for call in (get_spec, load_model_class):
        with pytest.raises(ValueError, match="unsupported model architecture 'bert'") as err:
            call("bert")
        assert all(t in str(err.value) for t in TYPES)  # says what would have worked


@pytest.mark.parametrize("model_type", TYPES)
def test_every_spec_names_a_model_class_with_the_model_interface(model_type):
    spec = get_spec(model_type)
    cls = load_model_class(model_type)
    assert cls is spec.model_class()
    assert cls.__module__ == spec.module and cls.__name__ == spec.class_name
    assert issubclass(cls, nn.Module)
    for method in ("forward", "compute_logits", "load_weights"):
        assert callable(getattr(cls, method)), method


def test_qwen2_is_its_own_model_file_on_the_llama_code():
    from pagedkv.engine.models.llama import LlamaForCausalLM

    qwen2 = load_model_class("qwen2")
    assert qwen2.__module__ == "pagedkv.engine.models.qwen2"
    assert issubclass(qwen2, LlamaForCausalLM) and qwen2 is not LlamaForCausalLM
    assert load_model_class("mistral") is LlamaForCausalLM  # Mistral: a registry line only
    source = Path(sys.modules[LlamaForCausalLM.__module__].__file__).read_text().lower()
    assert "model_type" not in source  # no family special cases left in the Llama code
    assert {get_spec(t).architecture for t in ("llama", "mistral", "qwen2")} == {"llama"}


# --------------------------------------------------------------------------- shapes and splits


def _hf_config(model_type: str, heads: int, kv_ratio: int, head_dim: int, inter: int) -> object:
    """A transformers config of the family with the given sizes (one layer)."""
    kv_heads = heads // kv_ratio
    hidden = heads * head_dim
    if model_type == "opt":
        return transformers.OPTConfig(
            vocab_size=97, hidden_size=hidden, ffn_dim=inter, num_hidden_layers=1,
            num_attention_heads=heads, max_position_embeddings=64, word_embed_proj_dim=hidden,
        )  # fmt: skip
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[model_type]
    return cls(
        vocab_size=97, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip


def _builds(model_type: str, cfg: object, tp_size: int) -> bool:
    """Whether the model code itself accepts a split ``tp_size`` ways (on the meta device)."""
    try:
        with torch.device("meta"):
            load_model_class(model_type)(cfg, tp=TPInfo(0, tp_size))
    except ValueError as exc:
        assert "tensor-parallel size" in str(exc)
        return False
    return True


@settings(max_examples=25, deadline=None)
@given(
    model_type=st.sampled_from(["llama", "mistral", "qwen2", "opt"]),
    heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    kv_ratio=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([4, 8]),
    inter=st.integers(4, 72),
)
def test_shape_and_tensor_parallel_split_agree_with_the_model_code(
    model_type, heads, kv_ratio, head_dim, inter
):
    """The registry's split sizes accept a tensor-parallel size exactly when the model's own
    layers can be split that way; its shape is the model's."""
    if heads % kv_ratio:
        kv_ratio = 1
    cfg = _hf_config(model_type, heads, kv_ratio, head_dim, inter)
    spec = get_spec(model_type)
    shape = spec.shape(cfg)
    with torch.device("meta"):
        model = load_model_class(model_type)(cfg)
    attn = model.layers[0].self_attn
    assert (shape.num_layers, shape.num_heads, shape.head_dim) == (1, heads, head_dim)
    assert (attn.num_heads, attn.head_dim, shape.intermediate_size) == (heads, head_dim, inter)
    assert shape.num_kv_heads == getattr(attn, "num_kv_heads", heads)
    config = SimpleNamespace(hf_config=cfg, name="tiny", architecture=spec.architecture)
    valid = valid_tp_sizes(config, limit=8)
    assert valid == [n for n in range(1, 9) if _builds(model_type, cfg, n)]
    for n in range(2, 9):
        if n in valid:
            check_tensor_parallel(config, n, torch.device("cpu"))
        else:
            every = valid_tp_sizes(config)  # the message lists every size, not only those <= 8
            assert every[: len(valid)] == valid
            with pytest.raises(ValueError, match=re.escape(f"use one of {every}")):
                check_tensor_parallel(config, n, torch.device("cpu"))


def test_gpt2_runs_on_one_device_only():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, n_inner=None)
    spec = get_spec("gpt2")
    assert spec.tp_split_sizes(cfg) is None
    assert spec.shape(cfg).intermediate_size == 256  # n_inner None: 4 * n_embd, as in GPT-2
    config = SimpleNamespace(hf_config=cfg, name="tiny-gpt2", architecture="gpt2")
    assert valid_tp_sizes(config) == [1]
    with pytest.raises(ValueError, match=r"supports the llama and opt families.*size 1"):
        check_tensor_parallel(config, 2, torch.device("cpu"))


# --------------------------------------------------------------------------- GGUF


def test_each_gguf_layout_leads_back_to_its_family():
    """A GGUF file's architecture picks one layout; the transformers config it builds names a
    model_type whose registry line holds that same layout."""
    assert gguf_architectures() == ["gpt2", "llama", "qwen2"]
    for arch in gguf_architectures():
        layout = get_gguf_layout(arch)
        assert layout.config_reader in gguf_weights.CONFIG_READERS
        model_type = getattr(transformers, layout.config_class).model_type
        assert get_spec(model_type).gguf is layout
    assert [s.gguf.architecture for s in MODEL_SPECS.values() if s.gguf].count("llama") == 1
    with pytest.raises(ValueError, match=r"'mamba' is not supported.*gpt2, llama, qwen2"):
        get_gguf_layout("mamba")


# --------------------------------------------------------------------------- config checks


def _rope_config(params: dict) -> SimpleNamespace:
    return SimpleNamespace(rope_parameters={"rope_theta": 10000.0, **params})


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_rope_types_the_registry_accepts_are_the_ones_the_layers_compute(rope_type):
    needed = {key: 2.0 for key in ROPE_TYPES[rope_type]}
    if rope_type == "llama3":
        needed |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}  # fmt: skip
    cfg = _rope_config({"rope_type": rope_type, **needed})
    check_rope(cfg)
    assert torch.isfinite(layers.rope_inv_freq(cfg, 16)).all()
    for key in needed:  # a missing key: the registry names it before the layers trip on it
        partial = _rope_config({"rope_type": rope_type} | {k: needed[k] for k in needed if k != key})
        with pytest.raises(ValueError, match=key):
            check_rope(partial)
        with pytest.raises((KeyError, ValueError)):
            layers.rope_inv_freq(partial, 16)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_an_unsupported_rope_type_is_refused_by_both(rope_type):
    cfg = _rope_config({"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=rope_type):
        check_rope(cfg)
    with pytest.raises(ValueError, match=rope_type):
        layers.rope_inv_freq(cfg, 16)
    v4 = SimpleNamespace(rope_scaling={"type": rope_type, "factor": 2.0}, rope_theta=1e4)
    with pytest.raises(ValueError, match=rope_type):
        check_rope(v4)  # transformers 4.x spelling


def test_sliding_window_rules_per_family():
    window = SimpleNamespace(sliding_window=64, use_sliding_window=False)
    assert get_spec("mistral").sliding_window(window) == 64
    assert get_spec("qwen2").sliding_window(window) is None  # not switched on
    window.use_sliding_window = True
    assert get_spec("qwen2").sliding_window(window) == 64
    assert get_spec("mistral").sliding_window(SimpleNamespace(sliding_window=None)) is None
    assert get_spec("llama").sliding_window(transformers.LlamaConfig()) is None
