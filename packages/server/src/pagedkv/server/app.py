"""`build_app`: the FastAPI application around one engine.

The engine is anything with the `AsyncLLMEngine` interface (`generate`, `abort`,
`get_tokenizer`, `model_config`, `errored`, `get_stats`); the app neither starts nor stops it,
so the same factory serves the CLI, tests with a real engine in-process, and embedders.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedkv.server.__about__ import __version__
from pagedkv.server.errors import APIError, bad_request, install_error_handlers
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    VersionResponse,
)
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.serving_chat import ChatServing
from pagedkv.server.serving_completion import CompletionServing
from pagedkv.server.streams import ClientDisconnected

logger = logging.getLogger(__name__)

#: Default body limit: far above any prompt that fits a context window, far below memory trouble.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": desc}
    for status, desc in (
        (400, "invalid value (OpenAI error body)"),
        (401, "missing or wrong API key (when the server has one)"),
        (404, "unknown model"),
        (413, "request body too large"),
        (500, "unexpected server error"),
        (503, "the engine loop has stopped"),
    )
}
_SSE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events ending with `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **_ERRORS,
}


def _engine_version() -> str | None:
    try:
        from pagedkv.engine import __version__ as v
    except Exception:  # pragma: no cover - the engine always has one
        return None
    return str(v)


def build_app(
    engine: Any,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_root: str | None = None,
    chat_template: str | None = None,
    tool_call_parser: str = "auto",
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """An OpenAI-compatible app over `engine`, serving it under `served_model_names`.

    `api_key`: when set, every /v1/* request and the tokenizer endpoints (/tokenize,
    /detokenize, /tokenizer_info) need `Authorization: Bearer <api_key>`.
    `max_body_bytes`: larger request bodies get a 413 before they are parsed.
    `chat_template`: a Jinja chat template replacing the tokenizer's.
    `tool_call_parser`: how tool calls are found in replies under `tool_choice: "auto"`
    (`pagedkv.server.tool_calls.TOOL_CALL_PARSERS`; "auto" picks from the chat template).
    `trust_request_chat_template`: render a request's own `chat_template` (otherwise a 400).
    """
    app = FastAPI(
        title="pagedkv OpenAI-compatible server",
        version=__version__,
        description="OpenAI-compatible completions and chat over the pagedkv engine.",
    )
    metrics = ServerMetrics(engine, served_model_names[0] if served_model_names else "")
    serving = OpenAIServing(engine, served_model_names, metrics)
    completions = CompletionServing(serving)
    chat = ChatServing(
        serving,
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        trust_request_chat_template=trust_request_chat_template,
    )
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.engine = engine
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        logger.info("%s %s: client disconnected; request aborted", request.method, request.url.path)
        return Response(status_code=499)

    def _sse(body: Any) -> StreamingResponse:
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=_SSE_DOC,
        summary="Create a text completion (OpenAI API)",
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        result = await completions.create(body, request)
        return result if isinstance(result, CompletionResponse) else _sse(result)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=_SSE_DOC,
        summary="Create a chat completion (OpenAI API)",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        result = await chat.create(body, request)
        return result if isinstance(result, ChatCompletionResponse) else _sse(result)

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            root=model_root or name,
            max_model_len=serving.max_model_len,
            vocab_size=serving.vocab_size,
        )

    @app.get(
        "/v1/models", response_model=ModelList, responses=_ERRORS, summary="List served models"
    )
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in serving.served_model_names])

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        responses=_ERRORS,
        summary="Describe one served model",
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id not in serving.served_model_names:
            raise APIError(
                404,
                f"The model `{model_id}` does not exist. Served models: "
                f"{serving.served_model_names}",
                param="model",
                code="model_not_found",
            )
        return card(model_id)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "the engine loop is alive (empty body)"},
            503: _ERRORS[503],
        },
        summary="Liveness of the engine loop",
    )
    async def health() -> Response:
        try:
            check = getattr(engine, "check_health", None)
            if check is not None:
                await check()
            if getattr(engine, "errored", False):
                raise RuntimeError("the engine loop has stopped")
        except Exception as exc:
            raise APIError(503, f"unhealthy: {exc}") from exc
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                "description": "Prometheus text format",
            }
        },
        summary="Prometheus metrics (vLLM names)",
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        response_model_exclude_none=True,
        responses=_ERRORS,
        summary="Tokenize a prompt or chat messages",
    )
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.resolve_model(body.model)
        serving.require_tokenizer(
            "messages" if body.messages is not None else "prompt",
            "/tokenize has nothing to tokenize with",
        )
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        # /tokenize counts tokens for clients: it takes texts up to the body limit, but one
        # that must be longer than the context is refused before it is tokenized.
        if body.messages is not None:
            continue_final = bool(body.continue_final_message)
            add_gen = body.add_generation_prompt is not False
            if continue_final and "add_generation_prompt" not in body.model_fields_set:
                add_gen = False
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            tokens = await chat.render_chat(
                body.messages,
                add_gen,
                continue_final_message=continue_final,
                add_special_tokens=body.add_special_tokens is True
                and "add_special_tokens" in body.model_fields_set,
                template=body.chat_template,
                template_kwargs=body.chat_template_kwargs,
                tools=tools,
                limit=serving.max_model_len,
            )
        else:
            tokens = await serving.encode(
                body.prompt or "",
                add_special_tokens=body.add_special_tokens is not False,
                limit=serving.max_model_len,
            )
        strs = None
        if body.return_token_strs:
            strs = await serving.worker.run(
                serving.worker.tokenizer.convert_ids_to_tokens, tokens
            )
        return TokenizeResponse(
            count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens,
            token_strs=strs,
        )

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=_ERRORS,
        summary="Turn token ids back into text",
    )
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.resolve_model(body.model)
        serving.require_tokenizer("tokens", "/detokenize has nothing to decode with")
        serving.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await serving.decode(body.tokens))

    @app.get(
        "/tokenizer_info",
        response_model=TokenizerInfo,
        responses=_ERRORS,
        summary="The tokenizer's settings and chat template",
    )
    async def tokenizer_info() -> TokenizerInfo:
        tok = serving.require_tokenizer(None, "/tokenizer_info has no tokenizer to describe")

        def special(name: str) -> str | None:
            value = getattr(tok, name, None)
            return value if isinstance(value, str) else None

        add_bos = getattr(tok, "add_bos_token", None)
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            vocab_size=serving.vocab_size,
            model_max_length=serving.max_model_len,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            chat_template=chat.chat_template,
        )

    @app.get("/version", response_model=VersionResponse, summary="Server and engine versions")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__, engine_version=_engine_version())

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"message": "pagedkv OpenAI-compatible server", "docs": "/docs"})

    # Outermost first: the API key is checked before a big body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(
            APIKeyMiddleware,
            api_key=api_key,
            prefixes=("/v1", "/tokenize", "/detokenize", "/tokenizer_info"),
        )
    return app
