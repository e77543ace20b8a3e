"""Weight sources and model resolution: sharded safetensors, dtypes, dummy weights, GGUF files
written here (layouts as llama.cpp's converter writes them), and the errors for bad input."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.weights.gguf import dequantize_tensor, read_gguf_header
from pagedkv.engine.weights.hf import INDEX_FILE

pytestmark = pytest.mark.usefixtures("single_thread")


def _prefill_logits(model, config, prompts, paged_generate):
    return [rows[0] for rows in paged_generate(model, config, prompts, 1).logits]


# --------------------------------------------------------------------------- safetensors


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_checkpoint, tiny_prompts, paged_generate, tmp_path
):
    ckpt = tiny_checkpoint("qwen2-bias")
    ckpt.hf_model.save_pretrained(tmp_path, max_shard_size="150KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / INDEX_FILE).is_file()
    single = load_model(ModelConfig.from_model(ckpt.folder, device="cpu"), device="cpu")
    config = ModelConfig.from_model(tmp_path, device="cpu")
    sharded = load_model(config, device="cpu")
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    # a stray file the index does not name is not read
    shutil.copy(tmp_path / shards[0], tmp_path / "consolidated.safetensors")
    load_model(ModelConfig.from_model(tmp_path, device="cpu"), device="cpu")
    # a missing shard is an error that names it
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(ValueError, match=shards[-1]):
        ModelConfig.from_model(tmp_path, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_load(dtype, tiny_checkpoint, tiny_prompts, paged_generate):
    ckpt = tiny_checkpoint("llama3-rope")
    config = ModelConfig.from_model(ckpt.folder, dtype=dtype, device="cpu")
    assert config.dtype == dtype
    model = load_model(config, device="cpu")
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rotary.inv_freq.dtype == torch.float32  # RoPE angles stay exact
    fp32 = load_model(config, device="cpu", dtype="float32")
    half = _prefill_logits(model, config, tiny_prompts, paged_generate)
    full = _prefill_logits(fp32, config, tiny_prompts, paged_generate)
    for h, f in zip(half, full):
        assert h.dtype == torch.float32  # compute_logits returns float32 whatever the weights
        assert (h - f).abs().max() < 0.05 * f.abs().max()
    assert [int(h.argmax()) for h in half] == [int(f.argmax()) for f in full]


# --------------------------------------------------------------------------- dummy weights

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    dtype="bfloat16",
)


def test_dummy_llama3_8b_shapes_on_meta(tmp_path):
    transformers.LlamaConfig(**LLAMA3_8B).save_pretrained(tmp_path)  # config.json only
    with pytest.raises(ValueError, match="dummy"):
        ModelConfig.from_model(tmp_path)  # no weights, and not asked for random ones
    config = ModelConfig.from_model(tmp_path, load_format="dummy", device="cuda")
    assert config.dtype == torch.bfloat16  # "auto" on CUDA for a bf16 checkpoint
    assert config.eos_token_ids == {128001, 128008, 128009}
    assert config.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    model = load_model(config, device="meta")
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    assert sum(p.numel() for p in params.values()) == 8_030_261_248
    assert params["layers.0.self_attn.qkv_proj.weight"].shape == (4096 + 2 * 1024, 4096)
    assert params["layers.31.mlp.gate_up_proj.weight"].shape == (2 * 14336, 4096)
    assert params["lm_head.weight"].shape == (128256, 4096)
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16


def test_dummy_weights_are_seeded_and_usable(
    tiny_checkpoint, tiny_prompts, paged_generate, tmp_path
):
    shutil.copy(tiny_checkpoint("llama-gqa-tied").folder / "config.json", tmp_path)
    config = ModelConfig.from_model(tmp_path, load_format="dummy", device="cpu")
    a = load_model(config, device="cpu", seed=1)
    b = load_model(config, device="cpu", seed=1)
    c = load_model(config, device="cpu", seed=2)
    wa, wb, wc = (m.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.015 < float(wa.std()) < 0.025
    assert torch.equal(a.norm.weight, torch.ones(64))
    out = paged_generate(a, config, tiny_prompts, 4)
    assert all(torch.isfinite(row).all() for rows in out.logits for row in rows)


# --------------------------------------------------------------------------- GGUF


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [first half; second half] -> interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_gguf(path, arch, metadata, tensors):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def test_llama_gguf_with_llamacpp_rope_permutation(
    tiny_checkpoint, tiny_prompts, paged_generate, hf_generate, tmp_path
):
    ckpt = tiny_checkpoint("llama3-rope")
    hf = ckpt.hf_model.model
    tensors = {
        "token_embd.weight": _np(hf.embed_tokens.weight),
        "output_norm.weight": _np(hf.norm.weight),
        "output.weight": _np(ckpt.hf_model.lm_head.weight),
    }
    for i, layer in enumerate(hf.layers):
        a, m = layer.self_attn, layer.mlp
        tensors |= {
            f"blk.{i}.attn_norm.weight": _np(layer.input_layernorm.weight),
            f"blk.{i}.attn_q.weight": _llamacpp_permute(_np(a.q_proj.weight), 4),
            f"blk.{i}.attn_k.weight": _llamacpp_permute(_np(a.k_proj.weight), 2),
            f"blk.{i}.attn_v.weight": _np(a.v_proj.weight),
            f"blk.{i}.attn_output.weight": _np(a.o_proj.weight),
            f"blk.{i}.ffn_norm.weight": _np(layer.post_attention_layernorm.weight),
            f"blk.{i}.ffn_gate.weight": _np(m.gate_proj.weight),
            f"blk.{i}.ffn_up.weight": _np(m.up_proj.weight),
            f"blk.{i}.ffn_down.weight": _np(m.down_proj.weight),
        }
    # llama.cpp keeps Llama 3.1 RoPE scaling as per-frequency divisors, not metadata
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    tensors["rope_freqs.weight"] = _np(base / ckpt.hf_model.model.rotary_emb.inv_freq)
    metadata = {
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 500000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.eos_token_id": 2,
    }
    _write_gguf(tmp_path / "tiny-llama.gguf", "llama", metadata, tensors)
    config = ModelConfig.from_model(tmp_path / "tiny-llama.gguf", device="cpu")
    assert config.gguf_file == "tiny-llama.gguf" and config.eos_token_ids == {2}
    assert not config.hf_config.tie_word_embeddings
    model = load_model(config, device="cpu")
    ours = paged_generate(model, config, tiny_prompts, 16)
    ref = hf_generate(ckpt.hf_model, tiny_prompts, 16)
    assert ours.tokens == ref.tokens
    torch.testing.assert_close(
        torch.stack(ours.logits[1]), torch.stack(ref.logits[1]), atol=1e-4, rtol=0
    )


def test_qwen2_gguf_with_biases_and_no_rope_permutation(
    tiny_checkpoint, tiny_prompts, paged_generate, hf_generate, tmp_path
):
    """llama.cpp's converter leaves Qwen2's Q and K rows in Hugging Face order (unlike
    Llama's); the registry's qwen2 layout says so, and the Q/K/V biases load too."""
    ckpt = tiny_checkpoint("qwen2-bias")
    hf = ckpt.hf_model.model
    tensors = {
        "token_embd.weight": _np(hf.embed_tokens.weight),
        "output_norm.weight": _np(hf.norm.weight),
        "output.weight": _np(ckpt.hf_model.lm_head.weight),
    }
    for i, layer in enumerate(hf.layers):
        a, m = layer.self_attn, layer.mlp
        tensors |= {
            f"blk.{i}.attn_norm.weight": _np(layer.input_layernorm.weight),
            f"blk.{i}.attn_q.weight": _np(a.q_proj.weight),
            f"blk.{i}.attn_q.bias": _np(a.q_proj.bias),
            f"blk.{i}.attn_k.weight": _np(a.k_proj.weight),
            f"blk.{i}.attn_k.bias": _np(a.k_proj.bias),
            f"blk.{i}.attn_v.weight": _np(a.v_proj.weight),
            f"blk.{i}.attn_v.bias": _np(a.v_proj.bias),
            f"blk.{i}.attn_output.weight": _np(a.o_proj.weight),
            f"blk.{i}.ffn_norm.weight": _np(layer.post_attention_layernorm.weight),
            f"blk.{i}.ffn_gate.weight": _np(m.gate_proj.weight),
            f"blk.{i}.ffn_up.weight": _np(m.up_proj.weight),
            f"blk.{i}.ffn_down.weight": _np(m.down_proj.weight),
        }
    metadata = {
        "qwen2.block_count": 2,
        "qwen2.context_length": 256,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.rope.freq_base": float(ckpt.hf_model.config.rope_parameters["rope_theta"]),
        "qwen2.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.eos_token_id": 2,
    }
    _write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", metadata, tensors)
    config = ModelConfig.from_model(tmp_path / "tiny-qwen2.gguf", device="cpu")
    assert (config.model_type, config.architecture) == ("qwen2", "llama")
    model = load_model(config, device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ours = paged_generate(model, config, tiny_prompts, 16)
    ref = hf_generate(ckpt.hf_model, tiny_prompts, 16)
    assert ours.tokens == ref.tokens
    torch.testing.assert_close(
        torch.stack(ours.logits[3]), torch.stack(ref.logits[3]), atol=1e-4, rtol=0
    )


def test_gpt2_gguf_with_transposed_projections(
    tiny_checkpoint, tiny_prompts, paged_generate, hf_generate, tmp_path
):
    ckpt = tiny_checkpoint("gpt2")
    hf = ckpt.hf_model.transformer
    tensors = {
        "token_embd.weight": _np(hf.wte.weight),
        "position_embd.weight": _np(hf.wpe.weight),
        "output_norm.weight": _np(hf.ln_f.weight),
        "output_norm.bias": _np(hf.ln_f.bias),
    }
    for i, block in enumerate(hf.h):
        # llama.cpp stores GPT-2's Conv1D [in, out] weights as [out, in]
        tensors |= {
            f"blk.{i}.attn_norm.weight": _np(block.ln_1.weight),
            f"blk.{i}.attn_norm.bias": _np(block.ln_1.bias),
            f"blk.{i}.attn_qkv.weight": _np(block.attn.c_attn.weight).T,
            f"blk.{i}.attn_qkv.bias": _np(block.attn.c_attn.bias),
            f"blk.{i}.attn_output.weight": _np(block.attn.c_proj.weight).T,
            f"blk.{i}.attn_output.bias": _np(block.attn.c_proj.bias),
            f"blk.{i}.ffn_norm.weight": _np(block.ln_2.weight),
            f"blk.{i}.ffn_norm.bias": _np(block.ln_2.bias),
            f"blk.{i}.ffn_up.weight": _np(block.mlp.c_fc.weight).T,
            f"blk.{i}.ffn_up.bias": _np(block.mlp.c_fc.bias),
            f"blk.{i}.ffn_down.weight": _np(block.mlp.c_proj.weight).T,
            f"blk.{i}.ffn_down.bias": _np(block.mlp.c_proj.bias),
        }
    metadata = {
        "gpt2.block_count": 2,
        "gpt2.context_length": 128,
        "gpt2.embedding_length": 64,
        "gpt2.feed_forward_length": 256,
        "gpt2.attention.head_count": 4,
        "gpt2.attention.layer_norm_epsilon": 1e-5,
    }
    _write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", metadata, tensors)
    config = ModelConfig.from_model(tmp_path, device="cpu")  # a folder holding one GGUF
    assert config.architecture == "gpt2" and config.hf_config.tie_word_embeddings
    model = load_model(config, device="cpu")
    assert (
        paged_generate(model, config, tiny_prompts, 16).tokens
        == hf_generate(ckpt.hf_model, tiny_prompts, 16).tokens
    )


def test_header_parser_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "ünïcode name")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "é", ""])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.25, 0.0])
    writer.add_bool("some.flag", True)
    writer.add_int64("some.big", -(2**40))
    writer.add_float64("some.double", 0.1)
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("a.weight", dense)
    writer.add_tensor("b.weight", dense.astype(np.float16))
    q8 = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = read_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        if isinstance(expected, float):
            expected = pytest.approx(expected)
        assert header.metadata[key] == expected, key
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert (info.offset, info.shape, info.ggml_type) == (
            t.data_offset,
            tuple(t.shape.tolist()),
            int(t.tensor_type),
        )
        np.testing.assert_array_equal(
            dequantize_tensor(data, info), gguf.quants.dequantize(t.data, t.tensor_type)
        )
    np.testing.assert_allclose(
        dequantize_tensor(data, header.tensors["c.weight"]), dense, atol=0.02
    )


# --------------------------------------------------------------------------- bad input


def test_unsupported_gguf_architecture_is_a_value_error(tmp_path):
    path = tmp_path / "tiny-mamba.gguf"
    _write_gguf(path, "mamba", {"mamba.block_count": 1}, {"token_embd.weight": np.zeros((4, 8))})
    with pytest.raises(ValueError, match="mamba"):
        ModelConfig.from_model(path)


@pytest.mark.parametrize(
    "model, match",
    [
        ("/no/such/model", "unknown model"),
        ("meta-llama/Llama-3-8B", "never downloads"),
    ],
)
def test_unknown_model_is_a_value_error(model, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_model(model)


def test_bad_model_folders_and_options(tmp_path, tiny_checkpoint):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        ModelConfig.from_model(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="neither"):
        ModelConfig.from_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="bert"):
        ModelConfig.from_model(tmp_path, load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 8}))
    with pytest.raises(ValueError, match="mamba"):
        ModelConfig.from_model(tmp_path, load_format="dummy")
    folder = tiny_checkpoint("gpt2").folder
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig.from_model(folder, load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_model(folder, dtype="int8")
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig.from_model(folder, max_model_len=129)  # learned positions end at 128
    assert ModelConfig.from_model(folder, max_model_len=64, device="cpu").max_model_len == 64
    config = ModelConfig.from_model(folder, device="cpu")
    with pytest.raises(ValueError, match="gguf"):
        load_model(config, load_format="gguf", device="cpu")


def test_sliding_window_limits_the_default_context(tmp_path, caplog):
    transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=64,
    ).save_pretrained(tmp_path)
    config = ModelConfig.from_model(tmp_path, load_format="dummy", device="cpu")
    assert (config.sliding_window, config.max_model_len) == (64, 64)
    assert "sliding-window" in caplog.text
    longer = ModelConfig.from_model(tmp_path, load_format="dummy", max_model_len=256, device="cpu")
    assert longer.max_model_len == 256


@pytest.mark.parametrize(
    "rope", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0}]
)
def test_unsupported_rope_scaling_is_a_value_error(tmp_path, rope):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("rope_parameters", None)
    cfg_dict["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg_dict))
    with pytest.raises(ValueError, match=rope["rope_type"]):
        ModelConfig.from_model(tmp_path, load_format="dummy", device="cpu")


def test_checkpoint_not_matching_its_config_is_a_value_error(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama-gqa-tied").folder, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_model(ModelConfig.from_model(tmp_path, device="cpu"), device="cpu")
    cfg["intermediate_size"], cfg["num_hidden_layers"] = 128, 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers\.2\."):
        load_model(ModelConfig.from_model(tmp_path, device="cpu"), device="cpu")
