"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

These models are the API's contract: FastAPI validates every request against them and builds
`/openapi.json` from them, so bounds written here (``ge=``, ``le=``) are both enforced (a value
outside gets a 400) and published. Field names and defaults follow OpenAI's API; the extras
(`top_k`, `min_p`, ...) follow vLLM's names so that vLLM clients work unchanged.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt

# Bounds shared by both endpoints. They keep every accepted value inside what the engine
# handles (no NaN, no infinities, integers that fit in int64) and follow OpenAI where it has one.
MAX_N = 128  # OpenAI's bound on n
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs; vLLM's default max_logprobs
MAX_STOP = 16  # OpenAI allows 4 stop sequences; vLLM has no limit
MAX_TOOLS = 128  # OpenAI's bound on tools
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _valid_unicode(value: str) -> str:
    """JSON may carry lone UTF-16 surrogates (``"\\udfff"``) that no tokenizer can encode:
    refuse them here, for every text field, instead of failing deep in the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text has a lone UTF-16 surrogate ({value[exc.start]!r} at character {exc.start}), "
            "which is not valid Unicode; send valid UTF-8 text"
        ) from None
    return value


#: Every string field: valid Unicode only (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
#: JSON booleans and integers only: ``"yes"`` is no boolean, ``1.0`` no integer (pydantic's
#: lax mode would accept both).
Bool = StrictBool
Int = StrictInt
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
#: A JSON number (no string such as "0.5", no NaN or infinity).
Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def _valid_json_text(value: Any) -> Any:
    """Strings anywhere inside free-form JSON (schemas, template arguments) are valid Unicode."""
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, dict):
        for k, v in value.items():
            _valid_json_text(k)
            _valid_json_text(v)
    elif isinstance(value, list):
        for v in value:
            _valid_json_text(v)
    return value


JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_json_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Bool | None = Field(
        False, description="send one last chunk, before [DONE], whose `usage` covers the request"
    )
    continuous_usage_stats: Bool | None = Field(
        False, description="vLLM's extra: every chunk carries the `usage` so far"
    )


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text = Field("response", max_length=64)
    description: Text | None = None
    json_schema: JSONObject | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (JSON that follows the schema; strict: no keys the schema does not list)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (exactly one of json, json_object, regex,
    choice, grammar)."""

    model_config = ConfigDict(extra="forbid")

    json_: Text | JSONObject | None = Field(None, alias="json")
    json_object: Bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    disable_any_whitespace: Bool | None = False


#: Fields of OpenAI's or vLLM's API that pagedkv cannot honour: (values that ask for nothing,
#: what to do instead). Any other value is a 400 that says so, never a silent 200. Fields no
#: API defines are ignored, as OpenAI does.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "priority": ((0, None), "requests are scheduled first come, first served"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "mm_processor_kwargs": ((None, {}), "this server serves text-only models"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "cache_salt": ((None,), "the prefix cache has no salt"),
    "kv_transfer_params": ((None,), "there is no disaggregated prefill"),
    "vllm_xargs": ((None, {}), "there are no custom sampling extensions"),
    "documents": ((None, []), "documents are not given to chat templates; put them in messages"),
    "functions": ((None, []), "use tools"),
    "function_call": ((None,), "use tool_choice"),
    "audio": ((None,), "this server answers with text"),
    "modalities": ((None, ["text"]), "this server answers with text"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "there is no web search"),
    "reasoning_effort": ((None,), "the model has no reasoning modes"),
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "request_id": ((None,), "the server names requests itself"),
}


