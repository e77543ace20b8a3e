"""`StructuredOutputsParams`: what shape a request's output must take (vLLM's names).

Exactly one of `json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one
of a list of strings) or `grammar` (Lark, or GBNF/EBNF with `::=` rules, as llguidance reads
them) is set. Each is turned into one llguidance grammar text (`grammar_text`) and checked at
construction, without a tokenizer, so a bad schema, regex or grammar raises `ValueError` before
anything is queued.

JSON schemas are *strict* by default, as OpenAI's `strict: true` and vLLM's default backend:
an object schema that lists `properties` and says nothing about `additionalProperties` allows
no other keys. `disable_any_whitespace` forbids whitespace between JSON tokens (the compact
form); otherwise JSON may carry whitespace, as vLLM's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _strict_schema(node: Any) -> Any:
    """A copy of a JSON schema where every object with `properties` and no
    `additionalProperties` gets `additionalProperties: false`."""
    if isinstance(node, list):
        return [_strict_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_schema(v) for k, v in node.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass
class StructuredOutputsParams:
    """One request's output constraint; vLLM's `StructuredOutputsParams` (and the older
    `GuidedDecodingParams`) field names."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    strict: bool = True
    #: The llguidance grammar text the fields above compile to (set by `__post_init__`).
    grammar_text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice or "
                f"grammar; got {given or 'none'}"
            )
        for name in ("disable_any_whitespace", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured outputs: {name} must be True or False")
        self.grammar_text = self._grammar_text(given[0])
        validate_grammar(self.grammar_text, given[0])

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def _grammar_text(self, kind: str) -> str:
        import llguidance

        if kind in ("json", "json_object"):
            if kind == "json_object":
                if self.json_object is not True:
                    raise ValueError("structured outputs: json_object must be True")
                schema: Any = {"type": "object"}
            elif isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured outputs: json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    "structured outputs: json must be a JSON schema (an object, or its text), "
                    f"got {type(schema).__name__}"
                )
            if self.strict:
                schema = _strict_schema(schema)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema),
                    defaults={"whitespace_flexible": not self.disable_any_whitespace},
                )
            except (ValueError, TypeError) as exc:
                raise ValueError(f"structured outputs: bad JSON schema: {exc}") from None
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("structured outputs: regex must be a non-empty string")
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            c = self.choice
            if (
                not isinstance(c, list | tuple)
                or not c
                or not all(isinstance(s, str) and s for s in c)
            ):
                raise ValueError(
                    "structured outputs: choice must be a non-empty list of non-empty strings, "
                    f"got {c!r}"
                )
            self.choice = list(c)
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("structured outputs: grammar must be a non-empty string")
        try:
            return llguidance.grammar_from("grammar", self.grammar)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured outputs: bad grammar: {exc}") from None


#: vLLM's older name for the same parameters (`SamplingParams.guided_decoding`).
GuidedDecodingParams = StructuredOutputsParams


def validate_grammar(grammar_text: str, kind: str = "grammar") -> None:
    """Raise `ValueError` with llguidance's message when `grammar_text` does not compile."""
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(grammar_text)
    except (ValueError, TypeError, RuntimeError) as exc:
        err = str(exc)
    if err:
        raise ValueError(f"structured outputs: bad {kind}: {err.strip()}")
