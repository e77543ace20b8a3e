"""Tensor parallelism: the model split over 2 ranks computes what the whole model computes.

On the CPU the ranks are processes joined by gloo (the driver in the test process, one spawned
worker); on a machine with 2 CUDA GPUs the `gpu` tests repeat the parity over NCCL. The
references are the same engine at tensor-parallel size 1, which the parity tests against
transformers pin down. Checkpoints are small random-weight Hugging Face models saved with
`save_pretrained` (float32 safetensors) with weights large enough that every greedy choice wins
by a wide margin, so that the last-bit differences of split matmuls and all-reduces cannot flip
a token.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.distributed.parallel_state import (
    TPInfo,
    check_tensor_parallel,
    rank_model_config,
    valid_tp_sizes,
)
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.worker.cuda_graphs import graph_batch_sizes
from pagedkv.engine.worker.model_runner import ModelRunner

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 20
PROMPTS = [
    [5, 6, 7, 8, 9],
    list(range(10, 47)),
    [100],
    [3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 83, 27, 95],
    [200, 201, 202, 7, 7, 7, 7, 8],
]


# --------------------------------------------------------------------------- checkpoints


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer (token ``t{i}`` is id i) so the engine has one to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(folder)


def _configs() -> dict[str, Any]:
    import transformers as tf

    llama = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    opt = dict(
        vocab_size=256,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        # odd vocabulary: the last rank's vocabulary slice is padded; every projection has a bias
        "llama-gqa-bias": tf.LlamaConfig(
            vocab_size=251, tie_word_embeddings=False, attention_bias=True, mlp_bias=True, **llama
        ),
        "llama-gqa-tied": tf.LlamaConfig(vocab_size=256, tie_word_embeddings=True, **llama),
        # its own model file: bias on Q/K/V only, sharded with the heads
        "qwen2-gqa": tf.Qwen2Config(vocab_size=256, tie_word_embeddings=False, **llama),
        # OPT-350m's layout: LayerNorm after each block, a narrower word embedding projected
        "opt-postnorm-proj": tf.OPTConfig(do_layer_norm_before=False, word_embed_proj_dim=32, **opt),
        "opt-prenorm": tf.OPTConfig(do_layer_norm_before=True, **opt),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, cfg in _configs().items():
        torch.manual_seed(sum(map(ord, name)))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1 and not pname.endswith("bias"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norm scales
                else:
                    p.normal_(0.0, 0.3)  # large: peaky logits, no near-ties
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        _save_tokenizer(folder, cfg.vocab_size)
        folders[name] = folder
    return folders


def _engine(folder: Path | str, tp: int, **kw: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_gb=0.01,
        swap_space=0.01,
        distributed_timeout=60.0,
    )
    opts.update(kw)
    return LLMEngine(EngineArgs(**opts))


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Run requests to the end: token ids per request (all completions), and the stats."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    outs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [c.token_ids for c in out.outputs]
    stats = engine.get_stats()
    assert stats.gpu_kv_usage == 0.0 and stats.cpu_kv_usage == 0.0, "KV blocks leaked"
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    runner = engine.runner
    return {"tokens": [outs[f"r{i}"] for i in range(len(requests))], "stats": stats,
            "passes": runner.graph_replays + runner.eager_passes,
            "graph_replays": runner.graph_replays, "async": engine._async is not None}


def _tp1_vs_tp2(folder: Path, requests, device: str = "cpu", **kw: Any) -> tuple[dict, dict]:
    ref_engine = _engine(folder, 1, device=device, **kw)
    ref = _run(ref_engine, requests)
    ref_healthy = ref_engine.is_healthy
    del ref_engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the TP 2 driver profiles the same GPU
    engine = _engine(folder, 2, device=device, **kw)
    try:
        got = _run(engine, requests)
        got["ranks"] = engine.runner.rank_stats()
        assert engine.is_healthy and ref_healthy
    finally:
        start = time.monotonic()
        engine.shutdown()
        took = time.monotonic() - start
    assert not engine.is_healthy  # shut down: no step can run
    left = multiprocessing.active_children()
    if left:  # say whether they were stuck or only slow to exit, then fail
        for p in left:
            p.join(15)
        detail = [(p.name, p.pid, p.exitcode) for p in left]
        pytest.fail(f"workers left running after shutdown ({took:.1f} s): {detail}")
    assert not dist.is_initialized()
    _check_ranks_ran_alike(ref, got)
    return ref, got


def _check_ranks_ran_alike(ref: dict, got: dict) -> None:
    """Every rank ran every step, the same way (graph or eager, tokens from the device or
    not), and as many forward passes as one device ran for the same requests."""
    ranks = got["ranks"]
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    for r in ranks[1:]:
        assert {**r, "rank": 0} == ranks[0], ranks
    assert ranks[0]["steps"] == got["passes"] == ref["passes"] > 0
    assert ranks[0]["graph_replays"] == ref["graph_replays"]  # graphs where one device has them
    assert ranks[0]["graph_replays"] + ranks[0]["eager_passes"] == ranks[0]["steps"]
    assert got["async"] == ref["async"]
    if not got["async"]:
        assert ranks[0]["steps_with_pending"] == 0


# --------------------------------------------------------------------------- sharding


def _rank_models(folder: Path, tp: int, load_format: str = "auto") -> tuple[Any, list[Any]]:
    config = ModelConfig.from_model(str(folder), device="cpu", load_format=load_format)
    whole = load_model(config, load_format=load_format, device="cpu", dtype=torch.float32)
    ranks = [
        load_model(
            config, load_format=load_format, device="cpu", dtype=torch.float32, tp=TPInfo(r, tp)
        )
        for r in range(tp)
    ]
    return whole, ranks


def _unshard(name: str, whole: torch.Tensor, shards: list[torch.Tensor], module) -> torch.Tensor:
    """Put rank shards back together the way the layer split them."""
    from pagedkv.engine.models.parallel_layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if isinstance(module, ColumnParallelLinear):
        parts, at = [], 0
        for local in module.local_sizes:
            parts += [s.narrow(0, at, local) for s in shards]
            at += local
        return torch.cat(parts)
    if isinstance(module, RowParallelLinear) and name.endswith("weight"):
        return torch.cat(shards, dim=1)
    if isinstance(module, VocabParallelEmbedding):
        return torch.cat(shards)[: module.full_num_embeddings]
    for s in shards[1:]:  # replicated
        assert torch.equal(s, shards[0]), name
    return shards[0]


@pytest.mark.parametrize(
    ("name", "tp", "load_format"),
    [
        ("llama-gqa-bias", 2, "auto"),
        ("opt-postnorm-proj", 4, "auto"),
        ("llama-gqa-tied", 2, "dummy"),
        ("opt-prenorm", 2, "dummy"),
        ("qwen2-gqa", 2, "auto"),
        ("qwen2-gqa", 2, "dummy"),
    ],
)
def test_shards_put_back_together_are_the_whole_weights(checkpoints, name, tp, load_format):
    whole, ranks = _rank_models(checkpoints[name], tp, load_format)
    full = dict(whole.named_parameters())
    per_rank = [dict(m.named_parameters()) for m in ranks]
    modules = dict(ranks[-1].named_modules())
    assert list(full) == list(per_rank[0])
    split = []
    for pname, weight in full.items():
        shards = [p[pname] for p in per_rank]
        module = modules[pname.rpartition(".")[0]]
        assert torch.equal(_unshard(pname, weight, shards, module), weight), pname
        if shards[0].numel() < weight.numel():
            split.append(pname.rpartition(".")[0])
            # each rank holds its share (plus at most one padding row), never more
            row = weight.numel() // weight.shape[0]
            assert all(s.numel() <= -(-weight.numel() // tp) + row for s in shards), pname
    layers = whole.config.num_hidden_layers
    assert len(set(split)) == 4 * layers + 1 + ("lm_head" in split), sorted(set(split))


@pytest.mark.slow
def test_embedded_gguf_shards_put_back_together_are_the_whole_weights(
    embedded_model_config, embedded_model
):
    """GGUF: each tensor is dequantized (and un-permuted for llama.cpp's RoPE layout), then
    narrowed. The embedded SmolLM2 has 9 query and 3 KV heads: it splits 3 ways."""
    config = embedded_model_config
    assert valid_tp_sizes(config) == [1, 3]
    full = dict(embedded_model.named_parameters())
    for rank in range(3):
        shard = load_model(config, device="cpu", dtype=torch.float32, tp=TPInfo(rank, 3))
        params = dict(shard.named_parameters())
        attn = shard.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        q, k = 3 * 64, 64
        whole_qkv = full["layers.0.self_attn.qkv_proj.weight"]
        mine = params["layers.0.self_attn.qkv_proj.weight"]
        assert torch.equal(mine[:q], whole_qkv[rank * q : (rank + 1) * q])
        assert torch.equal(mine[q : q + k], whole_qkv[576 + rank * k : 576 + (rank + 1) * k])
        assert torch.equal(mine[q + k :], whole_qkv[576 + 192 + rank * k :][:k])
        down = params["layers.29.mlp.down_proj.weight"]
        assert torch.equal(down, full["layers.29.mlp.down_proj.weight"][:, rank * 512 :][:, :512])
        emb = params["embed_tokens.weight"]
        assert torch.equal(emb, full["embed_tokens.weight"][rank * 16384 : (rank + 1) * 16384])
        del shard


def test_padded_vocabulary_slice_is_zero_and_ids_map_to_their_rank(checkpoints):
    _, ranks = _rank_models(checkpoints["llama-gqa-bias"], 2)
    emb0, emb1 = ranks[0].embed_tokens, ranks[1].embed_tokens
    assert (emb0.vocab_start, emb0.vocab_end, emb1.vocab_start, emb1.vocab_end) == (
        0,
        126,
        126,
        251,
    )
    assert emb1.weight.shape[0] == 126 and torch.all(emb1.weight[125] == 0)
    assert torch.all(ranks[1].lm_head.weight[125] == 0)


def test_qwen2_splits_like_llama_with_its_q_k_v_bias_sharded(checkpoints):
    """Qwen2's split sizes come from its registry entry; each rank holds its heads' slice of
    the Q, K and V biases and the output projection has none."""
    config = ModelConfig.from_model(str(checkpoints["qwen2-gqa"]), device="cpu")
    assert config.model_type == "qwen2" and valid_tp_sizes(config, limit=8) == [1, 2]
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*use one of \[1, 2\]"):
        check_tensor_parallel(config, 4, torch.device("cpu"))
    whole, ranks = _rank_models(checkpoints["qwen2-gqa"], 2)
    bias = whole.layers[0].self_attn.qkv_proj.bias
    q, kv = 64, 32  # 4 query heads and 2 KV heads of 16
    for r, shard in enumerate(ranks):
        attn = shard.layers[0].self_attn
        assert type(shard).__name__ == "Qwen2ForCausalLM" and attn.o_proj.bias is None
        mine = attn.qkv_proj.bias
        assert torch.equal(mine[: q // 2], bias[r * q // 2 : (r + 1) * q // 2])
        assert torch.equal(mine[q // 2 : q // 2 + kv // 2], bias[q + r * kv // 2 :][: kv // 2])
        assert torch.equal(mine[q // 2 + kv // 2 :], bias[q + kv + r * kv // 2 :][: kv // 2])


def test_rank_config_holds_its_share_of_the_heads(checkpoints):
    config = ModelConfig.from_model(str(checkpoints["llama-gqa-bias"]), device="cpu")
    rank = rank_model_config(config, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.head_dim) == (2, 1, 16)
    assert rank.kv_bytes_per_token() * 2 == config.kv_bytes_per_token()
    assert rank_model_config(config, 1) is config


def test_the_kv_cache_gets_the_smallest_block_count_of_any_rank(checkpoints):
    """The min over ranks goes through ModelRunner's sizing hook (guards a rename of it)."""
    from pagedkv.engine.distributed.worker import RankRunner

    assert callable(getattr(ModelRunner, "_num_blocks_that_fit", None))

    class FakeContext:  # one rank; another rank that fits 7 blocks only
        def min_int(self, value: int) -> int:
            return min(value, 7)

    config = ModelConfig.from_model(str(checkpoints["llama-gqa-tied"]), device="cpu")
    args = EngineArgs(model=str(checkpoints["llama-gqa-tied"]), device="cpu", kv_cache_gb=0.01)
    runner = RankRunner(FakeContext(), config, args, torch.device("cpu"))
    assert runner.num_gpu_blocks == 7
    assert runner.kv_cache.shape[2] == 7


# --------------------------------------------------------------------------- start-time errors


def _nothing_started() -> None:
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()


def test_heads_not_divisible_is_a_clear_error_and_nothing_starts(checkpoints):
    with pytest.raises(
        ValueError, match=r"does not divide num_attention_heads=4.*use one of \[1, 2\]"
    ):
        _engine(checkpoints["llama-gqa-bias"], 3)
    _nothing_started()
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        _engine(checkpoints["llama-gqa-bias"], 4)
    _nothing_started()


def test_other_unsplittable_configurations_are_clear_errors(checkpoints, monkeypatch):
    import transformers as tf

    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1"):
        EngineArgs(tensor_parallel_size=0)
    config = ModelConfig.from_model(str(checkpoints["opt-prenorm"]), device="cpu")
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        check_tensor_parallel(config, 8, torch.device("cpu"))
    odd_ffn = _replace_hf(config, tf.OPTConfig(**{**config.hf_config.to_dict(), "ffn_dim": 130}))
    with pytest.raises(ValueError, match=r"ffn_dim=130.*use one of \[1, 2\]"):
        check_tensor_parallel(odd_ffn, 4, torch.device("cpu"))
    gpt2 = _replace_hf(config, tf.GPT2Config(n_embd=64, n_layer=2, n_head=4), architecture="gpt2")
    with pytest.raises(ValueError, match=r"llama and opt families.*--tensor-parallel-size 1"):
        check_tensor_parallel(gpt2, 2, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices on this machine but 1 are visible"):
        check_tensor_parallel(config, 2, torch.device("cuda"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ValueError, match="torchrun started 4 processes but --tensor-parallel-size is 2"
    ):
        check_tensor_parallel(config, 2, torch.device("cpu"))
    assert valid_tp_sizes(config, limit=8) == [1, 2, 4]
    _nothing_started()


def _replace_hf(config: ModelConfig, hf_config: Any, **changes: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, hf_config=hf_config, **changes)


def test_a_preloaded_model_cannot_be_split(checkpoints):
    config = ModelConfig.from_model(str(checkpoints["llama-gqa-tied"]), device="cpu")
    model = load_model(config, device="cpu", dtype=torch.float32)
    args = EngineArgs(
        model=str(checkpoints["llama-gqa-tied"]), device="cpu", tensor_parallel_size=2
    )
    with pytest.raises(ValueError, match="pre-loaded model cannot be split"):
        LLMEngine(args, model=model)
    _nothing_started()


# --------------------------------------------------------------------------- parity, CPU (gloo)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "async_scheduling"),
    [("llama-gqa-bias", False), ("llama-gqa-bias", True), ("opt-postnorm-proj", True),
     ("qwen2-gqa", False)],
    ids=["llama-plain", "llama-async", "opt-async", "qwen2-plain"],
)
def test_tp2_greedy_tokens_equal_tp1(checkpoints, one_thread, name, async_scheduling):
    """Plain steps, and asynchronous scheduling (each step launched before the tokens of the
    one before reach the host; every rank computes the argmax and reads it on its device)."""
    requests = [(p, _greedy()) for p in PROMPTS]
    ref, got = _tp1_vs_tp2(checkpoints[name], requests, async_scheduling=async_scheduling)
    assert got["tokens"] == ref["tokens"]
    assert len({tuple(t[0]) for t in ref["tokens"]}) == len(PROMPTS), "outputs differ by prompt"
    # each rank's cache holds half the KV heads: the same memory holds twice the blocks
    assert got["stats"].num_gpu_blocks // 2 == ref["stats"].num_gpu_blocks
    assert got["async"] is async_scheduling
    if async_scheduling:  # steps scheduled ahead read their last token on every device
        assert got["ranks"][0]["steps_with_pending"] > 0
    # on the CPU every pass runs eagerly (CUDA graphs: see the gpu tests)
    assert got["ranks"][0]["graph_replays"] == 0 == got["ranks"][0]["num_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "mode", "async_scheduling"),
    [("llama-gqa-tied", "swap", True), ("opt-prenorm", "recompute", False)],
)
def test_tp2_equals_tp1_under_preemption_and_copy_on_write(
    checkpoints, one_thread, name, mode, async_scheduling
):
    """A KV cache far too small for the batch: sequences are swapped out and back in (the
    block operations reach every rank) or recomputed; parallel samples share blocks and copy
    them on write. Sampled requests take the plain step (logits gathered on rank 0), greedy
    ones the asynchronous one, and the engine moves between the two."""
    requests = [(p, _greedy(24)) for p in PROMPTS]
    requests.append((PROMPTS[3], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24)))
    kw = dict(num_gpu_blocks_override=8, block_size=8, preemption_mode=mode, max_num_seqs=4,
              async_scheduling=async_scheduling)
    ref, got = _tp1_vs_tp2(checkpoints[name], requests, **kw)
    assert ref["stats"].num_preemptions > 0
    assert got["stats"].num_preemptions == ref["stats"].num_preemptions
    assert got["tokens"] == ref["tokens"]


@pytest.mark.slow
def test_tp2_dummy_weights_equal_tp1(checkpoints, one_thread):
    """Dummy weights do not depend on the split: TP 2 draws TP 1's tensors and keeps slices."""
    requests = [(p, _greedy(12)) for p in PROMPTS[:3]]
    ref, got = _tp1_vs_tp2(checkpoints["llama-gqa-bias"], requests, load_format="dummy", seed=3)
    assert got["tokens"] == ref["tokens"]


# --------------------------------------------------------------------------- failures

_DEAD_WORKER_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, threading, time
    import torch
    import torch.distributed as dist

    def main():
        torch.set_num_threads(1)
        from pagedkv.engine.arg_utils import EngineArgs
        from pagedkv.engine.distributed.executor import TensorParallelError
        from pagedkv.engine.llm_engine import LLMEngine
        from pagedkv.engine.sampling_params import SamplingParams

        scenario, model, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
        device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
        args = EngineArgs(model=model, device=device, dtype="float32", tensor_parallel_size=2,
                          kv_cache_gb=0.01, swap_space=0.01, distributed_timeout=timeout_s,
                          async_scheduling=scenario == "async", gpu_memory_utilization=0.3,
                          max_num_seqs=16)
        report = {"errors": []}
        killed = {}

        def kill(pid):
            killed["pid"], killed["at"] = pid, time.monotonic()
            os.kill(pid, signal.SIGKILL)

        if scenario.startswith("startup"):
            def killer():  # the worker as soon as it exists, or once the groups are up
                while not multiprocessing.active_children():
                    time.sleep(0.005)
                while scenario == "startup-joined" and not dist.is_initialized():
                    time.sleep(0.005)
                kill(multiprocessing.active_children()[0].pid)
            threading.Thread(target=killer, daemon=True).start()
            try:
                LLMEngine(args)
            except TensorParallelError as exc:
                report["errors"].append(str(exc))
        else:
            engine = LLMEngine(args)
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            for i in range(3):
                engine.add_request(str(i), [5, 6, 7 + i], params)
            if scenario == "idle":  # between steps: nothing runs, the engine must still know
                kill(engine.runner._workers.procs[1].pid)
                while engine.is_healthy and time.monotonic() - killed["at"] < 10:
                    time.sleep(0.01)
                report["unhealthy_after"] = time.monotonic() - killed["at"]
            else:
                for _ in range(3):
                    engine.step()
                kill(engine.runner._workers.procs[1].pid)
            for _ in range(2):
                try:
                    while engine.has_unfinished_requests():
                        engine.step()
                    report["errors"].append(None)
                except TensorParallelError as exc:
                    report["errors"].append(str(exc))
            try:
                engine.check_health()
            except TensorParallelError as exc:
                report["health"] = str(exc)
        report.update(seconds=time.monotonic() - killed["at"], pid=killed["pid"],
                      children=len(multiprocessing.active_children()),
                      initialized=dist.is_initialized())
        print(json.dumps(report))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["plain", "async", "idle", "startup", "startup-joined"])