class _SamplingFields(BaseModel):
    """Fields that both /v1/completions and /v1/chat/completions accept."""

    # extra fields are kept (and then ignored) so that UNSUPPORTED_FIELDS can be refused
    model_config = ConfigDict(extra="allow")

    model: Text | None = Field(
        None, description="a name from GET /v1/models; omitted means the first served name"
    )
    temperature: Finite | None = Field(1.0, ge=0.0, le=2.0)
    top_p: Finite | None = Field(1.0, gt=0.0, le=1.0)
    n: Int | None = Field(1, ge=1, le=MAX_N, description="completions to return per prompt")
    stop: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = Field(None, description="strings that end generation (not returned)")
    seed: Int | None = Field(
        None, ge=INT64_MIN, le=INT64_MAX, description=f"an integer in [{INT64_MIN}, {INT64_MAX}]"
    )
    presence_penalty: Finite | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Text, Finite] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: Int | None = Field(None, ge=-1, le=INT64_MAX, description="-1 or 0: off")
    min_p: Finite | None = Field(0.0, ge=0.0, le=1.0)
    # A penalty near 0 divides logits by it: 1e-300 turns them into inf. The bounds keep the
    # penalised logits finite for any model (|logit| < 1e4 -> < 1e6).
    repetition_penalty: Finite | None = Field(
        1.0, ge=0.01, le=100.0, description="1 = off; vLLM's meaning"
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    ignore_eos: Bool | None = False
    min_tokens: Int | None = Field(0, ge=0, le=INT64_MAX)
    use_beam_search: Bool | None = False
    length_penalty: Finite | None = Field(1.0, ge=-100.0, le=100.0)
    include_stop_str_in_output: Bool | None = False
    skip_special_tokens: Bool | None = True
    spaces_between_special_tokens: Bool | None = True
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, max_length=1_000_000, description="every other token is masked"
    )
    bad_words: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, max_length=1024, description="words the output never contains"
    )
    prompt_logprobs: Int | None = Field(
        None, ge=-1, le=MAX_LOGPROBS, description="alternatives per prompt token (-1: all)"
    )
    truncate_prompt_tokens: Int | None = Field(
        None, ge=-1, le=INT64_MAX, description="keep the last k prompt tokens (-1: the context)"
    )
    return_tokens_as_token_ids: Bool | None = Field(
        None, description="logprob tokens as `token_id:<id>` strings"
    )
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Text | JSONObject | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = Field(
        None, description="only llguidance (or auto) is served"
    )
    guided_whitespace_pattern: Text | None = Field(None, description="not supported (400)")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: (
        Annotated[Text, Field(max_length=10_000_000)]
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(
        ...,
        description="a string, a list of strings, a list of token ids or a list of token-id lists",
    )
    max_tokens: Int | None = Field(16, ge=1, le=INT64_MAX, description="most tokens to generate")
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    logprobs: Int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="alternatives to return per generated token"
    )
    echo: Bool | None = False
    suffix: Text | None = None
    add_special_tokens: Bool | None = True
    return_token_ids: Bool | None = Field(
        None,
        description="vLLM's extra: each choice also carries its `token_ids` (and "
        "`prompt_token_ids`); always on when the server runs without a tokenizer",
    )


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: Text
    arguments: Text = Field(..., description="the arguments as a JSON text")


class ToolCall(BaseModel):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    #: OpenAI's roles, and any other the chat template knows (vLLM passes custom roles on).
    role: Annotated[Text, Field(min_length=1, max_length=64)]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None


class FunctionDefinition(BaseModel):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: Bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int | None = Field(
        None, ge=1, le=INT64_MAX, description="deprecated by OpenAI; use max_completion_tokens"
    )
    max_completion_tokens: Int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="most tokens to generate; default: the rest of the context",
    )
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=-1, le=MAX_LOGPROBS, description="-1: every token")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = True
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = Field(
        False, description="the last (assistant) message is left open and continued"
    )
    echo: Bool | None = Field(
        False, description="the reply starts with the last message's content when it has the "
        "reply's role"
    )
    add_special_tokens: Bool | None = False
    chat_template: Text | None = Field(None, description="a Jinja chat template for this request")
    chat_template_kwargs: JSONObject | None = Field(
        None, description="extra variables for the chat template"
    )


# ---- responses -------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extras (with `return_token_ids`, or a server without a tokenizer): the generated
    # ids (in a streamed chunk, the new ones) and the prompt's (in a stream, first chunk only).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    #: vLLM's extra (with `prompt_logprobs`): per prompt token, token id -> {logprob, rank,
    #: decoded_token}; the first position is None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """One server-sent event of a streamed completion (same object type as OpenAI's)."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None
    #: pagedkv's extra: token ids are below this (what `pagedkv bench serve` draws prompts from)
    vocab_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """POST /tokenize: either `prompt` or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Annotated[Text, Field(max_length=10_000_000)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Bool | None = True
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = False
    return_token_strs: Bool | None = Field(False, description="also each token's text")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template: Text | None = None
    chat_template_kwargs: JSONObject | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info: what a client needs to tokenize as the server does."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None
    chat_template: str | None = None


class VersionResponse(BaseModel):
    version: str
    engine_version: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as plain JSON-ready data (used for SSE chunks)."""
    return model.model_dump(mode="json")
