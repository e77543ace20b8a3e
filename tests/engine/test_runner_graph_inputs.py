"""The decode-graph input path (static buffers, host staging, packed block tables, padding
rows) on the CPU: a stand-in "graph" runs the model on the static buffers exactly as a captured
CUDA graph would, and its logits must equal the eager path's for the same batch. Likewise the
piecewise graphs of batches with prompt chunks: every op but attention on the padded rows of the
static inputs, attention on the real rows between them."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from pagedattn_kernels.attention import plan as decode_plan
from pagedattn_kernels.attention import triton_launch
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.worker import inputs as inputs_module
from pagedkv.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pagedkv.engine.worker.decode_plans import DecodePlanner
from pagedkv.engine.worker.inputs import StepBatch, build_inputs, slot_mapping
from pagedkv.engine.worker.model_runner import ModelRunner
from pagedkv.engine.worker.piecewise_graphs import PiecewiseGraphs, piecewise_token_sizes

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


class _ReplayOnBuffers:
    """What a captured graph does on replay: the same forward over the static buffers (the
    slot mapping computed from the staged tables and positions, as inside the real graph)."""

    def __init__(self, graphs: DecodeGraphs, b: int, hidden: torch.Tensor) -> None:
        self.graphs, self.b, self.hidden = graphs, b, hidden

    def replay(self) -> None:
        self.hidden.copy_(self.graphs._forward(self.b))


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY))
    args = EngineArgs(model=str(folder), load_format="dummy", device="cpu", kv_cache_gb=0.02,
                      swap_space=0.001, max_num_seqs=16, block_size=8)
    cfg = ModelConfig.from_model(str(folder), load_format="dummy", device="cpu")
    r = ModelRunner(cfg, args, torch.device("cpu"))
    g = DecodeGraphs(r.model, r.kv_caches, block_size=r.block_size, max_model_len=r.max_model_len,
                     max_blocks_per_seq=r.max_blocks_per_seq, max_num_seqs=16, device=r.device)
    for b in g.sizes:
        g.graphs[b] = (_ReplayOnBuffers(g, b, hidden := torch.zeros(b, cfg.hidden_size)), hidden)
    r.graphs = g
    return r


def _batch(seqs, sample) -> StepBatch:
    """seqs: (token ids, first position, block table) per sequence."""
    toks, starts, tables = (list(c) for c in zip(*seqs))
    return StepBatch(toks, starts, tables, list(sample))


def _eager(r: ModelRunner, batch: StepBatch) -> torch.Tensor:
    graphs, r.graphs = r.graphs, None
    piecewise, r.piecewise = r.piecewise, None
    try:
        return r.run(batch)
    finally:
        r.graphs, r.piecewise = graphs, piecewise


def _both_paths(r: ModelRunner, seqs, sample) -> tuple[torch.Tensor, torch.Tensor]:
    before = r.kv_cache.clone()
    eager = _eager(r, _batch(seqs, sample))
    r.kv_cache.copy_(before)
    return eager, r.run(_batch(seqs, sample))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_inputs_give_the_eager_logits(runner: ModelRunner, backend, monkeypatch) -> None:
    """Also the attention schedule the graphs stage (``decode_order``: the real rows longest
    context first, then the padding rows): with the Triton kernel (interpreted) the graph
    runs its programs in that order, the eager path (no order on the CPU) in batch order."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
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
    _eager(runner, _batch([(t, 0, table) for t, table in seqs], []))  # prefill

    step = [([rng.randrange(3, 1000)], len(t), table) for t, table in seqs]
    assert runner.graphs.size_for(len(step)) == 16
    eager, graph = _both_paths(runner, step, list(range(len(step))))
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)
    lengths = [start + 1 for _, start, _ in step]
    longest = sorted(range(len(step)), key=lambda i: (-lengths[i], i))
    assert runner.graphs.order[:16].tolist() == longest + list(range(len(step), 16))

    # A smaller batch next: stale rows and columns in the buffers must not matter.
    runner.run(_batch(step, []))
    step2 = [([rng.randrange(3, 1000)], len(t) + 1, table) for t, table in seqs[:3]]
    assert runner.graphs.size_for(len(step2)) == 4
    eager, graph = _both_paths(runner, step2, [0, 2])
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)
    assert sorted(runner.graphs.order[:4].tolist()) == [0, 1, 2, 3]


