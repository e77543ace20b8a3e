"""The kernel-variant diagnosis scripts (``scripts/*_variants.py``, ``fp8_weight_only_gemm.py``,
``decode_fp8_engine_shapes.py``, ``bf16_stream_gemm.py``) time on a GPU what their ``--check``
verifies on the CPU: every variant's output against a reference, in Triton's interpreter. A GPU session spends its few minutes on timing, so
a variant that computes the wrong thing has to fail here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["decode_fp8_variants.py", "prefill_variants.py", "fp8_weight_only_gemm.py",
           "decode_fp8_engine_shapes.py", "bf16_stream_gemm.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_variant_script_check_passes(script: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, f"{script} --check failed"
    assert "WRONG" not in done.stdout + done.stderr
