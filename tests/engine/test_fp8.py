"""The engine's fp8 options: ``--kv-cache-dtype fp8`` and ``--quantization fp8``.

- options: bad values are refused before anything is built; the CLI flags fill them;
- fp8 KV cache: e4m3 cache tensors with twice the blocks of a 16-bit cache (four times those of
  float32) in the same memory; greedy outputs identical to the plain fp8 run's under
  preemption by swap and by recompute, chunked prefill, prefix caching and copy-on-write of
  shared blocks (fp8 blocks swapped and copied as bytes), with tensor parallelism and in the
  engine-core process (how close fp8 stays to the float cache on the embedded model:
  tests/bench/test_fp8_bench.py and the committed 64 x 64 figure);
- fp8 weights: every tensor-parallel linear layer quantized per output channel (each rank its
  own shard), the fallback matmul equal to a float64 computation of the same quantized
  operands, the model's logits close to the unquantized ones, a model without such layers or
  of the wrong kind refused with nothing changed;
- GPU (``gpu``): ``torch._scaled_mm`` against the fallback, the engine with both options on
  CUDA graphs, fp8 swaps through pinned memory.
Most engine runs use small random Llamas with peaky logits (test_tensor_parallel's), where no
last-bit difference can flip a token; the committed accuracy figure (64 prompts x 64 tokens
of the embedded model) comes from ``python -m pagedkv.bench.fp8_accuracy``.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models.quantization import (
    fp8_linear,
    is_quantized,
    quantization_of,
    quantize_model,
)
from pagedkv.engine.sampling_params import SamplingParams

# The tensor-parallel tests' prompts and helpers (their checkpoints: `checkpoints` below).
from .test_engine_e2e import run_all as run_to_end
from .test_tensor_parallel import PROMPTS as TP_PROMPTS
from .test_tensor_parallel import _greedy, _tp1_vs_tp2, _unshard

FP8 = torch.float8_e4m3fn
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Q: What is the largest planet in the solar system?\nA:",
    "The three primary colors are red, yellow and blue. Mixing red and blue gives purple, mixing "
    "blue and yellow gives green, and mixing red and yellow gives",
]
NEW_TOKENS = 24


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine, prompts: list, max_tokens: int = NEW_TOKENS,
            tag: str = "r") -> list[list[int]]:  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, greedy(max_tokens))
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    stats = engine.get_stats()
    assert stats.gpu_kv_usage == 0.0 and stats.cpu_kv_usage == 0.0, "KV blocks leaked"
    return [finals[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]


def teacher_forced_top1(engine: LLMEngine, prompts: list[str], reference: list[list[int]]) -> float:
    """Fraction of the reference's tokens that ``engine`` ranks first, each prompt followed by
    the reference's tokens scored in one prefill (``prompt_logprobs=0``)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    lengths = {}
    for i, (prompt, ref) in enumerate(zip(prompts, reference, strict=True)):
        ids = list(engine.prepare_request(prompt, params).prompt_token_ids)
        lengths[f"tf-{i}"] = len(ids)
        engine.add_request(f"tf-{i}", ids + ref, params)
    hits = total = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ref = reference[int(out.request_id[3:])]
                scored = out.prompt_logprobs[lengths[out.request_id]:]
                hits += sum(lp[tok].rank == 1 for tok, lp in zip(ref, scored, strict=True))
                total += len(ref)
    return hits / total


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "field, value, match",
    [("kv_cache_dtype", "fp16", "kv_cache_dtype"), ("kv_cache_dtype", "int8", "kv_cache_dtype"),
     ("quantization", "int4", "quantization"), ("quantization", "awq", "quantization")],
)  # fmt: skip
def test_bad_options_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{field: value})


def test_cli_flags_fill_the_options():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert args.kv_cache_dtype == "auto" and args.quantization is None
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--kv-cache-dtype", "fp8", "--quantization", "fp8"])
    )
    assert args.kv_cache_dtype == "fp8" and args.quantization == "fp8"
    assert EngineArgs(quantization="none").quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "e5m2"])


