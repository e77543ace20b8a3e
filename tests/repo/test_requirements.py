"""What `./dev serve` installs is what serving needs and no more (issue 18, item 7): the pins in
requirements/serve.txt are the runtime dependencies of the packages that serve, the test pins
cover them, and the serve path runs no browser installer."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("kvblocks", "pagedattn-kernels", "scheduler", "engine", "server")
SIBLINGS = {"kvblocks", "pagedattn-kernels", "pagedkv-scheduler", "pagedkv-engine"}
BUILD = {"hatchling", "editables"}  # build the editable installs (--no-build-isolation)


def _pins(name: str) -> dict[str, Requirement]:
    reqs = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-r"):
            req = Requirement(line)
            assert len(req.specifier) == 1 and str(req.specifier).startswith("=="), line
            reqs[req.name.lower()] = req
    return reqs


def _runtime_dependencies() -> set[str]:
    names: set[str] = set()
    for folder in SERVING:
        meta = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
        for dep in meta["project"]["dependencies"]:
            names.add(Requirement(dep).name.lower())
    return names - SIBLINGS


def test_serve_pins_are_the_serving_packages_dependencies() -> None:
    serve = set(_pins("serve.txt"))
    runtime = _runtime_dependencies()
    # Triton is the one runtime dependency left out (CPU serving runs the torch path; CUDA builds
    # of torch bring it); pydantic and anyio come pinned through fastapi.
    assert serve - BUILD <= runtime, sorted(serve - BUILD - runtime)
    assert runtime - serve <= {"triton", "pydantic", "anyio"}, sorted(runtime - serve)
    assert not serve & {"pytest", "sphinx", "jupyterlab", "playwright", "schemathesis", "triton"}


def test_test_pins_include_the_serve_pins_and_agree() -> None:
    text = (ROOT / "requirements" / "test.txt").read_text()
    assert re.search(r"^-r serve\.txt$", text, re.M)
    assert not set(_pins("serve.txt")) & set(_pins("test.txt"))  # one pin per package
    assert "torch" in _pins("serve.txt") and str(_pins("serve.txt")["torch"].specifier) == "==2.13.0"


def test_dev_serve_installs_serve_requirements_without_the_browser() -> None:
    dev = (ROOT / "dev").read_text()
    setup = dev[dev.index("setup() {"): dev.index("run_tests() {")]
    assert "requirements/serve.txt" in setup and "requirements/test.txt" in setup
    browser = setup.index("install-browser.sh")
    assert setup.rindex('if [ "$what" = test ]', 0, browser) > 0  # only for the tests
    assert re.search(r"serve\) setup serve;", dev) and re.search(r"test\) setup test;", dev)
