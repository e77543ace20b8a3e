"""Gather the tensor-parallel throughput runs of scripts/gpu_tp_run.sh into one result file.

    python3 scripts/tp_assemble.py --output docs/performance/tensor_parallel.json DIR_OR_FILE...

Reads ``llama8b_tp1``, ``llama8b_tp2`` and ``llama70b_tp2`` (``.json`` written by
``pagedkv bench throughput --output-json``, ``.log`` and ``.cmd`` beside it) and ``env_tp.txt``
from the given folders or files (later ones win), and writes the figures the docs show:
``llama8b_tp1_output_tok_s``, ``llama8b_tp2_output_tok_s``, ``llama70b_tp2_output_tok_s`` (null
when a run did not finish), per-run details, and the hardware, versions, commit and commands.
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


def _files(paths: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in paths:
        for f in sorted(path.iterdir()) if path.is_dir() else [path]:
            if f.is_file():
                found[f.name] = f
    return found


def _run_details(name: str, files: dict[str, Path]) -> dict:
    model, tp = RUNS[name]
    row: dict = {"model": model, "tensor_parallel_size": tp}
    result = files.get(f"{name}.json")
    if result is not None:
        data = json.loads(result.read_text())
        for key in ("output_tok_s", "total_tok_s", "requests_per_s", "num_prompts",
                    "prompt_tokens", "output_tokens"):  # fmt: skip
            if key in data:
                row[key] = data[key]
        row["commit"] = data.get("env", {}).get("commit")
    log = files.get(f"{name}.log")
    if log is not None:
        text = log.read_text(errors="replace")
        if m := re.search(r"engine ready: .*?(\d+) KV blocks of (\d+) tokens", text):
            row["kv_blocks_per_rank"] = int(m.group(1))
            row["kv_tokens"] = int(m.group(1)) * int(m.group(2))
        if m := re.search(r"exit (\d+) after (\d+) s", text):
            row["exit_code"], row["wall_s"] = int(m.group(1)), int(m.group(2))
    cmd = files.get(f"{name}.cmd")
    if cmd is not None:
        row["command"] = cmd.read_text().strip().replace("python3 -m pagedkv.engine.cli", "pagedkv")
    if "output_tok_s" not in row:
        row["output_tok_s"] = None
        row["note"] = "no result: the run failed or timed out (see its log)"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="folders or files of the runs")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    files = _files(args.paths)
    runs = {name: _run_details(name, files) for name in RUNS}
    env_lines = []
    if "env_tp.txt" in files:
        env_lines = [line.strip() for line in files["env_tp.txt"].read_text().splitlines()]
    gpus = [line.split(",")[0] for line in env_lines if "H200" in line or "NVIDIA" in line]
    versions = next((line for line in env_lines if line.startswith("python ")), None)
    commits = {r.get("commit") for r in runs.values() if r.get("commit")}
    tp1, tp2 = runs["llama8b_tp1"]["output_tok_s"], runs["llama8b_tp2"]["output_tok_s"]
    result = {
        "title": "Tensor parallelism: offline throughput, Llama-3 shapes, dummy bf16 weights",
        "description": (
            "pagedkv bench throughput on a ShareGPT-like workload (every request runs to its "
            "sampled output length), dummy weights of the real model shapes in bfloat16, CUDA "
            "graphs on; tensor parallelism over NCCL on the GPUs of one machine. The 70B shape "
            "does not fit one GPU, so it runs at TP 2 only."
        ),
        "command": "bash scripts/gpu_tp_run.sh tests llama8b llama70b assemble",
        "hardware": f"{len(gpus)}x {gpus[0]}" if gpus else None,
        "versions": versions,
        "commit": ", ".join(sorted(commits)) or None,
        "workload": "sharegpt",
        "llama8b_tp1_output_tok_s": tp1,
        "llama8b_tp2_output_tok_s": tp2,
        "llama70b_tp2_output_tok_s": runs["llama70b_tp2"]["output_tok_s"],
        "llama8b_tp2_over_tp1": (tp2 / tp1) if tp1 and tp2 else None,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.endswith(("_tok_s", "_over_tp1"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
