"""Gather the tensor-parallel runs of scripts/gpu_tp_run.sh into one result file.

    python3 scripts/tp_assemble.py --output docs/performance/tensor_parallel.json PATH...

Each PATH is a folder a call wrote (``$OUT/logs``: ``llama8b_tp1``, ``llama8b_tp2``,
``llama70b_tp2`` as ``.json`` from ``pagedkv bench throughput --output-json`` with ``.log`` and
``.cmd`` beside it, ``env_tp.txt``, ``tp_allreduce_8b.json``), or a ``tensor_parallel.json``
this script wrote before (one per GPU call: they are merged, later paths win run by run).

The result holds the issue's figures: ``llama8b_tp1_output_tok_s``,
``llama8b_tp2_output_tok_s``, ``llama70b_tp2_output_tok_s``, ``llama8b_tp2_over_tp1``; per run
(``runs.<name>``) its ``commit``, ``roofline_frac``, the host-wait split of its decode passes
(median host wait and GPU time, overall and per batch-size band), exit code and processes left
behind; NCCL's share of the decode step (``allreduce``); and ``goals``, each target of the issue
with the measured value and whether it is met.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RUNS = {
    "llama8b_tp1": ("meta-llama/Meta-Llama-3-8B", 1),
    "llama8b_tp2": ("meta-llama/Meta-Llama-3-8B", 2),
    "llama70b_tp2": ("meta-llama/Meta-Llama-3-70B", 2),
}
# copied from the bench's result as they are
_BENCH_KEYS = (
    "output_tok_s", "total_tok_s", "requests_per_s", "num_prompts", "prompt_tokens",
    "output_tokens", "seconds", "num_gpu_blocks", "max_num_seqs", "roofline_frac",
    "roofline_bound_s", "hbm_gb_s", "matmul_tflop_s", "forward_passes",
    "decode_passes", "decode_step_ms", "decode_step_bound_ms", "decode_roofline_frac",
    "decode_gpu_ms", "decode_host_gap_ms", "decode_gpu_seconds", "decode_host_gap_seconds",
    "mixed_passes", "mixed_step_ms", "mixed_step_bound_ms", "mixed_gpu_ms", "mixed_host_gap_ms",
    "triton_compiles_during_run",
)  # fmt: skip
TARGETS = {"tp2_over_tp1": 1.6, "host_wait_ms": 0.3, "llama70b_roofline_frac": 0.75}


def _files(paths: list[Path]) -> tuple[dict[str, Path], list[dict]]:
    """Raw run files by name, and earlier assembled results, in the order given."""
    found: dict[str, Path] = {}
    assembled: list[dict] = []
    for path in paths:
        for f in sorted(path.iterdir()) if path.is_dir() else [path]:
            if not f.is_file():
                continue
            if f.name == "tensor_parallel.json" or (f.suffix == ".json" and _is_assembled(f)):
                assembled.append(json.loads(f.read_text()))
            else:
                found[f.name] = f
    return found, assembled


def _is_assembled(f: Path) -> bool:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "runs" in data and "llama8b_tp2_over_tp1" in data


def _run_details(name: str, files: dict[str, Path]) -> dict | None:
    """One run from its raw files; None when this call did not run it."""
    result, log, cmd = (files.get(f"{name}{ext}") for ext in (".json", ".log", ".cmd"))
    if result is None and log is None:
        return None
    model, tp = RUNS[name]
    row: dict = {"model": model, "tensor_parallel_size": tp}
    if result is not None:
        data = json.loads(result.read_text())
        row.update({k: data[k] for k in _BENCH_KEYS if k in data})
        row["commit"] = data.get("env", {}).get("commit")
        bands = data.get("decode_host_gap_by_batch", {})
        row["host_wait"] = {
            "decode_median_ms": data.get("decode_host_gap_ms"),
            "decode_gpu_median_ms": data.get("decode_gpu_ms"),
            "by_batch": {
                band: {"passes": v.get("passes"),
                       "host_wait_median_ms": v.get("host_gap_ms_median"),
                       "host_wait_mean_ms": v.get("host_gap_ms_mean"),
                       "gpu_median_ms": v.get("gpu_ms_median", v.get("gpu_ms_mean"))}
                for band, v in bands.items()
            },
        }  # fmt: skip
    if log is not None:
        text = log.read_text(errors="replace")
        if m := re.search(r"engine ready: .*?(\d+) KV blocks of (\d+) tokens", text):
            row["kv_blocks_per_rank"] = int(m.group(1))
            row["kv_tokens"] = int(m.group(1)) * int(m.group(2))
        if m := re.search(r"exit (\d+) after (\d+) s", text):
            row["exit_code"], row["wall_s"] = int(m.group(1)), int(m.group(2))
        if m := re.search(r"leftover processes: (\d+)", text):
            row["leftover_processes"] = int(m.group(1))
    if cmd is not None:
        row["command"] = cmd.read_text().strip().replace(
            "python3 -m pagedkv.bench.throughput", "pagedkv bench throughput")
    if row.get("output_tok_s") is None:
        row["output_tok_s"] = None
        row["note"] = "no result: the run failed or timed out (see its log)"
    return row


def _band_max_median(run: dict | None) -> float | None:
    """The largest per-band median host wait of a run's decode passes."""
    bands = ((run or {}).get("host_wait") or {}).get("by_batch") or {}
    values = [b["host_wait_median_ms"] for b in bands.values()
              if b.get("host_wait_median_ms") is not None]
    return max(values) if values else None