# --------------------------------------------------------------------------- fp8 KV cache


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two of test_tensor_parallel's checkpoints: small random Llamas whose large weights make
    every greedy choice win by a wide margin (so no last-bit difference can flip a token), with
    a word-level tokenizer. Fast enough to run many engines on."""
    from transformers import AutoModelForCausalLM

    from .test_tensor_parallel import _configs, _save_tokenizer

    folders = {}
    for name, cfg in _configs().items():
        if name not in ("llama-gqa-bias", "llama-gqa-tied"):
            continue
        torch.manual_seed(sum(map(ord, name)))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1 and not pname.endswith("bias"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.3)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        _save_tokenizer(folder, cfg.vocab_size)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def make_engine(checkpoints) -> Callable[..., LLMEngine]:
    """Engines on one loaded tiny Llama (float32 on the CPU), each with its own KV cache."""
    folder = str(checkpoints["llama-gqa-bias"])
    model = load_model(ModelConfig.from_model(folder, device="cpu"), device="cpu",
                       dtype=torch.float32)  # fmt: skip

    def make(**overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(model=folder, device="cpu", kv_cache_gb=0.01,
                                    swap_space=0.01, seed=0, skip_tokenizer_init=True)
        opts.update(overrides)
        return LLMEngine(EngineArgs(**opts), model=model)

    make.model = model  # type: ignore[attr-defined]
    return make


@pytest.fixture(scope="module")
def fp8_tokens(make_engine) -> list[list[int]]:
    return run_all(make_engine(kv_cache_dtype="fp8"), TP_PROMPTS)


def test_fp8_cache_holds_more_blocks(make_engine):
    plain = make_engine()
    fp8 = make_engine(kv_cache_dtype="fp8")
    assert plain.runner.kv_cache.dtype == torch.float32
    assert fp8.runner.kv_cache.dtype == FP8 and fp8.runner.swap_cache.dtype == FP8
    # Same --kv-cache-gb: one byte per element instead of four (float32 on the CPU).
    assert fp8.runner.block_bytes * 4 == plain.runner.block_bytes
    assert fp8.runner.num_gpu_blocks // 4 == plain.runner.num_gpu_blocks
    assert fp8.runner.num_cpu_blocks // 4 == plain.runner.num_cpu_blocks
    assert fp8.runner.kv_cache.element_size() * fp8.runner.kv_cache.numel() <= 0.01 * (1 << 30)


def test_fp8_cache_doubles_a_bf16_cache(embedded_model_config: ModelConfig):
    from pagedkv.engine.config import kv_cache_dtype

    c = embedded_model_config
    bf16 = c.kv_bytes_per_token(kv_cache_dtype("auto", torch.bfloat16))
    fp8 = c.kv_bytes_per_token(kv_cache_dtype("fp8", torch.bfloat16))
    assert bf16 == 2 * fp8 == 2 * (2 * c.num_layers * c.num_kv_heads * c.head_dim)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("fp9", torch.bfloat16)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_gpu_blocks_override=8, num_cpu_blocks_override=64, block_size=8,
             preemption_mode="swap"),
        dict(num_gpu_blocks_override=8, block_size=8, preemption_mode="recompute"),
        dict(max_num_batched_tokens=8),
        dict(enable_prefix_caching=True, block_size=8),
    ],
    ids=["swap", "recompute", "chunked-prefill", "prefix-caching"],
)
def test_fp8_outputs_identical_under_memory_policies(make_engine, fp8_tokens, overrides):
    """Preemption by swap (fp8 blocks out to the host and back as bytes) and by recompute,
    chunked prefill, and prefix caching (the same prompts again: their blocks read back from
    the cache): the tokens of the plain fp8 run."""
    engine = make_engine(kv_cache_dtype="fp8", **overrides)
    assert run_all(engine, TP_PROMPTS) == fp8_tokens
    if "num_gpu_blocks_override" in overrides:
        assert engine.get_stats().num_preemptions > 0, "the KV budget should force preemption"
    if overrides.get("enable_prefix_caching"):
        assert run_all(engine, TP_PROMPTS, tag="again") == fp8_tokens
        assert engine.get_stats().prefix_cache_hits > 0


def test_fp8_copy_on_write_of_shared_blocks(make_engine):
    """Parallel samples share their prompt's blocks; the first write into the shared partial
    block copies it (fp8 bytes) first. With a greedy request competing for a cache that holds
    either one alone, one of them is swapped out and back: every sample and the greedy tokens
    are those of the run without memory pressure (seeded sampling draws per position)."""
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=NEW_TOKENS,
                             ignore_eos=True)  # fmt: skip

    def run(**kw: Any) -> tuple[list[list[int]], int]:
        engine = make_engine(kv_cache_dtype="fp8", block_size=8, max_num_seqs=4, **kw)
        # 16 tokens: 2 shared full blocks; run_to_end also checks that no block leaked
        s, g = run_to_end(engine, [TP_PROMPTS[3], TP_PROMPTS[1]], [sampled, greedy()])
        outs = [list(c.token_ids) for c in s.outputs] + [list(g.outputs[0].token_ids)]
        return outs, engine.get_stats().num_preemptions

    free, none = run()
    assert none == 0 and len({tuple(t) for t in free[:3]}) == 3, "three different samples"
    assert all(len(t) == NEW_TOKENS for t in free)
    tight, preempted = run(num_gpu_blocks_override=12, num_cpu_blocks_override=32,
                           preemption_mode="swap")  # fmt: skip
    assert preempted > 0
    assert tight == free


def test_default_cache_ignores_the_scales(make_engine):
    """Scales other than 1.0 change nothing for a float cache (they are not passed)."""
    model = make_engine.model
    want = run_all(make_engine(), TP_PROMPTS[:2])
    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    assert attn and all(float(m.k_scale) == 1.0 and m.k_scale.dtype == torch.float32 for m in attn)
    try:
        for m in attn:
            m.k_scale.fill_(3.0)
            m.v_scale.fill_(0.1)
        assert run_all(make_engine(), TP_PROMPTS[:2]) == want
        # ... and an fp8 cache reads them: other scales, other (still valid) tokens.
        scaled = run_all(make_engine(kv_cache_dtype="fp8"), TP_PROMPTS[:2])
    finally:
        for m in attn:
            m.k_scale.fill_(1.0)
            m.v_scale.fill_(1.0)
    assert all(len(t) == NEW_TOKENS for t in scaled)


# --------------------------------------------------------------------------- fp8 weights


def _tiny_llama(tiny_checkpoint) -> tuple[ModelConfig, torch.nn.Module]:
    ckpt = tiny_checkpoint("llama-gqa-tied")
    cfg = ModelConfig.from_model(ckpt.folder, device="cpu")
    return cfg, load_model(cfg, device="cpu", dtype=torch.float32)


def test_quantize_model_layers(tiny_checkpoint):
    cfg, model = _tiny_llama(tiny_checkpoint)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not is_quantized(model) and quantization_of(model) is None
    n = quantize_model(model, "fp8")
    assert n == 4 * cfg.num_layers  # qkv, o, gate_up, down per layer
    assert quantization_of(model) == "fp8"
    for name, module in model.named_modules():
        if getattr(module, "quantizable", False):
            w, s = module.weight, module.weight_scale
            assert w.dtype == FP8 and s.dtype == torch.float32 and s.shape == (1, w.shape[0])
            # Per output channel: the largest magnitude of each row maps to 448.
            orig = before[f"{name}.weight"]
            assert torch.allclose(s[0], orig.abs().amax(dim=1) / 448, rtol=1e-6)
            assert torch.equal(w.float().abs().amax(dim=1), torch.full((w.shape[0],), 448.0))
            # No stale CPU copy of the old weight is left to multiply by (cpu_matmul).
            assert getattr(module, "packed_weight", None) is None
    # Embeddings (the tied LM head) and norms keep float32.
    assert model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int4")


def test_quantize_model_without_linear_layers_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match="no linear layers"):
        quantize_model(model, "fp8")
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_fallback_is_the_quantized_product(seed, dtype):
    """The CPU path computes exactly sum_k xq*wq, times both scales: against a float64
    computation of the same quantized operands (independently dequantized)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 5, 48, generator=gen) * 3).to(dtype)
    w = (torch.randn(32, 48, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(32, generator=gen).to(dtype)
    from pagedkv.engine.models.quantization import quantize_weight

    wq, ws = quantize_weight(w)
    y = fp8_linear(x, wq, ws, bias)
    assert y.shape == (2, 5, 32) and y.dtype == dtype
    # Independent: quantize x per token by the definition, dequantize both in float64.
    x2 = x.reshape(-1, 48).double()
    xs = (x2.abs().amax(dim=1, keepdim=True) / 448).float().double()
    from pagedattn_kernels.reference import nearest_e4m3

    xq = nearest_e4m3(x.reshape(-1, 48), xs.float()).double()
    want = (xq * xs) @ (wq.double() * ws.double().T).T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.reshape(-1, 32).double(), want, rtol=tol, atol=tol * want.abs().max())
    # ... and close to the unquantized product (e4m3 on both sides: a few percent).
    exact = x.double() @ w.double().T + bias.double()
    assert ((y.double() - exact).norm() / exact.norm()) < 0.08


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_takes_fp8_matmul_for_few_rows(seed, dtype, monkeypatch):
    """Up to ``FP8_MATMUL_MAX_ROWS`` rows (from ``PAGEDKV_FP8_MATMUL_MAX_ROWS``; 0 = never)
    ``fp8_linear`` calls ``pagedattn_kernels.fp8_matmul`` (on the GPU; here the CPU is let
    in): the same arithmetic as the float32 fallback, so on the CPU the same bits; more rows
    keep the other path. Without the CPU in ``FP8_MATMUL_DEVICES`` it is never called here."""
    import pagedattn_kernels
    from pagedkv.engine.models import quantization
    from pagedkv.engine.models.quantization import Fp8Rows, quantize_weight

    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(32, 48, generator=gen) * 0.05).to(dtype)
    wq, ws = quantize_weight(w)
    calls = []
    real = pagedattn_kernels.fp8_matmul
    monkeypatch.setattr(pagedattn_kernels, "fp8_matmul",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))  # fmt: skip
    assert quantization.FP8_MATMUL_MAX_ROWS == 128  # the default (decode batches on the GPU)
    fp8_linear(torch.randn(2, 48).to(dtype), wq, ws)
    assert calls == [], "the CPU took fp8_matmul without being let in"
    monkeypatch.setattr(quantization, "FP8_MATMUL_DEVICES", ("cuda", "cpu"))
    for rows in (1, 7, 9):
        x = (torch.randn(rows, 48, generator=gen) * 3).to(dtype)
        monkeypatch.setattr(quantization, "FP8_MATMUL_MAX_ROWS", 0)
        fallback = fp8_linear(x, wq, ws)
        q, xs = pagedattn_kernels.quantize_fp8_per_token(x)
        monkeypatch.setattr(quantization, "FP8_MATMUL_MAX_ROWS", 8)
        assert torch.equal(fp8_linear(x, wq, ws), fallback), f"rows={rows} (seed={seed})"
        assert torch.equal(fp8_linear(Fp8Rows(q, xs, dtype), wq, ws), fallback)
    assert calls == [1, 1, 7, 7], calls


