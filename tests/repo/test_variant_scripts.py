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


def test_time_row_and_layer_sums(monkeypatch) -> None:
    """The GPU-only part of the matmul scripts, with the CUDA-graph timer replaced: a row
    timed (its fraction of the copy bandwidth), a row that fails kept with its error, and
    per M the layer's sum of each variant's fastest rows against bf16's."""
    pytest.importorskip("triton")
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    mod = importlib.import_module("fp8_weight_only_gemm")
    times = iter([2.0, 1.0, 4.0, 3.0, 2.0])
    monkeypatch.setattr(mod, "bench", lambda fn: (fn(), next(times))[1])
    w = [torch.ones(4, 8)]
    x = torch.ones(2, 8)
    rows = []
    for op, variant in (("a", "bf16"), ("a", "pick"), ("b", "bf16"), ("b", "pick"), ("a", "pick")):
        row = {"op": op, "n": 4, "k": 8, "m": 2, "variant": variant}
        rows.append(mod.time_row(row, None, lambda w, x=x: x @ w.T, w, x @ w[0].T, 2000, 1.0))

    def broken(w):
        raise RuntimeError("out of shared memory")
    rows.append(mod.time_row({"op": "b", "n": 4, "k": 8, "m": 2, "variant": "pick"}, None,
                             broken, w, x @ w[0].T, 2000, 1.0))  # fmt: skip
    assert rows[0]["us"] == 2.0 and rows[0]["bw_frac"] == pytest.approx(1e-3)
    assert "error" in rows[-1] and "us" not in rows[-1]
    layer = mod.layer_sums(rows, [2], ["a", "b"], ("bf16", "pick"))
    assert layer == [{"m": 2, "bf16_us": 6.0, "pick_us": 4.0, "pick_vs_bf16": 1.5}]
    assert rows[1]["vs_bf16"] == 2.0


def test_engine_shapes_parses_config_fields(monkeypatch) -> None:
    """``--configs`` items: TILE_N/WARPS/STAGES[/PER_SM], then ``+FIELD`` (a boolean field set
    true) or ``+FIELD=INT``; an unknown field is refused by ``DecodeConfig`` itself."""
    pytest.importorskip("triton")
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    mod = importlib.import_module("decode_fp8_engine_shapes")
    a, b = mod.parse_configs("128/4/2/3+one_loop+saturate_per_sm=2,32/1/3")
    assert (a.tile_n, a.num_warps, a.num_stages, a.per_sm) == (128, 4, 2, 3)
    assert a.one_loop and a.saturate_per_sm == 2
    assert (b.tile_n, b.num_warps, b.num_stages, b.per_sm, b.one_loop) == (32, 1, 3, 2, False)
    with pytest.raises(TypeError):
        mod.parse_configs("64/1/2+no_such_field")
