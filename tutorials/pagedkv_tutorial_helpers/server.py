"""``pagedkv serve`` in a subprocess, and a poller of its Prometheus ``/metrics``."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Sequence

#: What the live plot follows: series name -> Prometheus sample name (vLLM's names).
FOLLOWED = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "swapped": "vllm:num_requests_swapped",
    "kv_usage": "vllm:gpu_cache_usage_perc",
    "preemptions": "vllm:num_preemptions_total",
}


class ServerProcess:
    """``pagedkv serve`` on 127.0.0.1 in a subprocess: start, wait until healthy, stop.

    It runs ``python -m pagedkv.server`` with the notebook's own interpreter, so the server is
    the one of the packages the notebook imports (and no installed entry point is needed).
    """

    def __init__(self, *args: str, port: int | None = None) -> None:
        import socket
        import sys

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.command = [sys.executable, "-m", "pagedkv.server", "--host", "127.0.0.1",
                        "--port", str(port), *args]  # fmt: skip
        self.proc = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> ServerProcess:
        import subprocess
        import tempfile

        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pagedkv serve exited with {self.proc.returncode}:\n{self.logs()[-3000:]}"
                )
            if time.monotonic() > deadline:
                logs = self.logs()
                self.stop()
                raise TimeoutError(f"pagedkv serve was not healthy in {timeout_s} s:\n{logs[-3000:]}")
            time.sleep(0.5)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it does not exit in time."""
        import subprocess

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape(base_url: str, names: Sequence[str] | None = None) -> dict[str, float]:
    """``GET /metrics`` parsed by prometheus_client: sample name -> value (summed over label
    sets), for ``names`` or every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if names is None or sample.name in names:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


class MetricsPoller:
    """Scrapes ``/metrics`` every ``interval_s`` in a background thread while in a ``with``
    block; ``series`` holds ``t`` (seconds since start) and one list per :data:`FOLLOWED`.
    Read it while the thread runs through :meth:`snapshot` (lists of one length)."""

    def __init__(self, base_url: str, interval_s: float = 0.25) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.base_url = base_url
        self.interval_s = interval_s
        self.series: dict[str, list[float]] = {"t": [], **{k: [] for k in FOLLOWED}}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a scrape's values are appended together
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def poll_once(self) -> None:
        values = scrape(self.base_url, list(FOLLOWED.values()))
        with self._lock:
            self.series["t"].append(time.monotonic() - self._t0)
            for key, name in FOLLOWED.items():
                self.series[key].append(values.get(name, 0.0))

    def snapshot(self) -> dict[str, list[float]]:
        """A copy of ``series`` as of the last whole scrape (safe while the thread appends)."""
        with self._lock:
            return {key: list(values) for key, values in self.series.items()}

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):  # one missed scrape: the next one comes
                self.poll_once()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MetricsPoller:
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll_once()  # the state after the work