@pytest.mark.parametrize("value", ["-1", "lots", "1.5", ""])
def test_a_bad_row_limit_is_a_clear_error(value, monkeypatch):
    """``PAGEDKV_FP8_MATMUL_MAX_ROWS`` that is not a whole number >= 0 stops the import with the
    variable named (it used to fail as a bare ``int()`` or, negative, to turn fp8_matmul off)."""
    from pagedkv.engine.models.quantization import row_limit

    var = "PAGEDKV_FP8_MATMUL_MAX_ROWS"
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        row_limit(var, "128")
    monkeypatch.setenv(var, "256")
    assert row_limit(var, "128") == 256
    monkeypatch.delenv(var)
    assert row_limit(var, "128") == 128


def test_quantized_model_logits_stay_close(tiny_checkpoint, single_thread):
    cfg, model = _tiny_llama(tiny_checkpoint)
    _, quant = _tiny_llama(tiny_checkpoint)
    quantize_model(quant, "fp8")
    engine_a = LLMEngine(EngineArgs(model=str(cfg.path), device="cpu", kv_cache_gb=0.01,
                                    skip_tokenizer_init=True), model=model)  # fmt: skip
    engine_b = LLMEngine(EngineArgs(model=str(cfg.path), device="cpu", kv_cache_gb=0.01,
                                    skip_tokenizer_init=True, quantization="fp8"), model=quant)
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    outs = []
    for engine in (engine_a, engine_b):
        engine.add_request("r", prompt, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        outs.append(final.outputs[0].logprobs[0])
    top_a = {t: lp.logprob for t, lp in outs[0].items()}
    top_b = {t: lp.logprob for t, lp in outs[1].items()}
    shared = set(top_a) & set(top_b)
    assert len(shared) >= 10, "the top-20 tokens largely the same"
    assert max(abs(top_a[t] - top_b[t]) for t in shared) < 0.5


def _top_logprobs(engine: LLMEngine, prompt: list[int], rid: str) -> dict[int, float]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, logprobs=20))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return [{t: lp.logprob for t, lp in step.items()} for step in final.outputs[0].logprobs]


