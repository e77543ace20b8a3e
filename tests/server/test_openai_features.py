"""The vLLM/OpenAI surface beyond plain text, through the official `openai` client on the real
embedded model: structured output (checked against its schema with `jsonschema`), tools
(arguments parsed and checked), token controls, prompt logprobs, chat extras, the tokenizer
endpoints, metrics, and text that is not valid Unicode. Requests are short (a few tokens)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .conftest import RunningServer, metric_value, wait_idle

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def raw_post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST `body` as JSON even when it holds lone surrogates (json.dumps writes `\\udfff`)."""
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})


# ---- structured output ------------------------------------------------------------------------
def test_response_format_json_schema_strict(client: openai.OpenAI, server: RunningServer) -> None:
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, {**PERSON, "additionalProperties": False})


def test_response_format_json_object_streamed(client: openai.OpenAI, server) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=24, temperature=0, stream=True,
        response_format={"type": "json_object"},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"},
         lambda t: __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
        ({"guided_grammar": 'start: "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
        ({"structured_outputs": {"regex": "(red|green|blue)"}},
         lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
         lambda t: " " not in t.replace(json.loads(t)["name"], "")
         and jsonschema.validate(json.loads(t), PERSON) is None),
    ],
    ids=["guided_regex", "guided_choice", "guided_json", "guided_grammar", "so_regex", "so_json"],
)
def test_vllm_constraints_on_completions(client: openai.OpenAI, server, extra, check) -> None:
    out = client.completions.create(
        model=server.model, prompt="Answer:", max_tokens=40, temperature=0.8, seed=3,
        extra_body=extra,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert check(choice.text), choice.text


# ---- tools ------------------------------------------------------------------------------------
def _args(call, schema: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_named_tool_choice_is_constrained(client: openai.OpenAI, server) -> None:
    out = client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=30, temperature=0, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    msg = out.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    _args(call, WEATHER["function"]["parameters"])


def test_required_tool_choice_streamed_equals_plain(client: openai.OpenAI, server) -> None:
    kw = dict(model=server.model, messages=ASK, max_tokens=40, temperature=0,
              tools=[WEATHER, TIME], tool_choice="required")
    plain = client.chat.completions.create(**kw)
    calls = plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "tool_calls" and calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        _args(call, params[call.function.name])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(d.role is None for d in deltas[1:])  # the role only in the first delta
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_named_tool_streams_arguments(client: openai.OpenAI, server) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=30, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    ))
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id and parts[0].function.name == "get_weather"
    args = "".join(p.function.arguments or "" for p in parts)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_calls(client: openai.OpenAI, server, stream) -> None:
    """`auto` parses what the model writes; the reply is forced (a regex) to be a call in the
    embedded template's (SmolLM2) format, so that the 135M model reliably "decides" to call."""
    import re

    kw = dict(model=server.model, messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER],
              extra_body={"guided_regex": re.escape(CALL_TEXT)})
    if not stream:
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        (call,) = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert call.function.name == "get_weather"
    assert _args(call, WEATHER["function"]["parameters"]) == {"city": "Paris"}


def test_tool_results_go_back_to_the_model(client: openai.OpenAI, http, server) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    out = client.chat.completions.create(
        model=server.model, messages=history, max_tokens=4, temperature=0, tools=[WEATHER],
        tool_choice="none",
    )
    assert out.choices[0].message.tool_calls in (None, [])
    tokens = http.post("/tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "18 C and sunny" in text and '"get_weather"' in text and "<tools>" in text
    assert out.usage.prompt_tokens < tokens["count"]  # tool_choice none: tools not shown


# ---- token controls and logprobs -------------------------------------------------------------
def test_token_controls_are_honoured(client: openai.OpenAI, http, server) -> None:
    allowed = http.post("/tokenize", json={"prompt": " red green blue",
                                           "add_special_tokens": False}).json()["tokens"]
    out = client.completions.create(
        model=server.model, prompt="Colors:", max_tokens=5, temperature=1.0, seed=1,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert set(out.choices[0].to_dict()["token_ids"]) <= set(allowed)
    top = client.completions.create(model=server.model, prompt="The capital of France is",
                                    max_tokens=1, temperature=0)
    first = http.post("/tokenize", json={"prompt": top.choices[0].text,
                                         "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=1, temperature=0,
        logit_bias={str(first): -100}, extra_body={"return_token_ids": True},
    )
    assert banned.choices[0].to_dict()["token_ids"] != [first]
    worded = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=1, temperature=0,
        extra_body={"bad_words": [top.choices[0].text.strip()]},
    )
    assert worded.choices[0].text != top.choices[0].text


def test_echo_with_logprobs_and_prompt_logprobs(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=2, temperature=0,
        echo=True, logprobs=2, extra_body={"prompt_logprobs": 1},
    )
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2
    assert lp.token_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith("The capital of France is")
    prompt_lps = out.choices[0].to_dict()["prompt_logprobs"]
    assert len(prompt_lps) == n_prompt and prompt_lps[0] is None
    # the echoed prompt's logprobs are the prompt logprobs (same positions, same values)
    for k in range(1, n_prompt):
        assert any(abs(v["logprob"] - lp.token_logprobs[k]) < 1e-4
                   for v in prompt_lps[k].values())


def test_tokens_as_ids_and_all_top_logprobs(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model, prompt="Hi", max_tokens=2, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    ids = out.choices[0].to_dict()["token_ids"]
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        temperature=0, logprobs=True, top_logprobs=-1,
    )
    tops = chat.choices[0].logprobs.content[0].top_logprobs
    assert len(tops) > 1000  # the whole vocabulary (distinct texts)
    assert tops[0].logprob >= tops[-1].logprob


def test_truncate_prompt_tokens(client: openai.OpenAI, http, server) -> None:
    long = "one two three four five six seven eight nine ten " * 20
    out = client.completions.create(
        model=server.model, prompt=long, max_tokens=1, temperature=0,
        extra_body={"truncate_prompt_tokens": 7},
    )
    assert out.usage.prompt_tokens == 7
    tail = http.post("/tokenize", json={"prompt": long}).json()["tokens"][-7:]
    same = client.completions.create(model=server.model, prompt=tail, max_tokens=1, temperature=0)
    assert same.choices[0].text == out.choices[0].text


# ---- chat extras ------------------------------------------------------------------------------
def test_continue_final_message_and_echo(client: openai.OpenAI, http, server) -> None:
    msgs = [{"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hello, my name"}]
    out = client.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "echo": True},
    )
    assert out.choices[0].message.content.startswith("Hello, my name")
    ids = http.post("/tokenize", json={"messages": msgs, "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("Hello, my name")  # the last message left open
    assert out.usage.prompt_tokens == ids["count"]


def test_custom_role_template_kwargs_and_request_template(client: openai.OpenAI, http,
                                                          server) -> None:
    template = ("{% for m in messages %}[{{ m.role }}|{{ tag }}]{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    body = {"messages": [{"role": "narrator", "content": "Once"}], "chat_template": template,
            "chat_template_kwargs": {"tag": "T1"}}
    ids = http.post("/tokenize", json=body).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "[narrator|T1]Once\n[assistant]"
    out = client.chat.completions.create(
        model=server.model, messages=body["messages"], max_tokens=1, temperature=0,
        extra_body={"chat_template": template, "chat_template_kwargs": {"tag": "T1"}},
    )
    assert out.usage.prompt_tokens == len(ids)


def test_continuous_usage_stats(client: openai.OpenAI, server) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ))
    with_choice = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choice)
    seen = [c.usage.completion_tokens for c in with_choice]
    assert seen == sorted(seen) and seen[-1] == 4
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


