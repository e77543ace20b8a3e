"""Tool-call parsing and the schemas that force calls, without a server: each parser against
texts written the way its models write calls, and what must *not* parse as a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedkv.server.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    calls_as_text,
    forced_call_schema,
    parse_forced,
    pick_parser,
    template_renders_tools,
    tools_system_prompt,
)

TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "b"}},
]


def _calls(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_single_list_and_several_blocks() -> None:
    p = HermesParser()
    assert _calls(p.parse('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>')) == (
        None, [("a", {"x": 1})])
    smol = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert _calls(p.parse(smol + "</tool_call>")) == (None, [("a", {"x": 1}), ("b", {})])
    two = ('Let me check. <tool_call>{"name": "a", "arguments": {"x": 2}}</tool_call>\n'
           '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>')
    assert _calls(p.parse(two)) == ("Let me check.", [("a", {"x": 2}), ("b", {})])


@pytest.mark.parametrize("text", [
    "no call here",
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
])
def test_hermes_leaves_non_calls_as_content(text: str) -> None:
    assert HermesParser().parse(text) == (text, [])


def test_hermes_holds_back_a_marker_still_arriving() -> None:
    p = HermesParser()
    assert p.start("Sure <tool") == 5
    assert p.start("Sure <tool_call>{") == 5
    assert p.start("Sure, no call") is None


def test_llama3_json() -> None:
    p = Llama3JsonParser()
    assert _calls(p.parse('{"name": "a", "parameters": {"x": 3}}')) == (None, [("a", {"x": 3})])
    both = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert _calls(p.parse(both)) == (None, [("a", {"x": 1}), ("b", {})])
    assert p.parse("Paris is sunny.") == ("Paris is sunny.", [])
    assert p.parse('{"name": "a", "parameters": {"x": 1}') == (
        '{"name": "a", "parameters": {"x": 1}', [])
    assert p.start("  {") == 2 and p.start("<|pyt") == 0 and p.start("Hello") is None


def test_parser_chosen_from_the_template() -> None:
    assert isinstance(pick_parser("auto", "{{ tools }} <|python_tag|>"), Llama3JsonParser)
    assert pick_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert pick_parser("auto", "{{ messages }}").name == "smollm2"
    assert pick_parser("llama3_json", None).name == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        pick_parser("mistral", None)
    assert not template_renders_tools("{{ message['content'] }}")


def test_forced_schemas_accept_exactly_the_calls() -> None:
    named = forced_call_schema(TOOLS, "a", True)
    jsonschema.validate({"x": 1}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": "1"}, named)
    required = forced_call_schema(TOOLS, None, True)
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}],
                        required)
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = forced_call_schema(TOOLS, None, False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {}}] * 2, single)
    calls = parse_forced('[{"name": "a", "parameters": {"x": 1}}]', None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1})]
    assert parse_forced('{"x": 1', "a") is None


def test_tools_written_for_templates_without_tools() -> None:
    prompt = tools_system_prompt(TOOLS)
    assert '"name": "a"' in prompt and "<tool_call>[" in prompt
    text = calls_as_text([{"function": {"name": "a", "arguments": '{"x": 1}'}}])
    assert _calls(HermesParser("smollm2").parse(text)) == (None, [("a", {"x": 1})])