def test_fused_fp8_inputs_give_the_same_logits(tiny_checkpoint, single_thread, monkeypatch):
    """With fp8 weights the norms and SwiGLU's activation quantize the next linear layer's
    input in their own kernels (``use_fp8_inputs``): the logits are bit for bit those of the
    same kernels unfused, with ``fp8_linear`` quantizing. Triton's interpreter runs the fused
    kernels on the CPU (``PAGEDATTN_BACKEND=triton``), and the fused ops are seen to run."""
    import pagedattn_kernels
    from pagedkv.engine.models import layers as model_layers

    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    cfg, model = _tiny_llama(tiny_checkpoint)
    quantize_model(model, "fp8")
    layers = list(model.layers)
    assert all(layer.input_layernorm.fp8_out and layer.post_attention_layernorm.fp8_out
               and layer.mlp.fp8_act for layer in layers)  # fmt: skip
    assert not model.norm.fp8_out  # the final norm feeds the 16-bit LM head
    calls = {"norm": 0, "act": 0}
    for name, key in (("rms_norm_fp8", "norm"), ("fused_add_rms_norm_fp8", "norm"),
                      ("silu_and_mul_fp8", "act")):  # fmt: skip
        real = getattr(pagedattn_kernels, name)

        def counted(*a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(*a, **k)

        monkeypatch.setattr(pagedattn_kernels, name, counted)
    engine = LLMEngine(EngineArgs(model=str(cfg.path), device="cpu", kv_cache_gb=0.01,
                                  skip_tokenizer_init=True, quantization="fp8"), model=model)
    prompt = list(range(3, 30))
    fused = _top_logprobs(engine, prompt, "fused")
    assert calls["norm"] >= 2 * len(layers) and calls["act"] >= len(layers)
    for layer in layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = False
        layer.mlp.fp8_act = False
    before = dict(calls)
    unfused = _top_logprobs(engine, prompt, "unfused")
    assert calls == before  # the second run quantized in fp8_linear only
    assert fused == unfused
    # One row (a 1-sequence decode step) quantizes in the fused op too.
    out = model_layers.silu_and_mul(torch.randn(1, 8), fp8_out=True)
    assert isinstance(out, model_layers.Fp8Rows) and calls["act"] == before["act"] + 1


def test_fp8_weights_of_an_unsupported_model_are_a_clear_error(tiny_checkpoint):
    """GPT-2's layers are plain nn.Linear (no fp8 path): the engine refuses with a message
    that says what to do, and the loaded weights are left as they were."""
    ckpt = tiny_checkpoint("gpt2")
    with pytest.raises(ValueError, match="without --quantization"):
        LLMEngine(EngineArgs(model=str(ckpt.folder), device="cpu", kv_cache_gb=0.01,
                             skip_tokenizer_init=True, quantization="fp8"))  # fmt: skip
    cfg = ModelConfig.from_model(ckpt.folder, device="cpu")
    model = load_model(cfg, device="cpu", dtype=torch.float32)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no linear layers"):
        quantize_model(model, "fp8")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # The fp8 KV cache needs nothing of the model: GPT-2 runs with it.
    engine = LLMEngine(EngineArgs(model=str(ckpt.folder), device="cpu", kv_cache_gb=0.01,
                                  skip_tokenizer_init=True, kv_cache_dtype="fp8"), model=model)
    assert engine.runner.kv_cache.dtype == FP8
    assert all(len(t) == NEW_TOKENS for t in run_all(engine, [[5, 6, 7], [9, 10]]))


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias", "opt-prenorm"])
def test_quantize_lm_head(tiny_checkpoint, seed, name):
    """``lm_head=True``: the output matrix in e4m3 with one scale per vocabulary row; the
    logits are ``fp8_linear`` of the hidden rows (the quantized product, within fp8's error
    of the float32 one). A tied head keeps its float32 matrix for the embedding (the tokens
    embed as before) and holds the copy beside it; an untied one gives up its 16-bit matrix."""
    from pagedkv.engine.models.quantization import lm_head_quantized, logits_head

    ckpt = tiny_checkpoint(name)
    cfg = ModelConfig.from_model(ckpt.folder, device="cpu")
    model = load_model(cfg, device="cpu", dtype=torch.float32)
    head = logits_head(model)
    matrix = head.weight.detach().clone()
    hidden = torch.randn(5, matrix.shape[1], generator=torch.Generator().manual_seed(seed))
    want = model.compute_logits(hidden)
    assert not lm_head_quantized(model)
    n = quantize_model(model, "fp8", lm_head=True)
    assert n == 1 + sum(getattr(m, "quantizable", False) for m in model.modules())
    assert lm_head_quantized(model) and logits_head(model) is head
    q, scale = head.fp8_head
    assert q.dtype == FP8 and q.shape == matrix.shape and scale.shape == (1, matrix.shape[0])
    assert torch.allclose(scale[0], matrix.abs().amax(dim=1) / 448, rtol=1e-6)
    tied = getattr(model, "lm_head", None) is None
    assert head.weight.dtype == (torch.float32 if tied else FP8)
    if tied:
        assert torch.equal(head.weight, matrix)
        ids = torch.tensor([1, 5, 9])
        assert torch.equal(model.embed_tokens(ids), matrix[ids])
    got = model.compute_logits(hidden)
    assert torch.equal(got, fp8_linear(hidden, q, scale).float())
    err = float((got - want).norm() / want.norm())
    assert 0 < err < 0.06, f"relative error {err:.3f} (seed={seed})"


def test_quantize_lm_head_needs_fp8_weights_and_a_head(tiny_checkpoint):
    """``quantize_lm_head`` without ``quantization='fp8'`` is refused with a clear error; a
    model whose logits have no such head (GPT-2) is refused and left as it was."""
    with pytest.raises(ValueError, match="quantize_lm_head"):
        EngineArgs(quantize_lm_head=True)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["-q", "fp8", "--quantize-lm-head"]))
    assert args.quantize_lm_head and args.quantization == "fp8"
    assert not EngineArgs.from_cli_args(parser.parse_args(["-q", "fp8"])).quantize_lm_head
    ckpt = tiny_checkpoint("gpt2")
    model = load_model(ModelConfig.from_model(ckpt.folder, device="cpu"), device="cpu",
                       dtype=torch.float32)  # fmt: skip
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no linear layers"):
        quantize_model(model, "fp8", lm_head=True)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_engine_with_an_fp8_lm_head(tiny_checkpoint, single_thread):
    """The engine option end to end on the CPU: the loaded model's head is quantized, greedy
    outputs come out at full length, close to those of the fp8 linear layers alone (the top
    logprobs), and a model loaded without the option is refused by an engine that asks for it
    (and the other way round)."""
    from pagedkv.engine.models.quantization import lm_head_quantized

    cfg, _ = _tiny_llama(tiny_checkpoint)
    kw = dict(model=str(cfg.path), device="cpu", kv_cache_gb=0.01, skip_tokenizer_init=True,
              quantization="fp8")  # fmt: skip
    head = LLMEngine(EngineArgs(**kw, quantize_lm_head=True))
    assert lm_head_quantized(head.runner.model)
    plain = LLMEngine(EngineArgs(**kw))
    prompt = list(range(3, 40))
    top_head, top_plain = (_top_logprobs(e, prompt, "r")[0] for e in (head, plain))
    shared = set(top_head) & set(top_plain)
    assert len(shared) >= 10 and max(abs(top_head[t] - top_plain[t]) for t in shared) < 0.5
    assert all(len(t) == NEW_TOKENS for t in run_all(head, [[5, 6, 7], [9, 10]]))
    with pytest.raises(ValueError, match="quantize_lm_head"):
        LLMEngine(EngineArgs(**kw, quantize_lm_head=True), model=plain.runner.model)
    with pytest.raises(ValueError, match="quantize_lm_head"):
        LLMEngine(EngineArgs(**kw), model=head.runner.model)