@pytest.fixture
def planned(runner: ModelRunner, monkeypatch):
    """The runner with decode plans (as on a GPU), on the Triton kernels (interpreted), with
    chunks as short as one tile so that the small contexts here are split: its own decode
    graphs, with plan buffers, stand-ins for captured graphs as above."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(decode_plan, "MIN_CHUNK", 1)
    # a GPU's many program slots (the interpreter counts 4 SMs): chunks shorter than a
    # context of this test
    monkeypatch.setattr(triton_launch, "sm_count", lambda device: 32)
    key_cache = runner.kv_caches[0][0]
    planner = DecodePlanner(num_kv_heads=key_cache.shape[2], head_dim=key_cache.shape[3],
                            dtype=runner.dtype, kv_dtype=key_cache.dtype, device=runner.device)
    g = DecodeGraphs(runner.model, runner.kv_caches, block_size=runner.block_size,
                     max_model_len=runner.max_model_len, max_blocks_per_seq=runner.max_blocks_per_seq,
                     max_num_seqs=16, device=runner.device, planner=planner)  # fmt: skip
    for b in g.sizes:
        g.graphs[b] = (_ReplayOnBuffers(g, b, hidden := torch.zeros(b, TINY["hidden_size"])), hidden)
    monkeypatch.setattr(runner, "graphs", g)
    monkeypatch.setattr(runner, "planner", planner)
    return runner


def _prefilled(r: ModelRunner, rng: random.Random, lengths) -> tuple[list, list[int]]:
    """Sequences of these prompt lengths, prefilled: (tokens, block table) each; and the
    blocks left free."""
    blocks = list(range(r.num_gpu_blocks))
    rng.shuffle(blocks)
    seqs, at = [], 0
    for n in lengths:
        need = (n + 3 + r.block_size - 1) // r.block_size
        seqs.append(([rng.randrange(3, 1000) for _ in range(n)], blocks[at : at + need]))
        at += need
    _eager(r, _batch([(t, 0, table) for t, table in seqs], []))
    return seqs, blocks[at:]


def test_planned_graph_inputs_give_the_eager_logits(planned: ModelRunner) -> None:
    """Decode by plans in the graphs: each step's plan staged into the graph's static plan
    buffer (long rows split into chunks merged after, padding rows as empty items) gives the
    logits of the eager path, whose own plan is built per pass, and of the plain kernel."""
    r = planned
    rng = random.Random(4)
    seqs, _ = _prefilled(r, rng, [150, 7, 90, 33, 140, 12, 64, 5, 120, 48, 77])
    step = [([rng.randrange(3, 1000)], len(t), table) for t, table in seqs]
    assert r.graphs.size_for(len(step)) == 16 and 16 in r.graphs.plan_sizes
    eager, graph = _both_paths(r, step, list(range(len(step))))
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)
    # the staged plan: every row's context covered by its chunks (padding rows: one empty
    # item), and some row split
    plan = r.graphs._plan_views(16)
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, start, end, _ in plan.work.tolist():
        if row >= 0:
            spans.setdefault(row, []).append((start, end))
    contexts = [len(t) + 1 for t, _ in seqs] + [0] * 5
    for row, context in enumerate(contexts):
        got = sorted(spans[row])
        assert got[0][0] == 0 and got[-1][1] == context
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert any(m[0] >= 0 for m in plan.merges.tolist()), "no row was split: no merge covered"
    before = r.kv_cache.clone()
    plain = _eager_without_plans(r, _batch(step, list(range(len(step)))))
    r.kv_cache.copy_(before)
    torch.testing.assert_close(graph, plain, rtol=0, atol=1e-5)

    # A smaller batch next: stale plan rows of the larger one must not matter.
    r.run(_batch(step, []))
    step2 = [([rng.randrange(3, 1000)], len(t) + 1, table) for t, table in seqs[:3]]
    eager, graph = _both_paths(r, step2, [0, 2])
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5)


def _eager_without_plans(r: ModelRunner, batch: StepBatch) -> torch.Tensor:
    planner, r.planner = r.planner, None
    try:
        return _eager(r, batch)
    finally:
        r.planner = planner


def test_mixed_batch_decode_rows_by_a_plan(planned: ModelRunner) -> None:
    """A mixed pass's decode rows attend by a plan (split rows merged) and give the logits of
    the decodes and the chunks run apart without plans."""
    r = planned
    rng = random.Random(5)
    seqs, free = _prefilled(r, rng, [130, 9, 70])
    chunk_table = free[:8]
    decodes = [([rng.randrange(3, 1000)], len(t), table) for t, table in seqs]
    chunks = [([rng.randrange(3, 1000) for _ in range(20)], 0, chunk_table)]
    inputs, _ = build_inputs(_batch(decodes + chunks, [0]), r.block_size, r.device, r.planner)
    assert inputs.meta.decode_order is None and inputs.meta.decode_plan is not None
    assert inputs.meta.decode_plan.merges.shape[0] >= 1  # the 131-token context is split
    before = r.kv_cache.clone()
    mixed = _eager(r, _batch(decodes + chunks, [0, 1, 2, 3]))
    r.kv_cache.copy_(before)
    apart = torch.cat([_eager_without_plans(r, _batch(decodes, [0, 1, 2])),
                       _eager_without_plans(r, _batch(chunks, [0]))])  # fmt: skip
    torch.testing.assert_close(mixed, apart, rtol=0, atol=1e-4)


def test_slot_mapping_is_kvblocks_rule() -> None:
    """The tensor slot rule gives, for every token, block_table[p // bs] * bs + p % bs."""
    rng = random.Random(2)
    bs = 8
    tables = [rng.sample(range(100), 6) for _ in range(4)]
    rows, positions, expected = [], [], []
    for i, t in enumerate(tables):
        for p in rng.sample(range(len(t) * bs), 10):
            rows.append(i)
            positions.append(p)
            expected.append(t[p // bs] * bs + p % bs)
    got = slot_mapping(torch.tensor(tables, dtype=torch.int32), torch.tensor(rows),
                       torch.tensor(positions), bs)
    assert got.dtype == torch.long and got.tolist() == expected


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batch_splits_decodes_from_prefills(runner: ModelRunner, backend, monkeypatch) -> None:
    """A batch of decodes followed by prompt chunks gives the logits of the two run apart:
    the decodes through the flash-decoding kernel (with the Triton kernel, its programs
    longest context first, as on a GPU), the chunks through the prefill kernel."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", backend)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(inputs_module, "ORDER_DEVICES", ("cuda", "cpu"))
    rng = random.Random(1)
    blocks = list(range(runner.num_gpu_blocks))
    rng.shuffle(blocks)
    tables, at = [], 0
    for _ in range(5):
        tables.append(blocks[at : at + 8])
        at += 8
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 17, 4, 30, 12)]
    _eager(runner, _batch([(p, 0, t) for p, t in zip(prompts[:3], tables)], []))
    decodes = [([rng.randrange(3, 1000)], len(p), t) for p, t in zip(prompts[:3], tables)]
    chunks = [(prompts[3][:20], 0, tables[3]), (prompts[4], 0, tables[4])]
    inputs, _ = build_inputs(_batch(decodes + chunks, [0]), runner.block_size, runner.device)
    assert inputs.meta.num_decode_seqs == 3
    if backend == "triton":  # the decode rows' order: contexts of 10, 18 and 5 tokens
        assert inputs.meta.decode_order.tolist() == [1, 0, 2]
    before = runner.kv_cache.clone()
    mixed = _eager(runner, _batch(decodes + chunks, [0, 1, 2, 3, 4]))
    runner.kv_cache.copy_(before)
    apart = torch.cat([_eager(runner, _batch(decodes, [0, 1, 2])),
                       _eager(runner, _batch(chunks, [0, 1]))])
    torch.testing.assert_close(mixed, apart, rtol=0, atol=1e-4)


@pytest.mark.parametrize("max_num_seqs, expected_top, expected_len",
                         [(16, 16, 5), (100, 100, 11), (512, 512, 36), (1000, 1000, 44),
                          (1024, 1024, 44), (4096, 1024, 44)])
def test_graph_batch_sizes_cover_every_batch(max_num_seqs, expected_top, expected_len) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == expected_top
    assert len(sizes) == expected_len
    # Every batch up to the top has a graph that wastes at most an eighth of it (past 8).
    for n in range(9, expected_top + 1):
        b = min(s for s in sizes if s >= n)
        assert b - n <= max(15, n // 8)


def test_piecewise_sizes_and_buckets(runner: ModelRunner) -> None:
    assert piecewise_token_sizes(4096) == [64, 128, 192, 256, 320, 384, 448, 512, 768, 1024,
                                           1536, 2048]
    assert piecewise_token_sizes(300) == [64, 128, 192, 256]
    assert piecewise_token_sizes(32) == []
    pw = PiecewiseGraphs(runner.model, runner.kv_caches, sizes=[128, 64], device=runner.device,
                         dtype=torch.float32)
    assert pw.size_for(10) is None  # nothing captured
    pw.chains = dict.fromkeys(pw.sizes)
    assert [pw.size_for(n) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, None]


def test_piecewise_chains_give_the_eager_logits(runner: ModelRunner, monkeypatch) -> None:
    """A batch of decodes and prompt chunks padded to a bucket: the split pass (every op but
    attention on all the bucket's rows, stale rows from a larger pass before it included;
    attention on the real rows into the static output) gives the eager logits, and so does a
    smaller pass after it; a pass larger than every bucket runs eagerly."""
    rng = random.Random(3)
    pw = PiecewiseGraphs(runner.model, runner.kv_caches, sizes=[64, 128], device=runner.device,
                         dtype=torch.float32)
    pw.chains = dict.fromkeys(pw.sizes)  # no capture on the CPU: run the chain's ops eagerly
    monkeypatch.setattr(pw, "run_chain", pw.forward_split)
    pw.ids.fill_(7)
    pw.pos.fill_(3)
    blocks = list(range(runner.num_gpu_blocks))
    rng.shuffle(blocks)
    contexts = []
    for i in range(4):  # contexts of 4 sequences, then 2 decodes and 2 chunks in one pass
        n = rng.randrange(10, 30)
        contexts.append(([rng.randrange(3, 1000) for _ in range(n)], blocks[i * 12 : i * 12 + 12]))
    _eager(runner, _batch([(t, 0, table) for t, table in contexts], []))
    passes = [
        [([5], len(contexts[0][0]), contexts[0][1]), ([9], len(contexts[1][0]), contexts[1][1]),
         ([rng.randrange(3, 1000) for _ in range(40)], len(contexts[2][0]), contexts[2][1]),
         ([rng.randrange(3, 1000) for _ in range(30)], len(contexts[3][0]), contexts[3][1])],
        [([11], len(contexts[0][0]), contexts[0][1]),
         ([rng.randrange(3, 1000) for _ in range(20)], len(contexts[1][0]), contexts[1][1])],
    ]
    runner.piecewise = pw
    try:
        for seqs, bucket in zip(passes, (128, 64)):
            assert pw.size_for(sum(len(t) for t, _, _ in seqs)) == bucket
            before = runner.piecewise_replays
            eager, split = _both_paths(runner, seqs, range(len(seqs)))
            assert runner.piecewise_replays == before + 1
            torch.testing.assert_close(split, eager, rtol=0, atol=1e-5)
        big = [([rng.randrange(3, 1000) for _ in range(70)], 0, blocks[60:70]),
               ([rng.randrange(3, 1000) for _ in range(70)], 0, blocks[70:80])]
        before = runner.piecewise_replays
        runner.run(_batch(big, [0, 1]))
        assert runner.piecewise_replays == before
    finally:
        runner.piecewise = None
