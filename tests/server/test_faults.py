"""The two processes of `pagedkv serve` fail and stop together, each on the real CLI:

* the engine core is killed: the stream in flight ends with a clear error within 5 s and the
  server exits with a non-zero status;
* the server (API process) is killed: the engine core goes too (no orphan);
* Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the stream in flight is
  drained to its end, then both processes stop and the exit status is 0.

(SIGTERM with a stream in flight: `test_auth_and_shutdown.py`.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import Launch, RunningServer, core_pid, launch_server, wait_gone, wait_ready


@pytest.fixture(scope="module")
def fault_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launch]]:
    """Three servers started at once (their model loads overlap); each test ends one."""
    base = tmp_path_factory.mktemp("faults")
    small = ("--kv-cache-gb", "0.25", "--swap-space", "0.05")
    launches = {
        "corekill": launch_server(base / "corekill.log", *small),
        "frontkill": launch_server(base / "frontkill.log", *small),
        "sigint": launch_server(base / "sigint.log", *small, "--graceful-shutdown-timeout", "120",
                                new_session=True),
    }
    yield launches
    for launch in launches.values():
        if launch.process.poll() is None:
            launch.process.kill()
            launch.process.wait(10)


def _stream(server: RunningServer, max_tokens: int):
    client = httpx.Client(timeout=120)
    body = {"prompt": "Count to fifty:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    ctx = client.stream("POST", server.url + "/v1/completions", json=body)
    return client, ctx


def _events(lines) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


@pytest.mark.slow
def test_core_killed_ends_streams_and_the_server_exits_nonzero(fault_servers) -> None:
    server = wait_ready(fault_servers["corekill"])
    pid = core_pid(server.log())
    client, ctx = _stream(server, 400)
    with client, ctx as resp:
        assert resp.status_code == 200
        events = _events(resp.iter_lines())
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = list(events)
        ended = time.monotonic() - killed
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert "engine core process" in err["message"] and "SIGKILL" in err["message"]
    assert err["type"] == "service_unavailable"
    assert ended < 5, f"the stream took {ended:.1f} s to end after the core died"
    code = server.process.wait(timeout=20)
    assert code != 0, server.log()[-2000:]
    assert "stopping the server" in server.log()


@pytest.mark.slow
def test_killed_server_takes_its_engine_core_along(fault_servers) -> None:
    server = wait_ready(fault_servers["frontkill"])
    pid = core_pid(server.log())
    assert not wait_gone(pid, 0.2)
    server.process.kill()  # SIGKILL: no clean-up code runs in the API process
    server.process.wait(10)
    assert wait_gone(pid, 5), f"the engine core (pid {pid}) outlived its server"


@pytest.mark.slow
def test_ctrl_c_drains_the_stream_then_stops_both(fault_servers) -> None:
    server = wait_ready(fault_servers["sigint"])
    pid = core_pid(server.log())
    max_tokens = 12
    client, ctx = _stream(server, max_tokens)
    with client, ctx as resp:
        events = _events(resp.iter_lines())
        chunks = [json.loads(next(events))]
        os.killpg(server.process.pid, signal.SIGINT)  # the whole group, like a terminal
        signalled = time.monotonic()
        rest = list(events)
        drained = time.monotonic()
    assert rest[-1] == "[DONE]", rest[-3:]
    chunks += [json.loads(e) for e in rest[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len([c for c in chunks if c["choices"][0]["text"]]) >= max_tokens - 1
    code = server.process.wait(timeout=30)
    assert code == 0, server.log()[-2000:]
    # it stopped when the stream was done, not at the end of the 120 s grace period
    assert time.monotonic() - drained < 20
    assert drained - signalled < 110
    assert wait_gone(pid, 5), "the engine core outlived the server"
    assert "engine core shutting down" in server.log()