def test_a_dead_worker_stops_the_engine_with_a_clear_error(checkpoints, tmp_path, scenario):
    """A worker killed mid-generation (plain or asynchronous steps), while the engine idles
    between steps, or while the engine starts (before or after the process groups are up):
    the engine raises `TensorParallelError` naming the rank and the signal within seconds
    (never by the collective timeout, never a hang), every later step raises it too,
    `is_healthy` turns False with no step run, and no process is left behind. Runs in a
    subprocess so that a hang fails the test."""
    script = tmp_path / "dead_worker.py"
    script.write_text(_DEAD_WORKER_SCRIPT)
    timeout_s = 60
    proc = subprocess.run(
        [sys.executable, str(script), scenario, str(checkpoints["llama-gqa-tied"]),
         str(timeout_s)],
        capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    message = f"worker rank 1 (pid {result['pid']}) was killed by signal SIGKILL"
    errors = result["errors"]
    assert errors and all(e is not None and message in e for e in errors), (errors, message)
    if not scenario.startswith("startup"):
        assert len(errors) == 2 and errors[0] == errors[1]  # every later step too
        assert message in result["health"]
    assert result["seconds"] < 10, "noticed by the collective timeout, not at once"
    if scenario == "idle":
        assert result["unhealthy_after"] < 2.5  # the monitor, not a step, noticed
    assert result["children"] == 0 and not result["initialized"]


def _child_workers(pid: int) -> list[int]:
    """Pids of the spawned worker processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            found.append(int(entry.name))
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_cli(args: list[str]) -> tuple[subprocess.Popen, Any, list[str]]:
    """`pagedkv ARGS` in a subprocess; returns it, an event set once the engine is ready, and
    its stderr lines as they come."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.engine.cli", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return (proc, *_watch_stderr(proc))


def _watch_stderr(proc: subprocess.Popen) -> tuple[Any, list[str]]:
    """An event set once `proc` logs that its engine is ready, and its stderr lines so far
    (read by a thread, which also keeps the pipe from filling up)."""
    import threading

    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "engine ready" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return ready, lines


def _generate_args(folder: Path, tp: int) -> list[str]:
    prompts = [f"t{i} t{i + 1} t{i + 2}" for i in range(5, 13)]
    return ["generate", *prompts, "--model", str(folder), "--device", "cpu", "--dtype",
            "float32", "--max-tokens", "200", "--quiet", "--kv-cache-gb", "0.01", "--swap-space",
            "0.01", "-tp", str(tp), "--distributed-timeout", "120"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pagedkv_generate_exits_non_zero_naming_the_dead_rank_and_leaves_no_process(checkpoints):
    """`pagedkv generate -tp 4` with one of its three workers killed mid-run: the command
    says which rank died and exits with code 1 within 10 s; the other two workers are stopped
    too (no orphan)."""
    proc, ready, lines = _start_cli(_generate_args(checkpoints["opt-prenorm"], 4))
    try:
        assert ready.wait(200), "".join(lines)[-3000:]
        workers = _child_workers(proc.pid)
        assert len(workers) == 3, workers
        time.sleep(1.0)  # generating now
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(30)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines)
    assert code == 1, err[-3000:]
    assert took < 10, took
    assert re.search(rf"error: tensor-parallel worker rank [123] \(pid {victim}\) was killed by "
                     "signal SIGKILL", err), err[-3000:]
    assert not [w for w in workers if _alive(w)], "workers left running"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_driver_is_killed(checkpoints):
    """SIGKILL gives the driver no chance to stop its workers: they notice it is gone."""
    proc, ready, lines = _start_cli(_generate_args(checkpoints["llama-gqa-tied"], 2))
    try:
        assert ready.wait(200), "".join(lines)[-3000:]
        workers = _child_workers(proc.pid)
        assert len(workers) == 1, workers
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _alive(workers[0]), "the worker outlived its driver by 10 s"


def test_heartbeat_watcher_names_the_rank_that_stops_beating(monkeypatch):
    """The torchrun ranks' heartbeat: a rank that beats is never reported; one that stops is
    reported once, after the silence (here shortened)."""
    import threading

    from pagedkv.engine.distributed import heartbeat

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.02)
    beats = {r: heartbeat.start_beating(r) for r in (1, 2)}
    silent: list[int] = []
    done = threading.Event()
    watcher = heartbeat.HeartbeatWatcher([1, 2], lambda r: (silent.append(r), done.set()),
                                         silence=0.3)
    try:
        time.sleep(0.5)
        assert silent == []  # both beat
        beats[2].set()  # rank 2 stops
        stopped = time.monotonic()
        assert done.wait(5)
        assert silent == [2] and time.monotonic() - stopped > 0.2  # not at the first quiet poll
        time.sleep(0.2)
        assert silent == [2]  # reported once
    finally:
        watcher.stop()
        beats[1].set()


