"""--api-key: /v1/* needs `Authorization: Bearer <key>`; other paths stay open. And the
server's shutdown on SIGTERM: exit status 0 within a few seconds, the engine core gone too."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import pytest

from .conftest import API_KEY, RunningServer, core_pid, wait_gone

KEY = API_KEY


@pytest.mark.slow
def test_api_key_is_required_on_v1(keyed_server: RunningServer) -> None:
    url = keyed_server.url
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
    ):
        resp = httpx.get(url + "/v1/models", headers=headers)
        assert resp.status_code == 401, headers
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        resp = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert resp.status_code == 401
    # Not under /v1: open (health checks and Prometheus scrapers carry no key).
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny", "smol"]
    for name in ("tiny", "smol"):
        out = good.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert out.model == name and out.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    # the tokenizer endpoints are behind the key (tokenizing is work anyone could cause)
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(url + path, json=body).status_code == 401
        ok = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
    assert httpx.get(url + "/tokenizer_info").status_code == 401
    # without --trust-request-chat-template, a request's own template is refused
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        good.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
            extra_body={"chat_template": "{{ messages[0].content }}"},
        )


@pytest.mark.slow
def test_sigterm_shuts_down_cleanly(keyed_server: RunningServer) -> None:
    proc: subprocess.Popen = keyed_server.process
    core = core_pid(keyed_server.log())
    # A request in flight must not keep the server from stopping.
    with (
        httpx.Client(timeout=30) as hc,
        hc.stream(
            "POST",
            keyed_server.url + "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    elapsed = time.monotonic() - start
    assert code == 0, keyed_server.log()[-3000:]
    assert elapsed < 15
    assert "shutting the engine down" in keyed_server.log()
    assert wait_gone(core, 5), "the engine core outlived the server"
