"""Our model code against transformers on small random-weight models of every supported family.

Each checkpoint is built by transformers with random weights, saved as safetensors, and loaded
with our loader; generation runs through the paged KV cache with scattered blocks. The
reference decodes greedily with transformers, recomputing the full sequence each step.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model

NEW_TOKENS = 16
ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("single_thread")


def _load(ckpt, device="cpu", dtype=torch.float32):
    config = ModelConfig.from_model(ckpt.folder, device=device)
    return config, load_model(config, device=device, dtype=dtype)


def _assert_same_generation(ours, ref):
    assert ours.tokens == ref.tokens
    for mine, theirs in zip(ours.logits, ref.logits):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_greedy_tokens_and_logits_match_transformers(
    tiny_model_name, tiny_checkpoint, tiny_prompts, paged_generate, hf_generate
):
    ckpt = tiny_checkpoint(tiny_model_name)
    config, model = _load(ckpt)
    ours = paged_generate(model, config, tiny_prompts, NEW_TOKENS)
    ref = hf_generate(ckpt.hf_model, tiny_prompts, NEW_TOKENS)
    assert ours.steps == NEW_TOKENS  # one packed prefill step, then decode steps
    _assert_same_generation(ours, ref)
    # Random weights can collapse into one repeated token; these do not, so the test is sharp.
    assert len({t for seq in ours.tokens for t in seq}) > 10


@pytest.mark.parametrize("name", ["llama-gqa-tied", "opt-postnorm-proj", "gpt2"])
def test_chunked_prefill_mixed_with_decodes_matches_transformers(
    name, tiny_checkpoint, tiny_prompts, paged_generate, hf_generate
):
    ckpt = tiny_checkpoint(name)
    config, model = _load(ckpt)
    ours = paged_generate(model, config, tiny_prompts, NEW_TOKENS, prefill_chunk=4, block_size=3)
    assert ours.mixed_steps >= 3  # prefill chunks and decode tokens in the same forward pass
    _assert_same_generation(ours, hf_generate(ckpt.hf_model, tiny_prompts, NEW_TOKENS))


def test_prefill_logits_at_every_position_match_transformers(
    tiny_model_name, tiny_checkpoint, tiny_prompts
):
    """One packed prefill of all prompts (contiguous blocks); logits at every position."""
    ckpt = tiny_checkpoint(tiny_model_name)
    config, model = _load(ckpt)
    block_size = 8
    lens = [len(p) for p in tiny_prompts]
    blocks = [-(-n // block_size) for n in lens]
    starts = [sum(blocks[:i]) for i in range(len(lens))]
    kv = torch.zeros(
        config.num_layers, 2, sum(blocks), block_size, config.num_kv_heads, config.head_dim
    )
    tables = torch.tensor([[s + j for j in range(max(blocks))] for s in starts], dtype=torch.int32)
    slots = [(s * block_size) + p for s, n in zip(starts, lens) for p in range(n)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_query_lens=cu,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        decode_only=False,
    )
    ids = torch.tensor([t for p in tiny_prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    with torch.inference_mode():
        logits = model.compute_logits(
            model(ids, positions, [(kv[i, 0], kv[i, 1]) for i in range(config.num_layers)], meta)
        )
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(lens), config.vocab_size)
        for i, prompt in enumerate(tiny_prompts):
            ref = ckpt.hf_model(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits[cu[i] : cu[i + 1]], ref, atol=ATOL, rtol=0)


def test_config_fields_of_a_tiny_checkpoint(tiny_checkpoint):
    config = ModelConfig.from_model(tiny_checkpoint("mistral-linear-rope").folder, device="cpu")
    assert (config.architecture, config.num_layers, config.num_heads) == ("llama", 2, 4)
    assert (config.num_kv_heads, config.head_dim, config.hidden_size) == (2, 32, 64)
    assert (config.vocab_size, config.max_model_len, config.dtype) == (256, 256, torch.float32)
    assert config.eos_token_ids == {2} and config.bos_token_id == 1 and config.gguf_file is None
    assert config.kv_bytes_per_token(torch.float16) == 2 * 2 * 2 * 32 * 2
    opt = ModelConfig.from_model(tiny_checkpoint("opt-prenorm").folder, device="cpu")
    gpt2 = ModelConfig.from_model(tiny_checkpoint("gpt2").folder, device="cpu")
    assert (opt.architecture, opt.num_kv_heads, opt.head_dim, opt.max_model_len) == (
        "opt",
        4,
        16,
        128,
    )
    assert (gpt2.architecture, gpt2.num_kv_heads, gpt2.head_dim, gpt2.max_model_len) == (
        "gpt2",
        4,
        16,
        128,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias", "opt-postnorm-proj", "gpt2"])
def test_greedy_parity_on_cuda(name, tiny_checkpoint, tiny_prompts, paged_generate, hf_generate):
    ckpt = tiny_checkpoint(name)
    config, model = _load(ckpt, device="cuda")
    ours = paged_generate(model, config, tiny_prompts, NEW_TOKENS, prefill_chunk=4, device="cuda")
    ref = hf_generate(ckpt.hf_model, tiny_prompts, NEW_TOKENS)
    assert ours.tokens == ref.tokens
    for mine, theirs in zip(ours.logits, ref.logits):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=0)  # TF32-free fp32 on the GPU


@pytest.mark.gpu
def test_bf16_on_cuda_tracks_float32(tiny_checkpoint, tiny_prompts, paged_generate):
    ckpt = tiny_checkpoint("llama-gqa-tied")
    config, fp32 = _load(ckpt, device="cuda")
    _, bf16 = _load(ckpt, device="cuda", dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    a = paged_generate(fp32, config, tiny_prompts, 1, device="cuda")
    b = paged_generate(bf16, config, tiny_prompts, 1, device="cuda")
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y[0], x[0], atol=0.15, rtol=0.05)
