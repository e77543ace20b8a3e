"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

These models are the API's contract: FastAPI validates every request against them and builds
`/openapi.json` from them, so bounds written here (``ge=``, ``le=``) are both enforced (a value
outside gets a 400) and published. Field names and defaults follow OpenAI's API; the extras
(`top_k`, `min_p`, ...) follow vLLM's names so that vLLM clients work unchanged.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds shared by both endpoints. They keep every accepted value inside what the engine
# handles (no NaN, no infinities, integers that fit in int64) and follow OpenAI where it has one.
MAX_N = 128  # OpenAI's bound on n
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs; vLLM's default max_logprobs
MAX_STOP = 16  # OpenAI allows 4 stop sequences; vLLM has no limit
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(
        False, description="send one last chunk, before [DONE], whose `usage` covers the request"
    )


class _SamplingFields(BaseModel):
    """Fields that both /v1/completions and /v1/chat/completions accept."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(
        None, description="a name from GET /v1/models; omitted means the first served name"
    )
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int | None = Field(1, ge=1, le=MAX_N, description="completions to return per prompt")
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = Field(None, description="strings that end generation (not returned)")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="-1 or 0: off")
    min_p: float | None = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    # A penalty near 0 divides logits by it: 1e-300 turns them into inf. The bounds keep the
    # penalised logits finite for any model (|logit| < 1e4 -> < 1e6).
    repetition_penalty: float | None = Field(
        1.0, ge=0.01, le=100.0, allow_inf_nan=False, description="1 = off; vLLM's meaning"
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=INT64_MAX)
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(1.0, ge=-100.0, le=100.0, allow_inf_nan=False)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field(max_length=10_000_000)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(
        ...,
        description="a string, a list of strings, a list of token ids or a list of token-id lists",
    )
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX, description="most tokens to generate")
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="alternatives to return per generated token"
    )
    echo: bool | None = False
    suffix: str | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's extra: each choice also carries its `token_ids` (and "
        "`prompt_token_ids`); always on when the server runs without a tokenizer",
    )


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="deprecated by OpenAI; use max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="most tokens to generate; default: the rest of the context",
    )
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True


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
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """POST /tokenize: either `prompt` or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Annotated[str, Field(max_length=10_000_000)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


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
