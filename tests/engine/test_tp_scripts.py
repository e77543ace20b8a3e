"""The GPU scripts of tensor parallelism, run here so that the GPU call does not fail on them:
scripts/tp_assemble.py on the files a call writes (and on two calls' results merged), and
scripts/tp_allreduce_share.py under torchrun on the CPU (gloo, eager passes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _assemble():
    spec = importlib.util.spec_from_file_location("tp_assemble", REPO / "scripts/tp_assemble.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_result(tok_s: float, commit: str, wait_ms: float, roofline: float) -> dict:
    """What `pagedkv bench throughput --output-json` writes, the keys the assembler reads."""
    bands = {"1-64": (1000, wait_ms / 2), "513-1024": (200, wait_ms)}
    return {
        "output_tok_s": tok_s, "num_prompts": 1000, "output_tokens": 337186, "seconds": 20.0,
        "roofline_frac": roofline, "decode_host_gap_ms": wait_ms / 3, "decode_gpu_ms": 4.0,
        "decode_step_ms": 4.2, "env": {"commit": commit, "command": "..."},
        "decode_host_gap_by_batch": {
            band: {"passes": n, "host_gap_s": n * w / 1e3, "host_gap_ms_mean": w,
                   "host_gap_ms_median": w, "gpu_ms_mean": 5.0, "gpu_ms_median": 5.0}
            for band, (n, w) in bands.items()
        },
    }  # fmt: skip


def _call(folder: Path, runs: dict[str, dict], exit_code: int = 0, leftover: int = 0) -> Path:
    """The files one GPU call leaves in $OUT/logs."""
    folder.mkdir(parents=True)
    (folder / "env_tp.txt").write_text(
        "name, memory.total [MiB]\nNVIDIA H200, 143771 MiB\nNVIDIA H200, 143771 MiB\n"
        "python 3.12.3 torch 2.11.0+cu130 triton 3.6.0 transformers 5.17.0 nccl 2.28.9 gpus 2\n")
    for name, result in runs.items():
        (folder / f"{name}.json").write_text(json.dumps(result))
        (folder / f"{name}.log").write_text(
            f"INFO engine ready: x on cuda, 1234 KV blocks of 16 tokens\n"
            f"== {name}: exit {exit_code} after 99 s (limit 200 s)\n"
            f"== {name}: leftover processes: {leftover}\n")
        (folder / f"{name}.cmd").write_text(
            f"python3 -m pagedkv.bench.throughput --model m --tensor-parallel-size 2 ({name})")
    return folder


def test_assemble_merges_two_calls_into_the_issues_keys(tmp_path):
    tool = _assemble()
    first = _call(tmp_path / "call1", {"llama8b_tp1": _bench_result(10000.0, "abc1234", 0.1, 0.6),
                                       "llama8b_tp2": _bench_result(17000.0, "abc1234", 0.2, 0.5)})
    (first / "tp_allreduce_8b.json").write_text(json.dumps({"rows": [{"batch": 1}]}))
    second = _call(tmp_path / "call2", {"llama70b_tp2": _bench_result(3000.0, "abc1234", 0.4,
                                                                      0.8)}, leftover=1)
    out1, out2, out = (tmp_path / f"{n}.json" for n in ("a", "b", "merged"))
    assert tool.main(["--output", str(out1), str(first)]) == 0
    assert tool.main(["--output", str(out2), str(second)]) == 0
    # the integrator's merge of the two calls' results
    assert tool.main(["--output", str(out), str(out1), str(out2)]) == 0
    result = json.loads(out.read_text())
    assert result["llama8b_tp1_output_tok_s"] == 10000.0
    assert result["llama8b_tp2_output_tok_s"] == 17000.0
    assert result["llama70b_tp2_output_tok_s"] == 3000.0
    assert result["llama8b_tp2_over_tp1"] == pytest.approx(1.7)
    assert result["hardware"] == "2x NVIDIA H200" and result["commit"] == "abc1234"
    assert result["allreduce"] == {"rows": [{"batch": 1}]}
    runs = result["runs"]
    assert list(runs) == ["llama8b_tp1", "llama8b_tp2", "llama70b_tp2"]
    for run in runs.values():
        assert run["commit"] == "abc1234" and 0 < run["roofline_frac"] < 1
        assert run["exit_code"] == 0 and run["kv_blocks_per_rank"] == 1234
        assert set(run["host_wait"]["by_batch"]) == {"1-64", "513-1024"}
    assert runs["llama8b_tp2"]["host_wait"]["by_batch"]["513-1024"]["host_wait_median_ms"] == 0.2
    assert runs["llama70b_tp2"]["command"].startswith("pagedkv bench throughput")
    goals = result["goals"]
    assert goals["llama8b_tp2_over_tp1"]["met"] is True
    assert goals["llama8b_tp2_host_wait_ms_worst_band_median"] == {
        "target": "<= 0.3", "value": 0.2, "met": True}
    assert goals["llama70b_tp2_roofline_frac"]["met"] is True
    # the 70B run left a process behind
    assert goals["every_run_exits_0_and_leaves_no_process"] == {"value": "2 of 3 runs",
                                                                "met": False}


def test_assemble_says_when_a_run_has_no_result(tmp_path):
    tool = _assemble()
    folder = _call(tmp_path / "call", {"llama8b_tp1": _bench_result(10000.0, "abc", 0.1, 0.6)})
    (folder / "llama8b_tp2.log").write_text("== llama8b_tp2: exit 124 after 200 s (limit 200 s)\n")
    out = tmp_path / "r.json"
    assert tool.main(["--output", str(out), str(folder)]) == 0
    result = json.loads(out.read_text())
    assert result["llama8b_tp2_output_tok_s"] is None and result["llama8b_tp2_over_tp1"] is None
    assert result["runs"]["llama8b_tp2"]["exit_code"] == 124
    assert "no result" in result["runs"]["llama8b_tp2"]["note"]
    assert result["goals"]["llama8b_tp2_over_tp1"]["met"] is False
    assert "llama70b_tp2" not in result["runs"]


@pytest.mark.slow
def test_allreduce_share_script_runs_under_torchrun(tmp_path, checkpoint_folder):
    out = tmp_path / "share.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "scripts/tp_allreduce_share.py"), "--device", "cpu", "--dtype", "float32",
         "--model", str(checkpoint_folder), "--batch-sizes", "1,4", "--context", "32",
         "--iters", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tensor_parallel_size"] == 2 and result["all_reduces_per_step"] == 5
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["step_ms"] > 0 and row["compute_ms"] > 0 and row["all_reduce_ms"] > 0
        assert row["nccl_share"] == pytest.approx(1 - row["compute_ms"] / row["step_ms"])


@pytest.fixture
def checkpoint_folder(tmp_path) -> Path:
    """A 2-layer Llama config (no weights: the script loads dummy weights)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    folder = tmp_path / "tiny-llama"
    cfg.save_pretrained(folder)
    return folder
