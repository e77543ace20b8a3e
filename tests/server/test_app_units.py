"""In-process checks of pieces that a live server cannot show on demand: /health turning 503
when the engine loop has died, and the error-shape helpers. The stand-in engine here is only a
dead loop's outside; everything that generates runs against the real server in other modules."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from pagedkv.server.app import build_app


class _Tokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 10

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text)

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


class _DeadEngine:
    """The outside of an AsyncLLMEngine whose loop died."""

    errored = True
    model_config = SimpleNamespace(max_model_len=32, name="dead")

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    def get_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        raise RuntimeError("the engine loop died: boom")


def _request(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_health_is_503_when_the_engine_loop_died() -> None:
    app = build_app(_DeadEngine(), served_model_names=["dead"])
    resp = _request(app, "GET", "/health")
    assert resp.status_code == 503
    assert "boom" in resp.json()["error"]["message"]
    resp = _request(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert resp.status_code == 503
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_body_limit_and_api_key_in_process() -> None:
    app = build_app(_DeadEngine(), served_model_names=["dead"], api_key="k", max_body_bytes=100)
    assert _request(app, "GET", "/v1/models").status_code == 401
    ok = _request(app, "GET", "/v1/models", headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "dead"
    key = {"Authorization": "Bearer k"}
    big = _request(
        app, "POST", "/tokenize", content=b"x" * 101,
        headers={"content-type": "application/json", **key},
    )
    assert big.status_code == 413
    # the tokenizer endpoints are behind the key too (tokenizing is work anyone could cause)
    for path in ("/tokenize", "/detokenize"):
        assert _request(app, "POST", path, json={"prompt": "abc"}).status_code == 401
    assert _request(app, "GET", "/tokenizer_info").status_code == 401
    small = _request(app, "POST", "/tokenize", json={"prompt": "abc"}, headers=key)
    assert small.status_code == 200 and small.json()["tokens"] == [1, 1, 1]
    # health and metrics stay open
    assert _request(app, "GET", "/metrics").status_code == 200
