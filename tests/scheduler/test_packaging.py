"""pagedkv.scheduler stays torch-free and installs alone with kvblocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_RUN = textwrap.dedent(
    """
    import sys
    import pagedkv.scheduler
    from pagedkv.scheduler import RequestParams, Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=8, max_model_len=32))
    s.add_request("r", [1, 2, 3], RequestParams(max_tokens=4))
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, {x.seq_id: [5] for x in out.scheduled if x.do_sample})
        steps += 1
    assert steps == 4, steps
    assert s.block_manager.num_free_blocks == 8
    heavy = [m for m in ("torch", "numpy", "matplotlib") if m in sys.modules]
    assert not heavy, heavy
    print("ok", pagedkv.scheduler.__file__)
    """
)


def test_import_does_not_load_torch():
    code = "import sys, pagedkv.scheduler; assert 'torch' not in sys.modules\n" + TINY_RUN
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_pagedkv_is_a_namespace_package():
    assert not (ROOT / "packages/scheduler/src/pagedkv/__init__.py").exists()


@pytest.mark.slow
def test_installs_alone_with_kvblocks_in_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    for pkg in ("kvblocks", "scheduler"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(wheels),
                str(ROOT / "packages" / pkg),
            ],
            check=True,
            timeout=300,
        )
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(names) == 2 and names[1].startswith("pagedkv_scheduler"), names
    venv = tmp_path / "venv"
    # A bare venv (no pip of its own, no site packages); this pip installs into it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    subprocess.run(
        [*pip, "install", "-q", "--no-index", "--no-deps"] + [str(p) for p in wheels.glob("*.whl")],
        check=True,
        timeout=300,
    )
    r = subprocess.run(
        [str(py), "-c", TINY_RUN], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout  # imported from the fresh venv, not the checkout
    # the wheel ships only its own subpackage of the pagedkv namespace
    r = subprocess.run(
        [*pip, "show", "-f", "pagedkv-scheduler"],
        capture_output=True,
        text=True,
        check=True,
    )
    files = [line.strip() for line in r.stdout.splitlines() if line.startswith("  ")]
    assert "pagedkv/__init__.py" not in files
    assert all(f.startswith(("pagedkv/scheduler/", "pagedkv_scheduler-")) for f in files), files
    # the simulator moved to pagedkv-bench (tests/bench/test_packaging.py runs it torch-free)
    assert not any(f.endswith(("/sim.py", "/bench.py", "/workloads.py")) for f in files), files
