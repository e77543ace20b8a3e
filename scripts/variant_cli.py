"""What the kernel-variant diagnosis scripts (``prefill_variants.py``,
``decode_fp8_variants.py``) share: the common options, the CPU check or the GPU gate, and the
JSON result with the command, commit and versions that made it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.testing

log = logging.getLogger("variants")


def add_common_args(ap: argparse.ArgumentParser, budget_s: float) -> None:
    ap.add_argument("--check", action="store_true",
                    help="only check the variants' outputs (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=budget_s)
    ap.add_argument("--output-json")
    ap.add_argument("--commit", default="")


def check_or_gpu(args: argparse.Namespace, check: Callable[[], int]) -> int | None:
    """An exit code when there is nothing to time (``--check`` ran, or no GPU), else None."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        return 1 if check() else 0
    if not torch.cuda.is_available():
        log.error("timing needs a GPU (use --check on the CPU)")
        return 2
    return None


@dataclass(frozen=True)
class TimingRun:
    """What a timing run starts from: its options, when to stop starting new rows, the copy
    bandwidth its fractions are of, and a seeded CUDA generator."""

    args: argparse.Namespace
    deadline: float
    copy_bw: float
    gen: torch.Generator


def start(ap: argparse.ArgumentParser, check: Callable[[], int],
          budget_s: float) -> TimingRun | int:  # fmt: skip
    """Add the common options, parse, and either return an exit code (``--check`` ran, or no
    GPU: ``check_or_gpu``) or start the timing run."""
    add_common_args(ap, budget_s=budget_s)
    args = ap.parse_args()
    if (code := check_or_gpu(args, check)) is not None:
        return code
    deadline = time.monotonic() + args.budget_s
    return TimingRun(args, deadline, copy_bandwidth_tbps(),
                     torch.Generator(device="cuda").manual_seed(0))  # fmt: skip


def copy_bandwidth_tbps() -> float:
    """The GPU's device-to-device copy bandwidth in TB/s (bytes read plus written, a 256 MiB
    buffer): what the scripts' bandwidth fractions are fractions of."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e9


def write_result(args: argparse.Namespace, benchmark: str, script: str,
                 **fields: Any) -> None:  # fmt: skip
    """Print the result as one JSON line and write it to ``--output-json``."""
    result = {"benchmark": benchmark, "commit": args.commit,
              "command": f"python scripts/{script} " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, **fields}  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(json.dumps(result))
