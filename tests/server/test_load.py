"""64 concurrent streaming clients, a quarter of which hang up midway.

Every client that stays gets a complete, correct answer; nobody gets a 5xx; and once the dust
settles the engine holds no request and no KV block (a disconnect aborts its request and frees
its blocks)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import RunningServer, metric_value, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 8


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(server: RunningServer, http: httpx.Client) -> None:
    # Any non-2xx answer makes the openai client raise (APIStatusError), failing the gather.
    async def main() -> list[tuple[str, object]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:

            async def one(i: int) -> tuple[str, object]:
                leave = i % 4 == 0  # a quarter disconnect after two chunks
                if i % 2:
                    stream = await client.completions.create(
                        model=server.model,
                        prompt=f"Story number {i}:",
                        max_tokens=MAX_TOKENS,
                        temperature=1.0,
                        seed=i,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                else:
                    stream = await client.chat.completions.create(
                        model=server.model,
                        messages=[{"role": "user", "content": f"Tell joke {i}"}],
                        max_completion_tokens=MAX_TOKENS,
                        temperature=1.0,
                        seed=i,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                chunks = []
                async for chunk in stream:
                    chunks.append(chunk)
                    if leave and len(chunks) == 2:
                        await stream.close()
                        return "left", None
                return ("chat" if i % 2 == 0 else "text"), chunks

            return await asyncio.gather(*(one(i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(main())
    assert len(results) == NUM_CLIENTS
    left = [r for r in results if r[0] == "left"]
    assert len(left) == NUM_CLIENTS // 4
    for kind, chunks in results:
        if kind == "left":
            continue
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        body = [c for c in chunks if c.choices]
        finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
        assert finishes == ["length"]
        if kind == "text":
            text = "".join(c.choices[0].text for c in body)
        else:
            text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text

    metrics = wait_idle(http, timeout=30)
    assert metric_value(metrics, "vllm:num_requests_running") == 0
    assert metric_value(metrics, "vllm:num_requests_waiting") == 0
    assert metric_value(metrics, "vllm:gpu_cache_usage_perc") == 0
    assert metric_value(metrics, "vllm:request_aborted_total") >= NUM_CLIENTS // 4
    assert http.get("/health").status_code == 200
