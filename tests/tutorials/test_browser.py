"""The paging tutorial opened in JupyterLab in headless Chromium: run it, see the widget.

Chromium is Debian's (``scripts/install-browser.sh`` installs it); Playwright drives it through
``executable_path`` and never downloads a browser. The screenshot is saved under the test's tmp
folder (and copied to ``docs/_static/tutorial_screenshot.png`` when PAGEDKV_UPDATE_SCREENSHOT=1).
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
NOTEBOOK = "01_paging.ipynb"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(jupyter_env, tmp_path):
    """A JupyterLab server on 127.0.0.1 over a copy of the notebook (the committed one stays clean)."""
    pytest.importorskip("jupyterlab")
    root = tmp_path / "lab"
    root.mkdir()
    nb = json.loads((TUTORIALS / NOTEBOOK).read_text())
    nb["metadata"]["kernelspec"]["name"] = jupyter_env["KERNEL_NAME"]
    (root / NOTEBOOK).write_text(json.dumps(nb))
    shutil.copy(TUTORIALS / "pagedkv_tutorial_helpers.py", root)
    env = {**os.environ, **{k: v for k, v in jupyter_env.items() if k != "KERNEL_NAME"}}
    # No news pop-up over the notebook in the screenshot.
    labconfig = Path(jupyter_env["JUPYTER_CONFIG_DIR"]) / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    port, token = free_port(), "pagedkv-test-token"
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
            "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT,
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
                pytest.fail(
                    "JupyterLab did not start:\n"
                    + (tmp_path / "jupyterlab.log").read_text()[-3000:]
                )
            time.sleep(0.5)
        yield base, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_paging_tutorial_renders_its_widget_in_jupyterlab(jupyterlab, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/install-browser.sh (as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    base, token, _root = jupyterlab
    shot = tmp_path / "tutorial_screenshot.png"
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000},
        )
        try:
            page = context.new_page()
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            # wait for the kernel, then run every cell through JupyterLab's own command
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
            page.wait_for_selector(".widget-play", timeout=120_000)
            page.wait_for_selector(".pagedkv-block-tables", timeout=60_000)
            page.wait_for_function(
                "() => ![...document.querySelectorAll('.jp-InputArea-prompt')]"
                ".some(e => e.textContent.includes('*'))",
                timeout=180_000,
            )
            errors = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            )
            tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
            assert not tracebacks, tracebacks
            assert page.locator(".jupyter-widgets").count() > 0
            caption = page.locator(".pagedkv-block-tables caption").first
            assert "after step 0" in caption.inner_text()
            page.screenshot(path=str(tmp_path / "before_play.png"))
            # the widget is live: Play moves the step slider (in the browser), the kernel's
            # callback redraws the block tables
            page.locator(".widget-play button").first.click()
            page.wait_for_function(
                "() => !document.querySelector('.pagedkv-block-tables caption')"
                ".textContent.includes('after step 0')",
                timeout=60_000,
            )
            time.sleep(2.5)  # a few more steps, so the screenshot shows blocks filling
            page.locator(".widget-play").first.scroll_into_view_if_needed()
            page.screenshot(path=str(shot))
        finally:
            context.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    if os.environ.get("PAGEDKV_UPDATE_SCREENSHOT") == "1":
        shutil.copy(shot, ROOT / "docs" / "_static" / "tutorial_screenshot.png")