# --------------------------------------------------------------------------- torchrun, 2 "machines"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun_two_nodes(command: list[str]) -> list[subprocess.Popen]:
    """`torchrun --nnodes 2 --nproc-per-node 1 -m pagedkv.engine.cli COMMAND`, once per
    "machine" (node rank 0 and 1), both on this host over loopback: the two-host launch of
    docs/tensor-parallel.md with 127.0.0.1 as the first machine's address."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    return [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "-m", "pagedkv.engine.cli", *command, "--tensor-parallel-size", "2",
             "--distributed-timeout", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )
        for node in (0, 1)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each; kills what is still running after `timeout`."""
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n[killed by the test: still running]"
        results.append((proc.returncode, out, err))
    return results


_GENERATE = ["generate", "t5 t6 t7 t8", "t100 t3", "--device", "cpu", "--dtype", "float32",
             "--max-tokens", "12", "--quiet", "--kv-cache-gb", "0.01", "--swap-space", "0.01"]


@pytest.mark.slow
def test_torchrun_two_nodes_generate_prints_what_one_process_prints(checkpoints, capsys):
    """`torchrun --nnodes 2 --nproc-per-node 1 ... pagedkv generate -tp 2` (node 1's rank
    becomes the worker of rank 0's engine) prints what `pagedkv generate` prints, and both
    launches exit 0."""
    from pagedkv.engine.cli import main

    command = [*_GENERATE, "--model", str(checkpoints["llama-gqa-bias"])]
    assert main(command) == 0
    expected = capsys.readouterr().out
    assert expected.count("--- prompt") == 2
    (code0, out0, err0), (code1, out1, err1) = _finish(_torchrun_two_nodes(command), 240)
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    assert out0 == expected, (out0, err0[-2000:])
    assert "--- prompt" not in out1  # the worker runs no command of its own


