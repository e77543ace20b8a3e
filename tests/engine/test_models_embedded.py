"""The embedded SmolLM2-135M-Instruct GGUF: our loader and model against transformers' own GGUF
loading (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``) of the same file."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.model_loader import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]
GREEDY_PROMPTS = PROMPTS[:2]
NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("single_thread")


def test_config_matches_transformers_reading_of_the_gguf(embedded_model_config, hf_embedded_model):
    ours, theirs = embedded_model_config, hf_embedded_model.config
    assert ours.architecture == "llama" and ours.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (30, 9, 3, 64)
    assert (ours.hidden_size, ours.vocab_size, ours.max_model_len) == (576, 49152, 8192)
    assert ours.eos_token_ids == {2} and ours.bos_token_id == 1
    assert ours.dtype == torch.float32  # "auto" on CPU
    assert ours.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours.hf_config, key) == getattr(theirs, key), key
    assert ours.hf_config.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.hf_config.rope_parameters == theirs.rope_parameters


def test_dequantized_weights_equal_transformers(embedded_model, hf_embedded_model):
    """Same numbers in the same places: in particular Q and K un-permuted from llama.cpp's
    RoPE layout exactly as transformers does it."""
    hf = hf_embedded_model.model
    q, kv = 9 * 64, 3 * 64
    for i in (0, 17, 29):
        ours, theirs = embedded_model.layers[i], hf.layers[i]
        qkv = ours.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:q], theirs.self_attn.q_proj.weight)
        assert torch.equal(qkv[q : q + kv], theirs.self_attn.k_proj.weight)
        assert torch.equal(qkv[q + kv :], theirs.self_attn.v_proj.weight)
        gate_up = ours.mlp.gate_up_proj.weight
        assert torch.equal(gate_up[:1536], theirs.mlp.gate_proj.weight)
        assert torch.equal(gate_up[1536:], theirs.mlp.up_proj.weight)
        assert torch.equal(ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(ours.input_layernorm.weight, theirs.input_layernorm.weight)
    assert torch.equal(embedded_model.embed_tokens.weight, hf.embed_tokens.weight)
    assert torch.equal(embedded_model.norm.weight, hf.norm.weight)
    assert embedded_model.lm_head is None  # tied, as in the file


def test_prompt_logits_close_to_transformers(
    embedded_model, embedded_model_config, embedded_tokenizer, hf_embedded_model, paged_generate
):
    prompts = [embedded_tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = paged_generate(embedded_model, embedded_model_config, prompts, 1, block_size=16)
    with torch.inference_mode():
        for ids, row in zip(prompts, ours.logits):
            ref = hf_embedded_model(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(row[0], ref, atol=2e-4, rtol=0)


@pytest.mark.slow
def test_greedy_32_tokens_identical_to_transformers(
    embedded_model,
    embedded_model_config,
    embedded_tokenizer,
    hf_embedded_model,
    paged_generate,
    hf_generate,
):
    prompts = [embedded_tokenizer(p)["input_ids"] for p in GREEDY_PROMPTS]
    ours = paged_generate(embedded_model, embedded_model_config, prompts, NEW_TOKENS, block_size=16)
    ref = hf_generate(hf_embedded_model, prompts, NEW_TOKENS)
    assert ours.tokens == ref.tokens
    for mine, theirs in zip(ours.logits, ref.logits):
        torch.testing.assert_close(torch.stack(mine), torch.stack(theirs), atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_greedy_identical_to_transformers_on_cuda(
    embedded_model_config, embedded_tokenizer, hf_embedded_model, paged_generate, hf_generate
):
    model = load_model(embedded_model_config, device="cuda", dtype=torch.float32)
    prompts = [embedded_tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = paged_generate(
        model, embedded_model_config, prompts, NEW_TOKENS, block_size=16, device="cuda"
    )
    ref = hf_generate(hf_embedded_model, prompts, NEW_TOKENS)
    assert ours.tokens == ref.tokens


@pytest.mark.gpu
def test_bf16_on_cuda_agrees_with_float32(
    embedded_model, embedded_model_config, embedded_tokenizer, paged_generate
):
    model = load_model(embedded_model_config, device="cuda", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = [embedded_tokenizer(p)["input_ids"] for p in PROMPTS]
    fp32 = paged_generate(embedded_model, embedded_model_config, prompts, 1, block_size=16)
    bf16 = paged_generate(model, embedded_model_config, prompts, 1, block_size=16, device="cuda")
    for a, b in zip(fp32.logits, bf16.logits):
        assert int(a[0].argmax()) == int(b[0].argmax())
        # bf16 keeps ~3 significant digits; logits of this model span about +-30
        assert (a[0] - b[0]).abs().max() < 1.0