def test_runner_refuses_a_model_of_the_other_kind(tiny_checkpoint):
    cfg, model = _tiny_llama(tiny_checkpoint)
    with pytest.raises(ValueError, match="quantization"):
        LLMEngine(EngineArgs(model=str(cfg.path), device="cpu", kv_cache_gb=0.01,
                             skip_tokenizer_init=True, quantization="fp8"), model=model)
    assert not is_quantized(model)


# --------------------------------------------------------------------------- other engine paths

@pytest.mark.slow
def test_tp2_fp8_cache_equals_tp1_under_swapping(checkpoints, one_thread):
    """Tensor parallelism: each rank's fp8 cache holds its KV heads, with the layer's scales
    on every rank; swaps of fp8 blocks reach every rank. The checkpoint's peaky logits leave no
    near-tie for the different roundings of split matmuls to flip, so the tokens are TP 1's."""
    requests = [(p, _greedy(16)) for p in TP_PROMPTS]
    kw = dict(kv_cache_dtype="fp8", num_gpu_blocks_override=8, block_size=8,
              preemption_mode="swap", max_num_seqs=4)  # fmt: skip
    ref, got = _tp1_vs_tp2(checkpoints["llama-gqa-bias"], requests, **kw)
    assert ref["stats"].num_preemptions > 0
    assert got["tokens"] == ref["tokens"]


