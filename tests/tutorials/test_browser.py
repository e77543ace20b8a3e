"""All six tutorials opened in JupyterLab in headless Chromium, as a learner would: run every
cell, move a control of the notebook's first re-run widget, check that the view was redrawn by
a new run of the real package, take a screenshot.

The notebooks are copies with the exercises' solutions filled in (a learner's blank would stop
"run all" at its check, by design). Chromium is Debian's (``scripts/install-browser.sh``);
Playwright drives it through ``executable_path`` and never downloads a browser. Screenshots are
saved under the test's tmp folder; with PAGEDKV_UPDATE_SCREENSHOT=1 the paging tutorial's is
copied to ``docs/_static/tutorial_screenshot.png``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
CHROMIUM = Path(os.environ.get("PAGEDKV_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NOTEBOOKS = sorted(p.name for p in TUTORIALS.glob("*.ipynb"))
RUN_ALL_TIMEOUT_MS = int(os.environ.get("PAGEDKV_BROWSER_TIMEOUT_S", "600")) * 1000

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(runner, kernel_name, tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 over solved copies of the notebooks (the committed ones
    stay clean), with the helper package beside them."""
    pytest.importorskip("jupyterlab")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    for name in NOTEBOOKS:
        nb = nbformat.read(TUTORIALS / name, as_version=4)
        steps = runner.plan(nb, runner.load_solutions(runner.solutions_path(TUTORIALS / name)),
                            check_blanks=False, file=name)  # fmt: skip
        nb.cells = [s.cell for s in steps]
        nb.metadata["kernelspec"]["name"] = kernel_name
        nbformat.write(nb, root / name)
    shutil.copytree(TUTORIALS / "pagedkv_tutorial_helpers", root / "pagedkv_tutorial_helpers",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    # Every cell in the page (no windowing), so that the widgets are there to find and drive.
    tracker = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # No news pop-up over the notebook in the screenshots.
    labconfig = Path(os.environ["JUPYTER_CONFIG_DIR"]) / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port, token = free_port(), "pagedkv-test-token"
    log_path = tmp / "jupyterlab.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
            "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
            f"--LabApp.user_settings_dir={tmp / 'settings'}",
            f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        ],
        env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail("JupyterLab did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(jupyterlab, tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/install-browser.sh (as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()


def shut_down_kernels(base: str, token: str) -> None:
    """Free the finished notebook's kernel (and its memory) before the next one starts."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.load(r)
    for s in sessions:
        req = urllib.request.Request(f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.removesuffix(".ipynb") for n in NOTEBOOKS])
def test_tutorial_runs_and_its_control_reruns_in_jupyterlab(notebook, jupyterlab, browser, tmp_path):
    base, token = jupyterlab
    page = browser.new_page()
    try:
        # reset: a fresh workspace, not the tabs the previous notebook left open
        page.goto(f"{base}/lab/tree/{notebook}?reset&token={token}", wait_until="domcontentloaded")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        page.wait_for_function(
            """() => {
                const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                const k = w && w.sessionContext && w.sessionContext.session
                    && w.sessionContext.session.kernel;
                return k && k.status === 'idle';
            }""",
            timeout=120_000,
        )
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_selector(".pagedkv-run", timeout=RUN_ALL_TIMEOUT_MS)
        page.wait_for_function(
            """() => {
                const w = window.jupyterapp.shell.currentWidget;
                const busy = [...document.querySelectorAll('.jp-InputArea-prompt')]
                    .some(e => e.textContent.includes('*'));
                return !busy && w.sessionContext.session.kernel.status === 'idle';
            }""",
            timeout=RUN_ALL_TIMEOUT_MS,
        )
        errors = page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'],"
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']"
        )
        tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
        assert not tracebacks, tracebacks
        assert page.get_by_text("running on").count() > 0
        solved = page.get_by_text("✓ exercise")
        assert solved.count() >= 2, "every exercise's check must pass with the solutions"

        # the first widget that re-runs the package: change its first dropdown
        rerun = page.locator(".widget-vbox").filter(has=page.locator(".pagedkv-run")).first
        rerun.scroll_into_view_if_needed()
        status = rerun.locator(".pagedkv-run")
        assert status.text_content().startswith("run 1:")
        view = rerun.locator(".pagedkv-view")
        before = view.inner_html()
        select = rerun.locator("select").first
        options = [o.replace("\xa0", " ") for o in select.locator("option").all_inner_texts()]
        current = select.evaluate("s => s.selectedIndex < 0 ? '' : s.options[s.selectedIndex].text")
        current = current.replace("\xa0", " ")
        choice = next(o for o in options if o != current)
        select.select_option(index=options.index(choice))
        # the status is redrawn ("running…", then "run 2: ..."): wait on the locator, not an element
        rerun.locator(".pagedkv-run", has_text="run 2:").wait_for(timeout=RUN_ALL_TIMEOUT_MS)
        assert choice in status.text_content(), (status.text_content(), choice)
        deadline = time.monotonic() + 30
        while view.inner_html() == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert view.inner_html() != before, "the view was not redrawn"
        rerun.scroll_into_view_if_needed()
        shot = tmp_path / f"{notebook.removesuffix('.ipynb')}.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        print(f"{notebook}: {choice!r} redrew the view; screenshot {shot}")
        if notebook.startswith("01") and os.environ.get("PAGEDKV_UPDATE_SCREENSHOT") == "1":
            shutil.copy(shot, ROOT / "docs" / "_static" / "tutorial_screenshot.png")
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"{notebook}: failed; screenshot {tmp_path / 'failure.png'}")
        raise
    finally:
        page.close()
        shut_down_kernels(base, token)
