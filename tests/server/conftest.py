"""The real server, started once per test session in a subprocess on the embedded model.

`pagedkv serve` (the engine's CLI with the server's entry point) runs exactly as a user runs it;
tests talk to it over loopback HTTP with the official `openai` package, httpx and schemathesis.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

#: The test server's body limit: small, so that the 413 tests send little.
MAX_BODY_BYTES = 262_144
STARTUP_TIMEOUT_S = 240.0


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path
    model: str
    max_model_len: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedkv_command() -> list[str]:
    """`pagedkv` from this interpreter's environment (the console script next to python).

    `PAGEDKV_TEST_CLI="python path/to/script.py"` runs another command line instead (a CLI
    under development); it gets the same arguments (`serve ...`, `bench serve ...`).
    """
    override = os.environ.get("PAGEDKV_TEST_CLI")
    if override:
        return shlex.split(override)
    script = Path(sys.executable).with_name("pagedkv")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "pagedkv.engine.cli"]


@dataclass
class Launch:
    """A server process that was started and may not be ready yet."""

    process: subprocess.Popen
    url: str
    log_path: Path
    headers: dict[str, str]


def launch_server(
    log_path: Path, *extra: str, new_session: bool = False, max_body_bytes: int = MAX_BODY_BYTES
) -> Launch:
    """Start `pagedkv serve` (`new_session`: in a process group of its own, as a terminal's
    foreground job is, so that a test can send Ctrl-C's SIGINT to the whole group)."""
    port = free_port()
    cmd = [
        *pagedkv_command(),
        "serve",
        "--port",
        str(port),
        "--max-body-bytes",
        str(max_body_bytes),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes to it for its whole life
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session
    )
    headers = {}
    if "--api-key" in extra:
        headers["Authorization"] = f"Bearer {extra[extra.index('--api-key') + 1]}"
    return Launch(proc, f"http://127.0.0.1:{port}", log_path, headers)


def wait_ready(launch: Launch) -> RunningServer:
    proc, url, log_path = launch.process, launch.url, launch.log_path
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} during startup:\n{log_path.read_text()[-4000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(
                f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}"
            )
        time.sleep(0.5)
    card = httpx.get(url + "/v1/models", headers=launch.headers, timeout=10).json()["data"][0]
    return RunningServer(url, proc, log_path, card["id"], int(card["max_model_len"]))


def core_pid(log_text: str) -> int:
    """The engine core's process id, from the server's log."""
    m = re.search(r"engine core process started \(pid (\d+)\)", log_text)
    if m is None:
        raise AssertionError("no engine core pid in the server's log:\n" + log_text[-2000:])
    return int(m.group(1))


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (it exited and waits to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return process_gone(pid)


def stop_server(proc: subprocess.Popen, timeout: float = 20.0) -> int | None:
    """SIGTERM, then SIGKILL if it does not go; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


#: The second server's API key (auth tests; the SIGTERM test stops that server).
API_KEY = "sk-test-123"


@pytest.fixture(scope="session")
def _launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launch]]:
    """Both test servers start at once: loading the model dominates, and the loads overlap."""
    base = tmp_path_factory.mktemp("servers")
    launches = {"main": launch_server(base / "main.log", "--trust-request-chat-template")}
    launches["keyed"] = launch_server(
        base / "keyed.log", "--api-key", API_KEY, "--served-model-name", "tiny", "smol",
        "--kv-cache-gb", "0.25",
    )
    yield launches
    for launch in launches.values():
        stop_server(launch.process)


@pytest.fixture(scope="session")
def server(_launches: dict[str, Launch]) -> RunningServer:
    """`pagedkv serve` on the embedded model, shared by every test of the session."""
    return wait_ready(_launches["main"])


@pytest.fixture(scope="session")
def keyed_server(_launches: dict[str, Launch]) -> RunningServer:
    """`pagedkv serve --api-key ... --served-model-name tiny smol`."""
    return wait_ready(_launches["keyed"])


@pytest.fixture(scope="session")
def tokfree_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`pagedkv serve --skip-tokenizer-init`: the embedded model served on token ids alone (the
    way the GPU benchmarks serve bundled shape-only configs, which have no tokenizer).

    Started only when a test asks for it; its KV cache is small (a few short requests)."""
    log = tmp_path_factory.mktemp("tokfree") / "tokfree.log"
    launch = launch_server(log, "--skip-tokenizer-init", "--kv-cache-gb", "0.25")
    try:
        yield wait_ready(launch)
    finally:
        stop_server(launch.process)


@pytest.fixture(scope="session")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def metric_value(text: str, name: str) -> float:
    """The value of one unlabelled-or-labelled sample in Prometheus text, summed over labels."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name:
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"metric {name} not in /metrics")
    return total


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> str:
    """Wait until the engine reports no running or waiting request; returns the last /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        busy = metric_value(text, "vllm:num_requests_running") + metric_value(
            text, "vllm:num_requests_waiting"
        )
        if busy == 0 and metric_value(text, "vllm:gpu_cache_usage_perc") == 0:
            return text
        if time.monotonic() > deadline:
            return text
        time.sleep(0.2)