def _goals(runs: dict[str, dict]) -> dict:
    tp1, tp2 = (runs.get(n, {}).get("output_tok_s") for n in ("llama8b_tp1", "llama8b_tp2"))
    ratio = tp2 / tp1 if tp1 and tp2 else None
    wait = _band_max_median(runs.get("llama8b_tp2"))
    roof = runs.get("llama70b_tp2", {}).get("roofline_frac")
    clean = [r.get("exit_code") == 0 and r.get("leftover_processes", 0) == 0
             for r in runs.values() if "exit_code" in r]
    return {
        "llama8b_tp2_over_tp1": {"target": f">= {TARGETS['tp2_over_tp1']}", "value": ratio,
                                 "met": ratio is not None and ratio >= TARGETS["tp2_over_tp1"]},
        "llama8b_tp2_host_wait_ms_worst_band_median": {
            "target": f"<= {TARGETS['host_wait_ms']}", "value": wait,
            "met": wait is not None and wait <= TARGETS["host_wait_ms"]},
        "llama70b_tp2_roofline_frac": {
            "target": f">= {TARGETS['llama70b_roofline_frac']}", "value": roof,
            "met": roof is not None and roof >= TARGETS["llama70b_roofline_frac"]},
        "every_run_exits_0_and_leaves_no_process": {
            "value": f"{sum(clean)} of {len(clean)} runs", "met": bool(clean) and all(clean)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="folders or files of the runs")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    files, assembled = _files(args.paths)
    runs: dict[str, dict] = {}
    allreduce = None
    hardware = versions = None
    for earlier in assembled:
        for name, run in earlier.get("runs", {}).items():
            if run.get("output_tok_s") is not None or name not in runs:
                runs[name] = run
        allreduce = earlier.get("allreduce") or allreduce
        hardware = earlier.get("hardware") or hardware
        versions = earlier.get("versions") or versions
    for name in RUNS:
        row = _run_details(name, files)
        if row is not None and (row.get("output_tok_s") is not None or name not in runs):
            runs[name] = row
    if "tp_allreduce_8b.json" in files:
        allreduce = json.loads(files["tp_allreduce_8b.json"].read_text())
    if "env_tp.txt" in files:
        lines = [line.strip() for line in files["env_tp.txt"].read_text().splitlines()]
        gpus = [line.split(",")[0] for line in lines if "H200" in line or "NVIDIA" in line]
        gpus = [g for g in gpus if not g.startswith("name")]
        hardware = f"{len(gpus)}x {gpus[0]}" if gpus else hardware
        versions = next((line for line in lines if line.startswith("python ")), versions)
    runs = {name: runs[name] for name in RUNS if name in runs}
    commits = {r.get("commit") for r in runs.values() if r.get("commit")}
    tok_s = {name: runs.get(name, {}).get("output_tok_s") for name in RUNS}
    tp1, tp2 = tok_s["llama8b_tp1"], tok_s["llama8b_tp2"]
    result = {
        "title": "Tensor parallelism: offline throughput, Llama-3 shapes, dummy bf16 weights",
        "description": (
            "pagedkv bench throughput on a ShareGPT-like workload (every request runs to its "
            "sampled output length), dummy weights of the real model shapes in bfloat16, CUDA "
            "graphs and asynchronous scheduling on; tensor parallelism over NCCL on the GPUs of "
            "one machine. The 70B shape does not fit one GPU, so it runs at TP 2 only. Host "
            "wait: per decode pass, its wall time minus the GPU's time on it (rank 0)."
        ),
        "command": "bash scripts/gpu_tp_run.sh llama8b allreduce assemble; "
                   "bash scripts/gpu_tp_run.sh llama70b tests assemble",
        "hardware": hardware,
        "versions": versions,
        "commit": ", ".join(sorted(commits)) or None,
        "workload": "sharegpt",
        "llama8b_tp1_output_tok_s": tp1,
        "llama8b_tp2_output_tok_s": tp2,
        "llama70b_tp2_output_tok_s": tok_s["llama70b_tp2"],
        "llama8b_tp2_over_tp1": (tp2 / tp1) if tp1 and tp2 else None,
        "goals": _goals(runs),
        "allreduce": allreduce,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k.endswith(("_tok_s", "_over_tp1"))}
    summary["goals_met"] = {k: g["met"] for k, g in result["goals"].items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
