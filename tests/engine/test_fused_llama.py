"""The Llama decoder with the fused elementwise kernels (fused add + RMSNorm, SiLU-and-multiply,
rotary embedding): the same greedy tokens and logits as with the torch code they replace.

On CPU the fused Triton kernels are forced into Triton's interpreter with
``PAGEDATTN_BACKEND=triton`` (which also runs the attention kernels there); the baseline run
keeps that attention and switches only the elementwise ops back to torch, so the comparison
isolates the fused kernels. They repeat torch's roundings (see ``pagedattn_kernels.fused``),
so float32 logits agree to ~1e-6 and bfloat16 logits to a rare bfloat16 ulp of a hidden state
carried through the layers. The same comparison runs on a GPU at the end (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models import layers
from pagedkv.engine.models.layers import RotaryAngles

pytestmark = pytest.mark.usefixtures("single_thread")

NEW_TOKENS = 8
# float32: the kernels differ from torch only in the RMSNorm sum order and numpy's vs torch's
# exp/cos/sin (a few fp32 ulps of a hidden state); logits of size ~1 moved by <= 1.8e-6 when
# this was written.
ATOL = {torch.float32: 1e-5}


def _load(ckpt, device="cpu", dtype=torch.float32):
    config = ModelConfig.from_model(ckpt.folder, device=device)
    return config, load_model(config, device=device, dtype=dtype)


def _count_fused_launches(monkeypatch) -> dict[str, int]:
    from pagedattn_kernels.fused import triton_launch

    counts: dict[str, int] = {}
    for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "rotary_embedding_and_cache"):
        real = getattr(triton_launch, name)

        def spy(*args, _real=real, _name=name):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(triton_launch, name, spy)
    return counts


def _generate_both(monkeypatch, model, config, prompts, paged_generate, device="cpu"):
    """(fused, unfused) greedy runs through the same attention kernels."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    counts = _count_fused_launches(monkeypatch)
    kw = dict(prefill_chunk=6, block_size=4, device=device)
    fused = paged_generate(model, config, prompts, NEW_TOKENS, **kw)
    num_layers = config.num_layers
    # Per forward pass: 2 norms per layer + the final one, 1 SiLU per layer, and 1 rotary per
    # layer, inside the kernel that writes the cache (no separate rotary launch).
    assert counts["rms_norm"] == fused.steps * (2 * num_layers + 1)
    assert counts["silu_and_mul"] == counts["rotary_embedding_and_cache"] == fused.steps * num_layers
    assert "rotary_embedding" not in counts
    monkeypatch.setattr(layers, "fused_kernels_enabled", lambda device: False)
    unfused = paged_generate(model, config, prompts, NEW_TOKENS, **kw)
    monkeypatch.undo()
    return fused, unfused


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-rope", "mistral-linear-rope"])
def test_fused_kernels_give_the_same_greedy_tokens_and_logits(
    name, monkeypatch, tiny_checkpoint, tiny_prompts, paged_generate
):
    """float32; chunked prefill mixed with decodes; Mistral's head_dim (32) != hidden / heads,
    Llama 3's scaled RoPE frequencies."""
    config, model = _load(tiny_checkpoint(name))
    fused, unfused = _generate_both(monkeypatch, model, config, tiny_prompts, paged_generate)
    assert fused.mixed_steps > 0
    assert fused.tokens == unfused.tokens
    for mine, theirs in zip(fused.logits, unfused.logits):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, atol=ATOL[torch.float32], rtol=0)


