"""The server as an OpenAI client sees it: completions and chat, streamed and not, on the real
embedded model. Expectations are exact where the API defines them (usage counts, finish
reasons, indexes, stop-string truncation) and cross-checked against a second path otherwise
(streamed vs non-streamed, token-id vs text prompts, /tokenize vs usage).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import RunningServer, metric_value, wait_idle

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def tokenize(http: httpx.Client, **body) -> list[int]:
    resp = http.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_models_lists_the_served_model(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert server.model == "SmolLM2-135M-Instruct"
    assert server.max_model_len > 0


def test_health_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    body = http.get("/version").json()
    from pagedkv.server import __version__

    assert body["version"] == __version__


def test_completion_greedy_usage_and_finish(
    client: openai.OpenAI, http: httpx.Client, server
) -> None:
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion"
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text
    assert out.usage.prompt_tokens == len(tokenize(http, prompt=PROMPT))
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_token_id_prompt_equals_text_prompt(
    client: openai.OpenAI, http: httpx.Client, server
) -> None:
    ids = tokenize(http, prompt=PROMPT)
    by_text = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0
    )
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_streamed_text_equals_non_streamed(client: openai.OpenAI, server) -> None:
    whole = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_streamed_equals_non_streamed(
    client: openai.OpenAI, http: httpx.Client, server
) -> None:
    whole = client.chat.completions.create(
        model=server.model, messages=CHAT, max_completion_tokens=8, temperature=0
    )
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.usage.prompt_tokens == len(tokenize(http, messages=CHAT))
    assert whole.usage.completion_tokens <= 8
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage == whole.usage


def test_chat_max_tokens_alias_and_length_finish(client: openai.OpenAI, server) -> None:
    out = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


def test_n2_returns_two_indexed_choices(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10
    chat = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_completion_tokens=4,
        n=2,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_n2_streaming_has_both_indexes(client: openai.OpenAI, server) -> None:
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=4,
            n=2,
            temperature=1.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert all(texts.values())


def test_multiple_prompts(client: openai.OpenAI, server) -> None:
    prompts = [PROMPT, "One, two, three,"]
    out = client.completions.create(model=server.model, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(
        model=server.model, prompt=prompts[1], max_tokens=4, temperature=0
    )
    assert out.choices[1].text == single.choices[0].text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, server) -> None:
    def run(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model,
                prompt="Once upon a time",
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    a, b = run(1234), run(1234)
    assert a == b
    others = {run(s) for s in (1, 2)}
    assert len(others | {a}) > 1  # different seeds do not all give the same text


def test_completion_logprobs(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert len(top) >= 3
        # Greedy picks the most likely token, so its logprob is the largest alternative's.
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)
        assert top[token] == pytest.approx(logprob)


def test_chat_logprobs(client: openai.OpenAI, server) -> None:
    out = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token


def test_stop_string_truncates_like_the_full_text(client: openai.OpenAI, server) -> None:
    full = (
        client.completions.create(
            model=server.model,
            prompt="Count: 1, 2, 3,",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    expected = full[: full.find(stop)]
    for stream in (False, True):
        kw = {
            "model": server.model,
            "prompt": "Count: 1, 2, 3,",
            "max_tokens": 16,
            "temperature": 0,
            "stop": [stop],
            "extra_body": {"ignore_eos": True},
        }
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == expected, (stream, stop, full)
        assert reason == "stop"


def test_echo_prepends_the_prompt(client: openai.OpenAI, server) -> None:
    plain = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0
    )
    echoed = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    # The prompt's other tokens have logprobs when the engine computes prompt logprobs
    # (RequestOutput.prompt_logprobs), null otherwise; the generated ones always have them.
    prompt_lps = lp.token_logprobs[1:n_prompt]
    assert all(x is None for x in prompt_lps) or all(x <= 0 for x in prompt_lps)
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[n_prompt:])
    assert lp.text_offset[n_prompt] == len(PROMPT)
    assert out.choices[0].text == PROMPT + "".join(lp.tokens[n_prompt:])
    streamed = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    assert [x for c in streamed for x in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_model_may_be_omitted(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_tokenize_detokenize_round_trip(http: httpx.Client, server) -> None:
    text = "Paged attention keeps the KV cache in blocks."
    body = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == server.max_model_len
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200
    assert back.json()["prompt"] == text


def test_metrics_count_tokens(client: openai.OpenAI, http: httpx.Client, server) -> None:
    before = http.get("/metrics").text
    client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = wait_idle(http)
    assert (
        metric_value(after, "vllm:generation_tokens_total")
        - metric_value(before, "vllm:generation_tokens_total")
        >= 4
    )
    assert metric_value(after, "vllm:prompt_tokens_total") > metric_value(
        before, "vllm:prompt_tokens_total"
    )
    assert metric_value(after, "vllm:e2e_request_latency_seconds_count") > metric_value(
        before, "vllm:e2e_request_latency_seconds_count"
    )
    for name in (
        "vllm:num_requests_swapped",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        metric_value(after, name)  # present
    assert metric_value(after, "vllm:num_requests_running") == 0
    assert metric_value(after, "vllm:gpu_cache_usage_perc") == 0