@pytest.mark.slow
def test_torchrun_two_nodes_rank_0_names_a_dead_rank_and_exits(checkpoints):
    """Node 1's rank killed mid-run: rank 0 (which cannot see another machine's processes)
    names it from its silent heartbeat and exits non-zero within 10 s; nothing hangs."""
    command = _generate_args(checkpoints["llama-gqa-tied"], 2)
    command = command[: command.index("-tp")]  # _torchrun_two_nodes adds the size
    procs = _torchrun_two_nodes(command)
    ready, lines = _watch_stderr(procs[0])
    try:
        assert ready.wait(200), "".join(lines)[-3000:]
        workers = [pid for pid in _children(procs[1].pid) if b"pagedkv" in _cmdline(pid)]
        assert len(workers) == 1, "node 1's rank is not the agent's one child"
        time.sleep(1.0)  # generating now
        assert procs[0].poll() is None, "rank 0 ended before the kill"
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        code0 = procs[0].wait(60)
        took = time.monotonic() - start
    finally:
        _finish(procs, 30)
    err0 = "".join(lines)
    assert code0 != 0, err0[-3000:]
    assert took < 10, took
    assert "error: tensor-parallel rank 1 stopped responding" in err0, err0[-3000:]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
def test_torchrun_two_nodes_serve_answers_like_one_device(checkpoints):
    """The documented two-machine `pagedkv serve --tensor-parallel-size 2` under torchrun,
    rehearsed on one host: the server on rank 0 answers a completion with the tokens of the
    unsplit model, and SIGTERM to rank 0's server stops both machines' processes cleanly
    (every exit code 0)."""
    import urllib.error

    from pagedkv.engine.llm import LLM

    folder = str(checkpoints["llama-gqa-bias"])
    prompt, params = "t5 t6 t7 t8", SamplingParams(max_tokens=10, temperature=0.0)
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_gb=0.01, swap_space=0.01)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    del llm
    port = _free_port()
    procs = _torchrun_two_nodes(["serve", folder, "--port", str(port), "--device", "cpu",
                                 "--dtype", "float32", "--kv-cache-gb", "0.01", "--swap-space",
                                 "0.01"])  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 200
        status = None
        while time.monotonic() < deadline and procs[0].poll() is None:
            try:
                status, _ = _http("GET", f"{base}/health")
            except (urllib.error.URLError, ConnectionError, OSError):
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, "the server did not come up"
        status, body = _http("POST", f"{base}/v1/completions", {
            "model": _http("GET", f"{base}/v1/models")[1]["data"][0]["id"], "prompt": prompt,
            "max_tokens": 10, "temperature": 0.0})  # fmt: skip
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        # SIGTERM to rank 0's process (torchrun itself reports any signal as a failure)
        rank0 = [pid for pid in _children(procs[0].pid) if b"pagedkv" in _cmdline(pid)]
        assert len(rank0) == 1
        os.kill(rank0[0], signal.SIGTERM)
    finally:
        results = _finish(procs, 60)
    for code, _, err in results:
        assert code == 0, err[-3000:]


