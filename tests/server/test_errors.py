"""A user's mistake gets OpenAI's error shape and the right 4xx, never a 500, and changes
nothing: after every bad request the engine is idle and a good request still works."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MAX_BODY_BYTES, RunningServer, wait_idle


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param
    return err


BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes please"}}, "stream_options"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "hi", "temperature": 0, "n": 2}, None),  # greedy copies would be identical
    ({"prompt": "hi", "n": 3, "best_of": 2}, None),
    ({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, None),
    ({"prompt": "hi", "length_penalty": 0.5}, None),  # only for beam search
    ({"prompt": "hi", "suffix": "tail"}, "suffix"),
    # strict JSON types: no string booleans, no float integers, no numeric strings
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 1.0}, "n"),
    ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    # fields we accept but cannot honour in this form
    ({"prompt": "hi", "guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": "hi", "guided_decoding_backend": "xgrammar", "guided_regex": "a"},
     "guided_decoding_backend"),
    ({"prompt": "hi", "guided_whitespace_pattern": " *", "guided_json": {}},
     "guided_whitespace_pattern"),
    ({"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"10": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [""]}, "bad_words"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, None),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "y"}},
     "stream_options"),
    # OpenAI / vLLM fields pagedkv cannot honour: refused, never ignored
    ({"prompt": "hi", "priority": 1}, "priority"),
    ({"prompt": "hi", "logits_processors": ["my.module:Proc"]}, "logits_processors"),
    ({"prompt": "hi", "cache_salt": "abc"}, "cache_salt"),
]


@pytest.mark.parametrize(
    ("body", "param"), BAD_COMPLETIONS, ids=[str(b) for b, _ in BAD_COMPLETIONS]
)
def test_bad_completion_values_are_400(http: httpx.Client, body: dict, param: str | None) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": -2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
    (
        {"messages": [{"role": "user", "content": "x"}],
         "chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
         "add_generation_prompt": True},
        "continue_final_message",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ nope( }}"},
     "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[str(b) for b, _ in BAD_CHATS])
def test_bad_chat_values_are_400(http: httpx.Client, body: dict, param: str | None) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_fields_asking_for_nothing_are_accepted(http: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "priority": 0, "store": False,
            "service_tier": "auto", "some_field_no_api_defines": 1}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_openai_client_sees_bad_request(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=2, temperature=-3)
    assert info.value.status_code == 400
    assert "temperature" in str(info.value)


def test_prompt_longer_than_context_is_400(http: httpx.Client, server: RunningServer) -> None:
    too_long = [100] * (server.max_model_len + 1)
    err = assert_error(
        http.post("/v1/completions", json={"prompt": too_long, "max_tokens": 1}), 400
    )
    assert "maximum context length" in err["message"]
    fits_not_with_output = [100] * (server.max_model_len - 2)
    err = assert_error(
        http.post("/v1/completions", json={"prompt": fits_not_with_output, "max_tokens": 5}),
        400,
        "max_tokens",
    )
    assert str(server.max_model_len) in err["message"]
    words = "hello " * (server.max_model_len + 10)
    assert_error(
        http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": words}], "max_tokens": 2},
        ),
        400,
    )


def test_unknown_model_is_404(client: openai.OpenAI, http: httpx.Client) -> None:
    err = assert_error(
        http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404, "model"
    )
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert_error(http.post("/tokenize", json={"model": "gpt-17", "prompt": "x"}), 404)


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'", "max_tokens": 1}'
    resp = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_error(resp, 413)

    def chunked():  # no Content-Length: the limit must hold on the streamed size too
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    resp = http.post(
        "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    assert_error(resp, 413)


def test_malformed_requests_are_400(http: httpx.Client) -> None:
    assert_error(
        http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert_error(http.post("/v1/completions", json=[1, 2, 3]), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.delete("/v1/models"), 405)


def test_errors_change_nothing(client: openai.OpenAI, http: httpx.Client, server) -> None:
    for body, _ in BAD_COMPLETIONS[:10]:
        http.post("/v1/completions", json=body)
    text = wait_idle(http)
    assert "vllm:num_requests_running" in text
    assert http.get("/health").status_code == 200
    out = client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