def test_tp_ranks_quantize_their_own_weight_shards(checkpoints):
    """fp8 weights under tensor parallelism: a column-parallel layer's rows are whole on every
    rank, so each rank's channel scales are the slice of one device's; a row-parallel layer's
    ranks each scale their half of every row (and each token of their half of the input), so
    the all-reduced sum of their products is close to, not equal to, one device's product."""
    from pagedkv.engine.distributed.communication import TPInfo
    from pagedkv.engine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

    cfg = ModelConfig.from_model(str(checkpoints["llama-gqa-bias"]), device="cpu")
    whole = load_model(cfg, device="cpu", dtype=torch.float32, quantization="fp8")
    ranks = [load_model(cfg, device="cpu", dtype=torch.float32, tp=TPInfo(r, 2),
                        quantization="fp8") for r in range(2)]  # fmt: skip
    full, shards = dict(whole.named_modules()), [dict(m.named_modules()) for m in ranks]
    checked = set()
    for name, module in full.items():
        parts = [s[name] for s in shards]
        if isinstance(module, ColumnParallelLinear):
            scales = [p.weight_scale[0] for p in parts]
            got = _unshard("weight_scale", module.weight_scale[0], scales, parts[0])
            assert torch.equal(got, module.weight_scale[0]), name
            weights = [p.weight.view(torch.uint8) for p in parts]
            got = _unshard("weight", module.weight.view(torch.uint8), weights, parts[0])
            assert torch.equal(got, module.weight.view(torch.uint8)), name
            checked.add("column")
        elif isinstance(module, RowParallelLinear):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(5, module.in_features, generator=gen)
            half = module.in_features // 2
            y = sum(p._matmul(x[:, r * half : (r + 1) * half], module.bias if r == 0 else None)
                    for r, p in enumerate(parts))  # fmt: skip
            want = module(x)
            assert not torch.equal(y, want)
            assert float((y - want).norm() / want.norm()) < 0.05, name
            checked.add("row")
    assert checked == {"column", "row"}