# --------------------------------------------------------------------------- GPU (NCCL)

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (tensor parallelism over NCCL)"
)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", ["llama-gqa-bias", "opt-postnorm-proj"])
@pytest.mark.parametrize(
    ("eager", "async_scheduling"), [(False, True), (False, False), (True, True)],
    ids=["graphs-async", "graphs-plain", "eager-async"],
)
def test_gpu_tp2_greedy_tokens_equal_tp1(checkpoints, name, eager, async_scheduling):
    """Over NCCL: the same tokens as one GPU, with the decode passes replayed from CUDA graphs
    (all-reduces captured inside) on every rank, or eagerly, with asynchronous scheduling or
    without."""
    requests = [(p, _greedy()) for p in PROMPTS]
    kw = dict(gpu_memory_utilization=0.3, enforce_eager=eager, max_num_seqs=16,
              async_scheduling=async_scheduling)
    ref, got = _tp1_vs_tp2(checkpoints[name], requests, device="cuda", **kw)
    assert got["tokens"] == ref["tokens"]
    rank0 = got["ranks"][0]
    if eager:
        assert rank0["graph_replays"] == 0 == rank0["num_graphs"]
    else:  # every decode pass of up to 16 sequences replays a graph, on every rank
        assert rank0["num_graphs"] == len(graph_batch_sizes(16))  # 1, 2, 4, 8, 16
        assert rank0["graph_replays"] > rank0["eager_passes"] > 0
    if async_scheduling:
        assert rank0["steps_with_pending"] > 0


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("scenario", ["async", "idle"])
def test_gpu_a_dead_worker_stops_the_engine_at_once(checkpoints, tmp_path, scenario):
    """Over NCCL a collective with a dead peer does not fail by itself: the monitor aborts the
    communicators, and the engine raises within seconds (CUDA graphs, asynchronous steps)."""
    script = tmp_path / "dead_worker.py"
    script.write_text(_DEAD_WORKER_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), scenario, str(checkpoints["llama-gqa-tied"]), "60", "cuda"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    message = f"worker rank 1 (pid {result['pid']}) was killed by signal SIGKILL"
    assert result["errors"] and all(e and message in e for e in result["errors"]), result
    assert result["seconds"] < 10 and result["children"] == 0