# ---- endpoints and metrics ----------------------------------------------------------------------
def test_model_card_tokenizer_info_and_token_strs(client: openai.OpenAI, http, server) -> None:
    card = client.models.retrieve(server.model)
    assert card.id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    info = http.get("/tokenizer_info").json()
    assert info["vocab_size"] == 49152 and info["eos_token"] == "<|im_end|>"
    assert "im_start" in info["chat_template"]
    body = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert body["token_strs"] == ["hello", "Ġworld"] and body["count"] == 2


def test_metric_families_and_rejections_are_not_aborts(http: httpx.Client, client, server) -> None:
    before = wait_idle(http)
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "hi", "n": 0}).status_code == 400
        assert http.post("/v1/completions", json={"prompt": [10**9]}).status_code == 400
    client.completions.create(model=server.model, prompt="hi", max_tokens=2, stream=False)
    after = wait_idle(http)
    aborted = "vllm:request_aborted_total"
    assert metric_value(after, aborted) == metric_value(before, aborted)
    for name in (
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info",
        "vllm:iteration_tokens_total_count", "vllm:inter_token_latency_seconds_count",
        "vllm:request_queue_time_seconds_count", "vllm:request_inference_time_seconds_count",
        "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
        "vllm:request_params_n_count", "vllm:request_params_max_tokens_count",
    ):
        metric_value(after, name)  # present
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count",
                 "vllm:request_inference_time_seconds_count"):  # the request was observed
        assert metric_value(after, name) > metric_value(before, name), name


# ---- text that is not valid Unicode --------------------------------------------------------------
SURROGATE = "\udfff"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}]}),
        ("/v1/completions", {"prompt": SURROGATE}),
        ("/v1/completions", {"prompt": ["ok", "x" + SURROGATE]}),
        ("/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}),
        ("/v1/completions", {"prompt": "hi", "bad_words": [SURROGATE]}),
        ("/v1/completions", {"prompt": "hi", "guided_json": {"enum": [SURROGATE]}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "chat_template_kwargs": {"k": SURROGATE}}),
        ("/tokenize", {"prompt": SURROGATE}),
        ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ],
)
def test_lone_surrogates_are_400(http: httpx.Client, path: str, body: dict) -> None:
    resp = raw_post(http, path, body)
    assert resp.status_code == 400, resp.text
    assert "surrogate" in resp.json()["error"]["message"]


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools> Call with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>ipython<|end_header_id|>{{ tools | tojson }}"
    "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
    "<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    "{# <|python_tag|> #}"
)


@pytest.mark.parametrize(
    ("template", "reply"),
    [
        (HERMES_TEMPLATE,
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
        (LLAMA3_TEMPLATE, '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ],
    ids=["hermes", "llama3_json"],
)
def test_auto_tool_calls_in_hermes_and_llama3_styles(client: openai.OpenAI, http, server,
                                                     template, reply) -> None:
    """A template that renders tools itself gets them (and its parser is picked from it)."""
    import re

    shown = http.post("/tokenize", json={"messages": ASK, "tools": [WEATHER],
                                         "chat_template": template}).json()["tokens"]
    assert '"get_weather"' in http.post("/detokenize", json={"tokens": shown}).json()["prompt"]
    for stream in (False, True):
        kw = dict(model=server.model, messages=ASK, max_tokens=40, temperature=0,
                  tools=[WEATHER],
                  extra_body={"chat_template": template, "guided_regex": re.escape(reply)})
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            calls = [tc for c in chunks if c.choices
                     for tc in (c.choices[0].delta.tool_calls or [])]
        else:
            calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Rome"})], stream