def test_tp_ranks_quantize_their_own_lm_head_rows(checkpoints):
    """``quantize_lm_head`` under tensor parallelism: each rank's vocabulary rows are whole
    rows of the output matrix, so each rank's e4m3 rows and scales are the slice of one
    device's (per-row scales know no other row), and its logits the slice of one device's."""
    from pagedkv.engine.distributed.communication import TPInfo
    from pagedkv.engine.models.quantization import logits_head

    cfg = ModelConfig.from_model(str(checkpoints["llama-gqa-bias"]), device="cpu")
    kw = dict(device="cpu", dtype=torch.float32, quantization="fp8", quantize_lm_head=True)
    whole = logits_head(load_model(cfg, **kw))
    ranks = [logits_head(load_model(cfg, tp=TPInfo(r, 2), **kw)) for r in range(2)]
    hidden = torch.randn(3, whole.embedding_dim, generator=torch.Generator().manual_seed(0))
    want = fp8_linear(hidden, *whole.fp8_head)
    for head in ranks:
        rows = slice(head.vocab_start, head.vocab_end)
        n = head.vocab_end - head.vocab_start
        q, scale = head.fp8_head
        assert torch.equal(q[:n].view(torch.uint8), whole.fp8_head[0][rows].view(torch.uint8))
        assert torch.equal(scale[0, :n], whole.fp8_head[1][0, rows])
        assert torch.equal(fp8_linear(hidden, q, scale)[:, :n], want[:, rows])