@pytest.mark.gpu
@two_gpus
def test_gpu_tp2_equals_tp1_under_preemption(checkpoints):
    requests = [(p, _greedy(24)) for p in PROMPTS]
    requests.append((PROMPTS[3], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24)))
    kw = dict(num_gpu_blocks_override=8, block_size=8, preemption_mode="swap", max_num_seqs=4)
    ref, got = _tp1_vs_tp2(checkpoints["llama-gqa-tied"], requests, device="cuda", **kw)
    assert ref["stats"].num_preemptions > 0
    assert got["tokens"] == ref["tokens"]


@pytest.mark.gpu
@two_gpus
def test_gpu_tp2_dummy_bf16_runs_with_cuda_graphs(checkpoints):
    """bf16 dummy weights with CUDA graphs, the benchmark setting. Split sums round differently
    in bf16 and dummy logits are flat, so tokens are not compared, only that it runs through."""
    requests = [(p, _greedy(8)) for p in PROMPTS]
    kw = dict(load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=16)
    _, got = _tp1_vs_tp2(checkpoints["llama-gqa-bias"], requests, device="cuda", **kw)
    assert all(len(t[0]) == 8 for t in got["tokens"])


def test_dead_worker_message_names_the_signal():
    from pagedkv.engine.distributed.executor import _Workers

    workers = _Workers()
    workers.failure = (1, 1234, -signal.SIGKILL)
    assert "rank 1 (pid 1234) was killed by signal SIGKILL" in workers.describe_failure()
    workers.failure = (3, 99, 1)
    assert "rank 3 (pid 99) exited with code 1" in workers.describe_failure()