def test_fused_kernels_bfloat16_prefill_logits(monkeypatch, tiny_checkpoint, tiny_prompts):
    """bfloat16, one packed prefill: logits at every position. The fused kernels round like
    torch, so almost every hidden state is bit-identical; a rare one differs by one bfloat16
    ulp (relative 2^-8) and carries through the remaining layers. Bound: 2^-6 of the logits'
    spread, with equal argmax wherever the top two logits are further apart than that."""
    config, model = _load(tiny_checkpoint("qwen2-bias"), dtype=torch.bfloat16)
    ids, pos, meta, kv = _packed_prefill(config, tiny_prompts, torch.bfloat16)
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    with torch.inference_mode():
        fused = model.compute_logits(model(ids, pos, [(c[0], c[1]) for c in kv.clone()], meta))
        monkeypatch.setattr(layers, "fused_kernels_enabled", lambda device: False)
        plain = model.compute_logits(model(ids, pos, [(c[0], c[1]) for c in kv.clone()], meta))
    spread = float(plain.std())
    diff = (fused - plain).abs()
    assert float(diff.max()) <= spread / 64, f"max diff {float(diff.max())}, spread {spread}"
    top2 = plain.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > spread / 32
    assert bool((fused.argmax(-1) == plain.argmax(-1))[clear].all())
    assert float((diff == 0).float().mean()) > 0.5  # mostly bit-identical


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_fused_with_the_cache_write_changes_no_bit(
    cache_dtype, monkeypatch, tiny_checkpoint, tiny_prompts
):
    """The rotary embedding in the kernel that writes the cache (``rotary_embedding_and_cache``)
    against the rotary kernel then ``reshape_and_cache``: the same hidden states and the same
    cache contents, bit for bit (bfloat16 model; a bfloat16 or an fp8 cache)."""
    config, model = _load(tiny_checkpoint("llama3-rope"), dtype=torch.bfloat16)
    ids, pos, meta, kv = _packed_prefill(config, tiny_prompts, torch.bfloat16)
    kv = kv.to(cache_dtype)
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    runs = []
    for fuse in (True, False):
        monkeypatch.setattr(layers, "_FUSE_ROPE_AND_CACHE", fuse)
        counts = _count_fused_launches(monkeypatch)
        caches = kv.clone()
        with torch.inference_mode():
            hidden = model(ids, pos, [(c[0], c[1]) for c in caches], meta)
        launches = counts.get("rotary_embedding_and_cache", 0), counts.get("rotary_embedding", 0)
        assert launches == ((config.num_layers, 0) if fuse else (0, config.num_layers))
        runs.append((hidden, caches.view(torch.uint8)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def _packed_prefill(config, prompts, dtype):
    block_size = 8
    lens = [len(p) for p in prompts]
    blocks = [-(-n // block_size) for n in lens]
    starts = [sum(blocks[:i]) for i in range(len(lens))]
    kv = torch.zeros(
        config.num_layers, 2, sum(blocks), block_size, config.num_kv_heads, config.head_dim,
        dtype=dtype,
    )  # fmt: skip
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
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for n in lens for i in range(n)])
    return ids, pos, meta, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_flow_is_the_plain_pre_norm_decoder_bit_for_bit(
    dtype, tiny_checkpoint, tiny_prompts
):
    """The layers carry (x, residual) and add inside the next norm (vLLM's flow); on the torch
    path that must be exactly ``x = x + attn(norm(x)); x = x + mlp(norm(x))``, which is what
    the model computed before and what transformers computes (the parity tests hold it to
    their tolerance; this holds it to the bit)."""
    config, model = _load(tiny_checkpoint("llama3-rope"), dtype=dtype)
    ids, pos, meta, kv = _packed_prefill(config, tiny_prompts, dtype)
    with torch.inference_mode():
        ours = model(ids, pos, [(c[0], c[1]) for c in kv.clone()], meta)
        caches = [(c[0], c[1]) for c in kv.clone()]
        x = model.embed_tokens(ids)
        cos, sin = model.rotary.cos_sin(pos, x.dtype)
        rope = RotaryAngles(pos, model.rotary.inv_freq, cos, sin)
        for layer, cache in zip(model.layers, caches):
            x = x + layer.self_attn(layer.input_layernorm(x), rope, cache, meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        plain = model.norm(x)
    assert torch.equal(ours, plain)


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_on_gpu_match_the_torch_code(dtype, monkeypatch, tiny_checkpoint,
                                                   tiny_prompts, paged_generate):  # fmt: skip
    """Compiled kernels against the unfused torch code on the same GPU, same attention."""
    config, model = _load(tiny_checkpoint("llama3-rope"), device="cuda", dtype=dtype)
    counts = _count_fused_launches(monkeypatch)
    kw = dict(prefill_chunk=6, block_size=4, device="cuda")
    fused = paged_generate(model, config, tiny_prompts, NEW_TOKENS, **kw)
    assert counts.get("rms_norm", 0) > 0, "the fused kernels did not run on CUDA"
    monkeypatch.setattr(layers, "fused_kernels_enabled", lambda device: False)
    unfused = paged_generate(model, config, tiny_prompts, NEW_TOKENS, **kw)
    if dtype == torch.float32:
        assert fused.tokens == unfused.tokens
        for mine, theirs in zip(fused.logits, unfused.logits):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, atol=ATOL[dtype], rtol=0)
    else:  # bfloat16 greedy paths may part where two logits nearly tie; the first step may not
        first = [seq[0] for seq in fused.tokens], [seq[0] for seq in unfused.tokens]
        assert first[0] == first[1]
