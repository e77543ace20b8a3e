"""`pagedkv serve --skip-tokenizer-init`: the embedded model served on token ids alone, as the
GPU benchmarks serve shape-only configs (random weights, no tokenizer files).

Token-id prompts work and every choice carries `token_ids` with empty text; the ids are the ones
the server with a tokenizer generates for the same prompt (the independent reference), streamed
or not; whatever needs text gets a 400 that says what to do and leaves the server idle.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedkv.server.app import build_app
from pagedkv.server.serving import NO_TOKENIZER

from .conftest import RunningServer, metric_value, wait_idle

VOCAB = 49152  # SmolLM2's vocabulary (its model config)
PROMPTS = [[1, 2, 3, 4, 5], [504, 3458, 282, 4649]]


@pytest.fixture(scope="module")
def tf_http(tokfree_server: RunningServer):
    with httpx.Client(base_url=tokfree_server.url, timeout=120) as c:
        yield c


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _complete(c: httpx.Client, **body) -> dict:
    return _ok(c.post("/v1/completions", json={"temperature": 0, "ignore_eos": True, **body}))


def _stream(c: httpx.Client, **body) -> list[dict]:
    body = {"temperature": 0, "ignore_eos": True, "stream": True, **body}
    events = []
    with c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
    raise AssertionError("the stream ended without [DONE]")


def test_models_and_health(tf_http: httpx.Client, tokfree_server: RunningServer) -> None:
    assert tf_http.get("/health").status_code == 200
    (card,) = _ok(tf_http.get("/v1/models"))["data"]
    assert card["id"] == "SmolLM2-135M-Instruct" == tokfree_server.model
    assert card["max_model_len"] == 8192
    # the vocabulary comes from the model config: its last id is accepted, the next is not
    assert _complete(tf_http, prompt=[VOCAB - 1], max_tokens=1)["choices"][0]["token_ids"]
    resp = tf_http.post("/v1/completions", json={"prompt": [VOCAB], "max_tokens": 1})
    assert resp.status_code == 400
    assert f"0..{VOCAB - 1}" in resp.json()["error"]["message"]


def test_token_id_prompts_give_token_ids_empty_text_and_exact_usage(tf_http: httpx.Client) -> None:
    out = _complete(tf_http, prompt=PROMPTS, max_tokens=5)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c, prompt in zip(choices, PROMPTS):
        assert c["text"] == ""
        assert c["prompt_token_ids"] == prompt
        assert len(c["token_ids"]) == 5 and all(0 <= t < VOCAB for t in c["token_ids"])
        assert c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19}
    # one list[int] prompt is the first prompt of the batch on its own (greedy)
    single = _complete(tf_http, prompt=PROMPTS[0], max_tokens=5)
    assert single["choices"][0]["token_ids"] == choices[0]["token_ids"]
    assert single["usage"]["prompt_tokens"] == 5


def test_same_tokens_as_the_server_with_a_tokenizer(
    tf_http: httpx.Client, http: httpx.Client
) -> None:
    ids = _ok(http.post("/tokenize", json={"prompt": "The capital of France is"}))["tokens"]
    ref = _complete(http, prompt=ids, max_tokens=6, return_token_ids=True)["choices"][0]
    got = _complete(tf_http, prompt=ids, max_tokens=6)["choices"][0]
    assert got["token_ids"] == ref["token_ids"] and len(got["token_ids"]) == 6
    assert got["prompt_token_ids"] == ref["prompt_token_ids"] == ids
    assert got["text"] == "" and ref["text"]
    # return_token_ids on the tokenizer's server: the ids are those of its text
    assert _ok(http.post("/detokenize", json={"tokens": ref["token_ids"]}))["prompt"] == ref["text"]
    # and without it the server with a tokenizer answers as before
    plain = _complete(http, prompt=ids, max_tokens=2)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_stream_carries_each_chunks_new_token_ids_and_logprobs(tf_http: httpx.Client) -> None:
    whole = _complete(tf_http, prompt=PROMPTS, max_tokens=4, logprobs=2)
    events = _stream(
        tf_http,
        prompt=PROMPTS,
        max_tokens=4,
        logprobs=2,
        stream_options={"include_usage": True},
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    firsts: dict[int, list[int]] = {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        assert c["text"] == ""
        if c["index"] not in firsts:
            firsts[c["index"]] = c["prompt_token_ids"]  # the prompt's ids in the first chunk only
        else:
            assert c["prompt_token_ids"] is None
        ids[c["index"]] += c["token_ids"]
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert lp["text_offset"] == [0] * len(c["token_ids"])  # the text is empty
    assert firsts == {0: PROMPTS[0], 1: PROMPTS[1]}
    assert [ids[0], ids[1]] == [c["token_ids"] for c in whole["choices"]]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}
    # greedy: each sampled token is the best of its top logprobs, named token_id:<id>
    for c in whole["choices"]:
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        for name, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(top) == 2 and all(k.startswith("token_id:") for k in top)
            assert top[name] == value == max(top.values())


@pytest.mark.parametrize(
    ("path", "body", "param", "hint"),
    [
        ("/v1/completions", {"prompt": "hello"}, "prompt", ""),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", ""),
        ("/v1/completions", {"prompt": [1, 2], "stop": ["."]}, "stop", "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages",
         "/v1/completions"),
        ("/tokenize", {"prompt": "hi"}, "prompt", "/tokenize"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages", "/tokenize"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens", "/detokenize"),
    ],
)  # fmt: skip
def test_what_needs_text_is_a_clear_400_and_changes_nothing(
    tf_http: httpx.Client, path: str, body: dict, param: str, hint: str
) -> None:
    resp = tf_http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["message"].startswith(NO_TOKENIZER)
    assert NO_TOKENIZER == (
        "this server runs without a tokenizer (--skip-tokenizer-init): send prompts as token ids"
    )
    assert hint in err["message"] and err["param"] == param
    text = wait_idle(tf_http)
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "vllm:num_requests_waiting") == 0
    assert _complete(tf_http, prompt=[7, 8, 9], max_tokens=1)["usage"]["completion_tokens"] == 1


def test_openai_client(tokfree_server: RunningServer) -> None:
    """What a vLLM user's client sees: `token_ids` as an extra field of the choice."""
    client = openai.OpenAI(
        base_url=tokfree_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    out = client.completions.create(
        model=tokfree_server.model, prompt=[1, 2, 3], max_tokens=3, temperature=0
    )
    choice = out.choices[0].to_dict()
    assert choice["text"] == "" and len(choice["token_ids"]) == out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="--skip-tokenizer-init"):
        client.completions.create(model=tokfree_server.model, prompt="hello", max_tokens=3)


class _NoTokenizerEngine:
    """The outside of an engine without a tokenizer (what build_app reads at start)."""

    errored = False

    def __init__(self, vocab_size: int | None) -> None:
        self.model_config = SimpleNamespace(max_model_len=32, name="ids", vocab_size=vocab_size)

    def get_tokenizer(self) -> None:
        return None

    def get_stats(self) -> None:
        return None


def test_no_tokenizer_needs_a_vocab_size_from_the_model_config() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_app(_NoTokenizerEngine(None), served_model_names=["ids"])
    app = build_app(_NoTokenizerEngine(100), served_model_names=["ids"])
    assert app.state.serving.vocab_size == 100 and app.state.serving.tokenizer is None
