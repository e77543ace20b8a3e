"""Tool calling: tools into the prompt, constraints for forced calls, tool calls out of the text.

OpenAI's `tools` + `tool_choice` on any chat model:

* ``"required"`` and a named function are *constrained*: the output must be JSON that follows
  the tools' schemas (structured output, `forced_call_schema`), so the arguments always parse;
* ``"auto"`` lets the model answer freely; a `ToolParser` finds the calls in the text, in the
  format the chat template taught the model: Hermes (``<tool_call>{...}</tool_call>``), Llama
  3.x JSON (``{"name": ..., "parameters": ...}``, maybe after ``<|python_tag|>``), or SmolLM2's
  list inside ``<tool_call>`` tags;
* ``"none"``: the tools are not shown to the model and nothing is parsed.

A chat template that does not render tools itself (the embedded SmolLM2 template) gets them in
a system message in SmolLM2's function-calling format (`tools_system_prompt`), and assistant
tool calls sent back are written the same way, so the model sees its own format.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

#: The parsers `--tool-call-parser` accepts ("auto" picks one from the chat template).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "smollm2")

_SMOLLM2_TOOLS_PROMPT = """You are an expert in composing functions. You are given a question \
and a set of possible functions. Based on the question, you will need to make one or more \
function/tool calls to achieve the purpose. If none of the functions can be used, point it out \
and refuse to answer. If the given question lacks the parameters required by the function, \
also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no \
function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the `tools` variable (otherwise we describe them)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def pick_parser(name: str, template: str | None) -> ToolParser:
    """The parser `name` names; "auto": Llama 3.x JSON for templates with ``<|python_tag|>`` or
    an ``ipython`` role, Hermes otherwise (also SmolLM2's list form)."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {TOOL_CALL_PARSERS}")
    if name == "auto":
        t = template or ""
        if template_renders_tools(t) and ("<|python_tag|>" in t or "ipython" in t):
            name = "llama3_json"
        elif template_renders_tools(t):
            name = "hermes"
        else:
            name = "smollm2"
    return Llama3JsonParser() if name == "llama3_json" else HermesParser(name)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """SmolLM2's function-calling system prompt for `tools` (OpenAI tool dicts)."""
    functions = [t["function"] for t in tools]
    return _SMOLLM2_TOOLS_PROMPT.format(tools=json.dumps(functions, ensure_ascii=False))


def calls_as_text(calls: list[dict[str, Any]]) -> str:
    """Assistant tool calls written back in SmolLM2's format (for templates without tools)."""
    items = []
    for c in calls:
        args: Any = c["function"]["arguments"]
        with contextlib.suppress(TypeError, json.JSONDecodeError):  # else sent as it came
            args = json.loads(args)
        items.append({"name": c["function"]["name"], "arguments": args})
    return "<tool_call>" + json.dumps(items, ensure_ascii=False) + "</tool_call>"


def forced_call_schema(tools: list[dict[str, Any]], named: str | None,
                       parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must follow: a named function's arguments, or (``required``)
    a non-empty list of ``{"name", "parameters"}`` calls to any of the tools (vLLM's form)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if named is not None:
        return by_name[named].get("parameters") or {"type": "object"}
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for name, fn in by_name.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, named: str | None) -> list[ParsedCall] | None:
    """The calls in a constrained output; None when it does not parse (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if named is not None:
        return [ParsedCall(named, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return None
    return [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in value if isinstance(c, dict) and "name" in c and "parameters" in c]


def _call_from(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int | None:
    """Where a prefix of `marker` begins at the end of `text` (a marker still arriving)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


class ToolParser:
    """Finds tool calls in a model's free text (tool_choice "auto")."""

    name = "base"

    def start(self, text: str) -> int | None:
        """Where a tool call may begin in `text` (streaming holds the text back from there)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content outside the calls, the calls); no calls: the text is content as it is."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen), or a JSON
    list of such calls inside one pair of tags (SmolLM2)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def __init__(self, name: str = "hermes") -> None:
        self.name = name

    def start(self, text: str) -> int | None:
        i = text.find(self.OPEN)
        return i if i >= 0 else _partial_suffix(text, self.OPEN)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(self.OPEN)
        if i < 0:
            return text, []
        calls: list[ParsedCall] = []
        for m in self._BLOCK.finditer(text, i):
            try:
                value = json.loads(m.group(1).strip())
            except json.JSONDecodeError:
                return text, []
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = _call_from(item)
                if call is None:
                    return text, []
                calls.append(call)
        if not calls:
            return text, []
        content = text[:i].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, several separated by
    ``;``, optionally after ``<|python_tag|>``; the whole reply is the call."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        i = text.find(self.TAG)
        if i >= 0:
            return i
        stripped = text.lstrip()
        if stripped and (stripped.startswith("{") or self.TAG.startswith(stripped)):
            return len(text) - len(stripped)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(self.TAG)
        content = text[:i].strip() if i >= 0 else ""
        body = text[i + len(self.TAG):] if i >= 0 else text
        body = body.strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return (content or None), calls