def test_runner_attributes_read_rank_0s_but_methods_must_be_forwarded():
    """A `ModelRunner` method the engine starts calling must reach the workers too: reading it
    through the tensor-parallel runner is an error rather than a silent rank-0-only call."""
    from types import SimpleNamespace

    from pagedkv.engine.distributed.executor import TensorParallelRunner

    runner = object.__new__(TensorParallelRunner)
    runner.local = SimpleNamespace(max_blocks_per_seq=7, warm_up=lambda: None)
    assert runner.max_blocks_per_seq == 7
    with pytest.raises(AttributeError, match="not forwarded to the tensor-parallel workers"):
        runner.warm_up()


@pytest.mark.slow
def test_tp_diag_script_reports_every_rank_s_steps_by_kind(checkpoints, one_thread, monkeypatch,
                                                           tmp_path, capsys):
    """`scripts/tp_diag.py` (PAGEDKV_TP_DIAG=1) on the CPU: each rank reports the same steps by
    kind of pass as the other and as `rank_stats` counts; the worker's time blocked for the
    message and every rank's wait at the step's start (the probe all-reduce) are measured; the
    GPU column is absent off the GPU."""
    import importlib.util

    monkeypatch.setenv("PAGEDKV_TP_DIAG", "1")
    spec = importlib.util.spec_from_file_location("tp_diag", REPO / "scripts" / "tp_diag.py")
    tp_diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_diag)
    out_json = tmp_path / "diag.json"
    rc = tp_diag.main([
        "--model", str(checkpoints["llama-gqa-bias"]), "--device", "cpu", "--dtype", "float32",
        "--tensor-parallel-size", "2", "--async-scheduling", "--kv-cache-gb", "0.01",
        "--swap-space", "0.01", "--distributed-timeout", "60", "--num-prompts", "12",
        "--input-len", "9", "--output-len", "6", "--output-json", str(out_json),
    ])
    assert rc == 0
    assert not multiprocessing.active_children()
    result = json.loads(out_json.read_text())
    timings, stats = result["rank_timings"], result["rank_stats"]
    assert len(timings) == 2
    steps = [{key: row["steps"] for key, row in t.items()} for t in timings]
    assert steps[0] == steps[1], "the ranks ran different passes"
    assert sum(steps[0].values()) == stats[0]["steps"] - result["warmup_steps"] > 0
    kinds = {key.rsplit(" ", 1)[0] for key in steps[0]}
    assert kinds == {"prefill/mixed", "decode-eager"}  # CPU: no CUDA graphs
    for rank, t in enumerate(timings):
        for row in t.values():
            assert "gpu_ms" not in row
            assert row["sync_ms"]["median"] >= 0 and row["host_ms"]["median"] > 0
            assert (row["wait_ms"]["total"] > 0) == (rank == 1)  # only workers wait for it
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "decode-eager 1-64" in printed
