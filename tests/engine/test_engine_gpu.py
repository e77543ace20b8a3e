"""The engine on a CUDA GPU: parity with transformers there, and CUDA graphs on/off."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

from .test_engine_e2e import PROMPTS, run_all

pytestmark = pytest.mark.gpu


def _engine(**kw) -> LLMEngine:
    opts = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, swap_space=0.5)
    opts.update(kw)
    return LLMEngine(EngineArgs(**opts))


def _greedy(n=32):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def graph_engine() -> LLMEngine:
    return _engine()


def test_gpu_greedy_matches_transformers(graph_engine, embedded_gguf_path, hf_generate):
    from transformers import AutoModelForCausalLM

    outs = run_all(graph_engine, PROMPTS, _greedy())
    hf = AutoModelForCausalLM.from_pretrained(
        str(embedded_gguf_path.parent), gguf_file=embedded_gguf_path.name, dtype=torch.float32
    ).to("cuda").eval()
    ref = hf_generate(hf, [o.prompt_token_ids for o in outs], 32)
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens


def test_cuda_graphs_on_and_off_identical(graph_engine):
    assert graph_engine.runner._graphs, "decode graphs should be captured"
    with_graphs = run_all(graph_engine, PROMPTS, _greedy())
    eager_engine = _engine(enforce_eager=True)
    assert not eager_engine.runner._graphs
    eager = run_all(eager_engine, PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in with_graphs] == [o.outputs[0].token_ids for o in eager]


def test_gpu_preemption_swap_and_recompute_identical(graph_engine):
    ref = [o.outputs[0].token_ids for o in run_all(graph_engine, PROMPTS, _greedy())]
    for mode in ("recompute", "swap"):
        eng = _engine(num_gpu_blocks_override=9, num_cpu_blocks_override=64, preemption_mode=mode)
        outs = run_all(eng, PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert eng.get_stats().num_preemptions > 0


def test_gpu_bf16_runs_and_frees_everything():
    eng = _engine(dtype="bfloat16", enable_prefix_caching=True)
    outs = run_all(eng, PROMPTS, SamplingParams(max_tokens=16, temperature=0.7, seed=3, n=2))
    assert all(len(o.outputs) == 2 for o in outs)