def test_engine_core_process_runs_fp8(checkpoints):
    """The engine core in its own process (what `pagedkv serve` runs) with both fp8 options:
    its KV capacity is the in-process engine's and so are its greedy tokens, request by
    request (the same batches on both sides)."""
    import asyncio

    from pagedkv.engine.async_engine import AsyncLLMEngine

    args = EngineArgs(model=str(checkpoints["llama-gqa-tied"]), device="cpu", dtype="float32",
                      kv_cache_gb=0.01, swap_space=0.01, skip_tokenizer_init=True,
                      kv_cache_dtype="fp8", quantization="fp8")  # fmt: skip
    local = LLMEngine(args)
    want = [run_all(local, [p])[0] for p in TP_PROMPTS[:3]]

    async def go() -> tuple[list[list[int]], int]:
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            got = []
            for i, p in enumerate(TP_PROMPTS[:3]):
                outs = [o async for o in engine.generate(p, greedy(), f"c{i}")]
                got.append(list(outs[-1].outputs[0].token_ids))
            return got, engine.client.ready.num_gpu_blocks
        finally:
            engine.shutdown()

    got, blocks = asyncio.run(go())
    assert blocks == local.runner.num_gpu_blocks
    assert got == want


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True], ids=["fp32-accum", "fast-accum"])
@pytest.mark.parametrize("m", [1, 7, 512])
def test_scaled_mm_matches_the_fallback(seed, m, fast_accum, monkeypatch):
    """``torch._scaled_mm`` against the float32 fallback on the same operands, with and without
    Hopper's fast accumulation (``PAGEDKV_FP8_FAST_ACCUM``)."""
    from pagedkv.engine.models import quantization
    from pagedkv.engine.models.quantization import quantize_weight, uses_scaled_mm

    monkeypatch.setattr(quantization, "FP8_FAST_ACCUM", fast_accum)
    monkeypatch.setattr(quantization, "FP8_MATMUL_MAX_ROWS", 0)  # _scaled_mm at every size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(6144, 4096, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    assert uses_scaled_mm(x, wq), "an H200 runs torch._scaled_mm"
    y = fp8_linear(x, wq, ws)
    y_ref = fp8_linear(x.cpu(), wq.cpu(), ws.cpu())
    err = (y.cpu().double() - y_ref.double()).norm() / y_ref.double().norm()
    print(f"m={m} fast_accum={fast_accum}: rel error {err:.2e} against the fallback")
    assert err < 1e-2, f"rel error {err:.2e} (seed={seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True], ids=["fp32-accum", "fast-accum"])
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_fp8_matmul_matches_scaled_mm(seed, m, fast_accum, monkeypatch):
    """The swapped Triton fp8 matmul against ``torch._scaled_mm`` on the same quantized
    operands: both exact products summed in float32, so equal up to the sums' order and the
    bf16 output's rounding; with fast accumulation (``PAGEDKV_FP8_FAST_ACCUM``, both kernels
    sum in the tensor cores' narrower format) within twice that bound."""
    from pagedkv.engine.models import quantization
    from pagedkv.engine.models.quantization import quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(6144, 4096, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    monkeypatch.setattr(quantization, "FP8_FAST_ACCUM", fast_accum)
    monkeypatch.setattr(quantization, "FP8_MATMUL_MAX_ROWS", 0)
    y_scaled_mm = fp8_linear(x, wq, ws)
    monkeypatch.setattr(quantization, "FP8_MATMUL_MAX_ROWS", 128)
    y = fp8_linear(x, wq, ws)
    err = (y.double() - y_scaled_mm.double()).norm() / y_scaled_mm.double().norm()
    assert err < (8e-3 if fast_accum else 4e-3), f"rel error {err:.2e} (seed={seed})"


def _gpu_engine(path: str | None, **kw: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(model=path, device="cuda", dtype="bfloat16",
                                gpu_memory_utilization=0.3, swap_space=0.5, max_num_seqs=64)
    opts.update(kw)
    return LLMEngine(EngineArgs(**opts))


@pytest.mark.gpu
def test_gpu_fp8_cache_and_weights_with_graphs(gpu_model_path):
    """bf16 against fp8 KV + fp8 weights on the GPU: decode through CUDA graphs, twice the KV
    blocks in the same memory, torch._scaled_mm in the linear layers, close greedy outputs."""
    from pagedkv.engine.models.quantization import uses_scaled_mm

    base = _gpu_engine(gpu_model_path)
    want = run_all(base, PROMPTS)
    blocks = base.runner.num_gpu_blocks
    del base
    torch.cuda.empty_cache()
    fp8 = _gpu_engine(gpu_model_path, kv_cache_dtype="fp8", quantization="fp8")
    got = run_all(fp8, PROMPTS)
    assert fp8.runner.kv_cache.dtype == FP8 and fp8.runner.swap_cache.dtype == FP8
    assert fp8.runner.graph_replays > 0
    assert fp8.runner.num_gpu_blocks > 1.8 * blocks  # same memory budget, half the bytes
    layer = next(m for m in fp8.runner.model.modules() if getattr(m, "quantizable", False))
    x = torch.zeros(4, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    assert uses_scaled_mm(x, layer.weight), "an H200 multiplies fp8 on its tensor cores"
    assert all(len(t) == NEW_TOKENS for t in got)
    # Free-running outputs part for good after one close call, so the fp8 engine is asked
    # instead whether bf16's token is its own first choice, given bf16's history. (The
    # embedded model, 64 prompts on an H200: 0.91; bench.fp8_accuracy's teacher_forced_top1.)
    top1 = teacher_forced_top1(fp8, PROMPTS, want)
    assert top1 >= 0.75, f"teacher-forced top-1 {top1:.2f}"


@pytest.mark.gpu
def test_gpu_fp8_lm_head_with_graphs(gpu_model_path):
    """``--quantize-lm-head`` on the GPU: the logits of the decode graphs through the e4m3
    head (``fp8_matmul`` for a few rows); greedy outputs at full length and close to those of
    the fp8 linear layers alone (teacher-forced top-1, as above)."""
    from pagedkv.engine.models.quantization import lm_head_quantized, logits_head

    plain = _gpu_engine(gpu_model_path, kv_cache_dtype="fp8", quantization="fp8")
    want = run_all(plain, PROMPTS)
    del plain
    torch.cuda.empty_cache()
    head = _gpu_engine(gpu_model_path, kv_cache_dtype="fp8", quantization="fp8",
                       quantize_lm_head=True)  # fmt: skip
    got = run_all(head, PROMPTS)
    model = head.runner.model
    assert lm_head_quantized(model) and logits_head(model).fp8_head[0].is_cuda
    assert head.runner.graph_replays > 0
    assert all(len(t) == NEW_TOKENS for t in got)
    top1 = teacher_forced_top1(head, PROMPTS, want)
    assert top1 >= 0.6, f"teacher-forced top-1 {top1:.2f}"


@pytest.mark.gpu
def test_gpu_fp8_cache_swaps_and_recomputes_to_the_same_tokens(gpu_model_path):
    """Swaps of fp8 blocks through pinned host memory on the copy stream, and recompute: the
    tokens of the run without preemption (float32 model, as test_engine_gpu's own check)."""
    ref = run_all(_gpu_engine(gpu_model_path, dtype="float32", kv_cache_dtype="fp8"), PROMPTS)
    for mode in ("swap", "recompute"):
        eng = _gpu_engine(gpu_model_path, dtype="float32", kv_cache_dtype="fp8",
                          num_gpu_blocks_override=9, num_cpu_blocks_override=64,
                          preemption_mode=mode)  # fmt: skip
        assert run_all(eng, PROMPTS) == ref, mode
        assert eng.get_stats().num_preemptions > 0
