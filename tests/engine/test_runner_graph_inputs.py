"""The decode-graph input path (static buffers, host staging, packed block tables, padding
rows) on the CPU: a stand-in "graph" runs the model on the static buffers exactly as a captured
CUDA graph would, and its logits must equal the eager path's for the same batch."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.runner import ModelRunner

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


class _ReplayOnBuffers:
    """What a captured graph does on replay: the same forward over the static buffers."""

    def __init__(self, runner: ModelRunner, b: int, hidden: torch.Tensor) -> None:
        self.runner, self.b, self.hidden = runner, b, hidden

    def replay(self) -> None:
        r, b = self.runner, self.b
        meta = AttentionMetadata(
            slot_mapping=r._g_slots[:b], block_tables=r._g_tables[:b], seq_lens=r._g_lens[:b],
            cu_query_lens=r._g_cu[: b + 1], max_query_len=1, max_seq_len=r.max_model_len,
            decode_only=True,
        )
        self.hidden.copy_(r.model(r._g_ids[:b], r._g_pos[:b], r.kv_caches, meta))


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY))
    args = EngineArgs(model=str(folder), load_format="dummy", device="cpu", kv_cache_gb=0.02,
                      swap_space=0.001, max_num_seqs=16, block_size=8)
    cfg = ModelConfig.from_model(str(folder), load_format="dummy", device="cpu")
    r = ModelRunner(cfg, args, torch.device("cpu"))
    sizes = r.graph_batch_sizes()
    r._alloc_graph_inputs(sizes[-1])
    for b in sizes:
        r._graphs[b] = (_ReplayOnBuffers(r, b, hidden := torch.zeros(b, cfg.hidden_size)), hidden)
    return r


def _both_paths(r: ModelRunner, seqs, sample) -> tuple[torch.Tensor, torch.Tensor]:
    graphs, r._graphs = r._graphs, {}
    before = r.kv_cache.clone()
    eager = r.execute(seqs, sample)
    r.kv_cache.copy_(before)
    r._graphs = graphs
    return eager, r.execute(seqs, sample)


def test_graph_inputs_give_the_eager_logits(runner: ModelRunner) -> None:
    rng = random.Random(0)
    bs = runner.block_size
    blocks = list(range(runner.num_gpu_blocks))
    rng.shuffle(blocks)
    seqs, at = [], 0
    for _ in range(11):  # 11 sequences: replayed in the graph of 16, 5 padding rows
        n = rng.randrange(5, 60)
        need = (n + 3 + bs - 1) // bs
        seqs.append(([rng.randrange(3, 1000) for _ in range(n)], blocks[at : at + need]))
        at += need
    graphs, runner._graphs = runner._graphs, {}
    runner.execute([(t, 0, table) for t, table in seqs], [])  # prefill, eager
    runner._graphs = graphs

    step = [([rng.randrange(3, 1000)], len(t), table) for t, table in seqs]
    assert runner._graph_for(len(step)) == 16
    eager, graph = _both_paths(runner, step, list(range(len(step))))
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)

    # A smaller batch next: stale rows and columns in the buffers must not matter.
    runner.execute(step, [])
    step2 = [([rng.randrange(3, 1000)], len(t) + 1, table) for t, table in seqs[:3]]
    assert runner._graph_for(len(step2)) == 4
    eager, graph = _both_paths(runner, step2, [0, 2])
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batch_splits_decodes_from_prefills(runner: ModelRunner, backend, monkeypatch) -> None:
    """A batch of decodes followed by prompt chunks gives the logits of the two run apart:
    the decodes through the flash-decoding kernel, the chunks through the prefill kernel."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(1)
    blocks = list(range(runner.num_gpu_blocks))
    rng.shuffle(blocks)
    graphs, runner._graphs = runner._graphs, {}
    try:
        tables, at = [], 0
        for _ in range(5):
            tables.append(blocks[at : at + 8])
            at += 8
        prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 17, 4, 30, 12)]
        runner.execute([(p, 0, t) for p, t in zip(prompts[:3], tables)], [])
        decodes = [([rng.randrange(3, 1000)], len(p), t) for p, t in zip(prompts[:3], tables)]
        chunks = [(prompts[3][:20], 0, tables[3]), (prompts[4], 0, tables[4])]
        inputs = runner._build_inputs(decodes + chunks, [0])
        assert inputs.meta.num_decode_seqs == 3
        before = runner.kv_cache.clone()
        mixed = runner.execute(decodes + chunks, [0, 1, 2, 3, 4])
        runner.kv_cache.copy_(before)
        apart = torch.cat([runner.execute(decodes, [0, 1, 2]), runner.execute(chunks, [0, 1])])
        torch.testing.assert_close(mixed, apart, rtol=0, atol=1e-4)
    finally:
        runner._graphs = graphs


@pytest.mark.parametrize("max_num_seqs, expected_top, expected_len",
                         [(16, 16, 5), (100, 100, 11), (512, 512, 36), (1000, 1000, 44),
                          (1024, 1024, 44), (4096, 1024, 44)])
def test_graph_batch_sizes_cover_every_batch(max_num_seqs, expected_top, expected_len) -> None:
    r = ModelRunner.__new__(ModelRunner)  # only the sizing rule is under test
    r.args = EngineArgs(model="unused", max_num_seqs=max_num_seqs)
    sizes = r.graph_batch_sizes()
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == expected_top
    assert len(sizes) == expected_len
    # Every batch up to the top has a graph that wastes at most an eighth of it (past 8).
    for n in range(9, expected_top + 1):
        b = min(s for s in sizes if s >= n)
        assert b - n <= max(15, n // 8)
