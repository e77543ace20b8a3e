"""Qwen2, the family added as one model file (``models/qwen2.py``) plus one registry entry:
safetensors checkpoints written by transformers' own ``Qwen2ForCausalLM`` against transformers,
dummy weights of a config alone, and its sliding-window rule. (Tensor parallelism:
``test_tensor_parallel.py``; GGUF: ``test_weights_loading.py``.)"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models.qwen2 import Qwen2ForCausalLM

NEW_TOKENS = 16
ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("single_thread")


def _qwen2_config(**overrides) -> transformers.Qwen2Config:
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Qwen2Config(**(kwargs | overrides))


def _write_checkpoint(folder, cfg, seed):
    """A random-weight ``transformers.Qwen2ForCausalLM`` saved as safetensors; biases and norm
    scales random too, so that every weight reaches the outputs."""
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if p.ndim == 1 and not name.endswith("bias") else noise)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    return folder, _write_checkpoint(folder, _qwen2_config(), seed=2)


def test_registry_resolves_qwen2_to_its_own_model_file(qwen2_checkpoint):
    folder, hf_model = qwen2_checkpoint
    config = ModelConfig.from_model(folder, device="cpu")
    assert (config.model_type, config.architecture, config.spec.module) == (
        "qwen2",
        "llama",
        "pagedkv.engine.models.qwen2",
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.sliding_window is None and config.max_model_len == 256
    model = load_model(config, device="cpu")
    assert type(model) is Qwen2ForCausalLM
    hf_attn = hf_model.model.layers[1].self_attn
    attn = model.layers[1].self_attn
    # bias on Q, K and V (fused, in that order), none on the output projection
    expected = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(attn.qkv_proj.bias, expected)
    assert attn.o_proj.bias is None and hf_attn.o_proj.bias is None
    assert model.layers[1].mlp.gate_up_proj.bias is None


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_safetensors_greedy_tokens_and_logits_match_transformers(
    qwen2_checkpoint, tiny_prompts, paged_generate, hf_generate, prefill_chunk
):
    folder, hf_model = qwen2_checkpoint
    config = ModelConfig.from_model(folder, device="cpu")
    model = load_model(config, device="cpu")
    ours = paged_generate(
        model, config, tiny_prompts, NEW_TOKENS, prefill_chunk=prefill_chunk, block_size=3
    )
    ref = hf_generate(hf_model, tiny_prompts, NEW_TOKENS)
    assert ours.tokens == ref.tokens
    for mine, theirs in zip(ours.logits, ref.logits, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert len({t for seq in ours.tokens for t in seq}) > 10  # not a collapsed model
    if prefill_chunk is not None:
        assert ours.mixed_steps >= 3


def test_dummy_weights_from_a_config_alone(tmp_path, tiny_prompts, paged_generate):
    cfg = _qwen2_config()
    cfg.save_pretrained(tmp_path)  # config.json only: no weights
    config = ModelConfig.from_model(tmp_path, load_format="dummy", device="cpu")
    a = load_model(config, device="cpu", seed=5)
    b = load_model(config, device="cpu", seed=5)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert torch.equal(a.layers[0].self_attn.qkv_proj.bias, torch.zeros(64 + 2 * 32))
    with torch.device("meta"):
        hf = transformers.Qwen2ForCausalLM(cfg)
    # the same parameters as transformers' Qwen2 (ours fuses Q/K/V and gate/up)
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in hf.parameters())
    out = paged_generate(a, config, tiny_prompts, 4)
    assert all(torch.isfinite(row).all() for rows in out.logits for row in rows)


def test_sliding_window_applies_only_when_switched_on(
    tmp_path, tiny_prompts, paged_generate, hf_generate, caplog
):
    """``use_sliding_window`` off: the window value is ignored. On: the default context stops
    at the window, within which full attention is exact (checked against transformers, whose
    second layer here attends through the window)."""
    off = tmp_path / "off"
    _qwen2_config(use_sliding_window=False, sliding_window=64).save_pretrained(off)
    config = ModelConfig.from_model(off, load_format="dummy", device="cpu")
    assert (config.sliding_window, config.max_model_len) == (None, 256)
    on = tmp_path / "on"
    cfg = _qwen2_config(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    hf_model = _write_checkpoint(on, cfg, seed=3)
    with caplog.at_level(logging.WARNING):
        config = ModelConfig.from_model(on, device="cpu")
    assert (config.sliding_window, config.max_model_len) == (64, 64)
    assert "sliding-window" in caplog.text
    model = load_model(config, device="cpu")
    assert max(map(len, tiny_prompts)) + NEW_TOKENS <= 64
    ours = paged_generate(model, config, tiny_prompts, NEW_TOKENS)
    assert ours.tokens == hf_generate(hf_model, tiny_prompts, NEW_TOKENS).tokens
