"""The OpenAI endpoints' logic: requests in, engine streams, responses (or SSE chunks) out.

Everything a user can get wrong is checked here, before the engine sees the request: the
model name, the prompt (empty, out-of-vocabulary token ids, longer than the context), and
every sampling value (the engine's `SamplingParams` validates them and its `ValueError` becomes
a 400). The engine loop must never die of a user's input, and a field we accept is a field we
honour: one we cannot honour gets a 400 that says so.

Tokenizing and detokenizing whole prompts, rendering chat templates and compiling grammars
run on one worker thread with its own copy of the tokenizer (`TokenizerWorker`), never on the
event loop: a 4 MB prompt must not stall /health or the other streams. A text that must be
longer than the context is refused before it is tokenized (a lower bound from its bytes).

Streams ask the engine for *delta* outputs (what is new since the stream last ran: a client
that falls behind gets bigger chunks, never a queue), non-streaming requests for the final
output only. Each streamed chunk is built as a plain dict and encoded by msgspec: per-token
work for hundreds of streams is what this process spends its time on, so it stays lean.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from pagedkv.engine import SamplingParams
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.server.errors import APIError, bad_request, error_body
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    UNSUPPORTED_FIELDS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from pagedkv.server.streams import (
    ClientDisconnected,
    aclose_quietly,
    merge_streams,
    run_unless_disconnected,
    start_stream,
)
from pagedkv.server.tool_calls import (
    ParsedCall,
    ToolParser,
    calls_as_text,
    forced_call_schema,
    new_call_id,
    parse_forced,
    pick_parser,
    template_renders_tools,
    tools_system_prompt,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: JSON has no -inf: a logprob of -inf (a token the filters ruled out) is sent as this, like vLLM.
LOGPROB_FLOOR = -9999.0

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}

#: What a request that needs text gets from a server whose engine has no tokenizer.
NO_TOKENIZER = (
    "this server runs without a tokenizer (--skip-tokenizer-init): send prompts as token ids"
)

#: Backends `guided_decoding_backend` may name: pagedkv has one (llguidance).
_BACKENDS = ("auto", "llguidance", "guidance")

#: chat_template_kwargs names that the request's own fields set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
     "continue_final_message", "chat_template", "documents", "return_dict"}
)


def _clean_logprob(value: float | None) -> float:
    if value is None or math.isnan(value):
        return LOGPROB_FLOOR
    return max(float(value), LOGPROB_FLOOR)


def _top(ranked: list[Any], num_top: int) -> list[Any]:
    """The first `num_top` alternatives; -1: all of them."""
    return ranked if num_top < 0 else ranked[:num_top]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event; OpenAI clients read `data: <json>` lines separated by blank lines."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


_JSON = msgspec.json.Encoder()


def sse_json(data: dict[str, Any]) -> bytes:
    """`sse` for a chunk on the hot path: the same event, encoded by msgspec (compact JSON)."""
    return b"data: " + _JSON.encode(data) + b"\n\n"


def _stop_reason(finish: str | None, stop_reason: Any) -> int | str | None:
    return stop_reason if finish is not None and isinstance(stop_reason, int | str) else None


@dataclass(slots=True)
class PreparedPrompt:
    text: str | None  # what the user sent, when it was text (for echo)
    token_ids: list[int]


@dataclass(slots=True)
class _ChoiceState:
    """What a streamed choice has sent so far (engine outputs are cumulative)."""

    text_len: int = 0
    prefix_len: int = 0  # characters of echoed prompt sent before the generated text
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
    # chat with tools: the whole text so far, how much of it went out as content, and the
    # logprobs of tokens whose text is held back
    text: str = ""
    sent: int = 0
    pending_logprobs: list[Any] = field(default_factory=list)
    call_id: str | None = None


@dataclass(slots=True)
class _Tools:
    """A chat request's tool handling: `mode` None (no tools or "none"), "auto", "required"
    or "named"."""

    mode: str | None
    tools: list[dict[str, Any]] | None = None
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None


class TokenizerWorker:
    """One thread with its own copy of the tokenizer: whole-prompt tokenization,
    detokenization, chat templates and grammar compilation run there, off the event loop.

    One thread, so the copy is never used by two threads at once; the event loop keeps the
    engine's tokenizer for its per-token work."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer")
        #: Most UTF-8 bytes one token can stand for (4 per character of its vocabulary entry:
        #: byte-level entries are one character per byte, others at most 4 bytes per character);
        #: a text of B bytes has at least B / this many tokens.
        self.max_token_bytes: int | None = None
        get_vocab = getattr(tokenizer, "get_vocab", None)
        if callable(get_vocab):
            with_added = list(get_vocab())
            if with_added:
                self.max_token_bytes = 4 * max(len(t) for t in with_added)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def min_tokens(self, text: str) -> tuple[int, int]:
        """(a lower bound on the tokens of `text`, its UTF-8 bytes)."""
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise bad_request(
                f"text has a lone UTF-16 surrogate at character {exc.start}, which is not valid "
                "Unicode; send valid UTF-8 text"
            ) from None
        if not self.max_token_bytes:
            return 0, nbytes
        return -(-nbytes // self.max_token_bytes), nbytes

    def encode(self, text: str, add_special_tokens: bool, limit: int | None, param: str
               ) -> list[int]:
        """Token ids of `text`; a 400 when it is not valid Unicode or must have more than
        `limit` tokens (checked from its length before tokenizing)."""
        bound, nbytes = self.min_tokens(text)
        if limit is not None and bound > limit:
            raise bad_request(
                f"the prompt has at least {bound} tokens ({nbytes} bytes of text, at most "
                f"{self.max_token_bytes} bytes per token), more than this model's maximum "
                f"context length of {limit} tokens; shorten the prompt",
                param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


class OpenAIServing:
    """Holds the engine, a tokenizer worker and the metrics; one instance per app.

    An engine without a tokenizer (`--skip-tokenizer-init`, or a bundled shape-only config for
    benchmarks) is served on token ids alone, as vLLM does: completions take token-id prompts
    and answer with `token_ids` and empty text; whatever needs text (text prompts, chat, stop
    strings, /tokenize, /detokenize) gets a 400 that says so.
    """

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        metrics: ServerMetrics,
        *,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        trust_request_chat_template: bool = False,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        # The engine's own (API-process) tokenizer: the engine detokenizes with it on this
        # event loop's thread, as we do for single tokens, so sharing it is safe. Whole
        # prompts go to the worker's copy.
        self.tokenizer: Any = engine.get_tokenizer()
        if self.tokenizer is None:
            logger.info("the engine has no tokenizer: serving token-id prompts only")
        self.worker = TokenizerWorker(self.tokenizer)
        config = engine.model_config
        self.max_model_len = int(config.max_model_len)
        kv = getattr(config, "kv_capacity", None)
        self.kv_capacity = int(kv) if isinstance(kv, int) else None
        vocab = getattr(config, "vocab_size", None)
        if vocab:
            self.vocab_size = int(vocab)
        elif self.tokenizer is not None:
            self.vocab_size = len(self.tokenizer)
        else:
            raise ValueError(
                "the engine has neither a tokenizer nor a vocab_size in its model config, so "
                "prompt token ids cannot be checked; give the model config a vocab_size"
            )
        self.chat_template: str | None = chat_template or getattr(
            self.tokenizer, "chat_template", None
        )
        self.tool_call_parser = tool_call_parser
        self.trust_request_chat_template = trust_request_chat_template
        pick_parser(tool_call_parser, self.chat_template)  # a bad name fails at start
        self._decode_cache: dict[int, str] = {}
        # apply_chat_template's own parameters: chat_template_kwargs may not set them
        apply = getattr(self.tokenizer, "apply_chat_template", None)
        self._template_params: frozenset[str] = frozenset(
            name
            for name, p in (inspect.signature(apply).parameters.items() if apply else ())
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )

    # ---- checks shared by all endpoints ----------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Served models: {self.served_model_names}",
                param="model",
                code="model_not_found",
            )
        return name

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise bad_request(
                    f"token id {t} is out of the vocabulary (0..{self.vocab_size - 1})", param
                )

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def require_tokenizer(self, param: str | None, why: str = "") -> Any:
        """The tokenizer, or a 400 naming what needed it when the server runs without one."""
        if self.tokenizer is None:
            raise bad_request(f"{NO_TOKENIZER}; {why}" if why else NO_TOKENIZER, param)
        return self.tokenizer

    async def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        limit: int | None = None,
        param: str = "prompt",
    ) -> list[int]:
        """Token ids of `text`, on the tokenizer worker; a 400 when it must have more than
        `limit` tokens (checked before tokenizing)."""
        self.require_tokenizer(param)
        return await self.worker.run(self.worker.encode, text, add_special_tokens, limit, param)

    async def decode(self, ids: list[int]) -> str:
        self.require_tokenizer("tokens")
        return await self.worker.run(self.worker.decode, ids)

    def decode_token(self, token_id: int, logprob: Any = None, as_id: bool = False) -> str:
        """A token's text; `token_id:<id>` with `return_tokens_as_token_ids` or without a
        tokenizer, as vLLM writes it."""
        if as_id:
            return f"token_id:{token_id}"
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        cached = self._decode_cache.get(token_id)
        if cached is None:
            cached = self.tokenizer.decode([token_id])
            if len(self._decode_cache) < 200_000:
                self._decode_cache[token_id] = cached
        return cached

    # ---- chat templates --------------------------------------------------------------------
    def conversation(
        self,
        messages: list[ChatMessage],
        template: str | None,
        tools: list[dict[str, Any]] | None,
    ) -> list[dict[str, Any]]:
        """The messages as the chat template reads them. Tools go to the template when it
        renders them; otherwise into a system message (SmolLM2's format), and assistant tool
        calls are written back in the same format."""
        renders_tools = template_renders_tools(template)
        conversation: list[dict[str, Any]] = []
        for m in messages:
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                calls = [c.model_dump() for c in m.tool_calls]
                if renders_tools:
                    for c in calls:  # templates index the arguments as a mapping
                        with contextlib.suppress(json.JSONDecodeError):
                            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                    msg["tool_calls"] = calls
                else:
                    msg["content"] = (content + "\n" if content else "") + calls_as_text(calls)
            conversation.append(msg)
        if tools and not renders_tools:
            prompt = tools_system_prompt(tools)
            if conversation and conversation[0]["role"] == "system":
                conversation[0]["content"] = conversation[0]["content"] + "\n\n" + prompt
            else:
                conversation.insert(0, {"role": "system", "content": prompt})
        return conversation

    def _render_sync(
        self,
        conversation: list[dict[str, Any]],
        template: str,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        add_special_tokens: bool,
        template_kwargs: dict[str, Any],
        limit: int | None,
    ) -> list[int]:
        tokenizer = self.worker.tokenizer
        kwargs: dict[str, Any] = dict(template_kwargs)
        if tools and template_renders_tools(template):
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise bad_request(
                f"the chat template refused these messages: {exc}", "messages"
            ) from exc
        return self.worker.encode(str(text), add_special_tokens, limit, "messages")

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        *,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """The chat prompt's token ids (rendered and tokenized on the tokenizer worker)."""
        self.require_tokenizer(
            "messages",
            "chat messages need its chat template: use /v1/completions with token-id prompts",
        )
        if template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "this server does not render chat templates sent in requests (a template is "
                "code); start it with --trust-request-chat-template, or use --chat-template",
                "chat_template",
            )
        template = template or self.chat_template
        if not template:
            raise bad_request(
                "this model has no chat template; pass one with --chat-template or the "
                "request's chat_template, or use /v1/completions",
                "messages",
            )
        kwargs = dict(template_kwargs or {})
        reserved = sorted((_RESERVED_TEMPLATE_KWARGS | self._template_params) & set(kwargs))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs cannot set {reserved}: use the request's own fields",
                "chat_template_kwargs",
            )
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "last message is either continued or followed by a new one",
                "continue_final_message",
            )
        conversation = self.conversation(messages, template, tools)
        return await self.worker.run(
            self._render_sync, conversation, template, tools, add_generation_prompt,
            continue_final_message, add_special_tokens, kwargs, limit,
        )

    # ---- lengths -------------------------------------------------------------------------------
    def text_limit(self, truncate: int | None) -> int | None:
        """The most tokens a text prompt may have (None: it is truncated, any length goes)."""
        return None if truncate is not None else self.max_model_len

    def truncate(self, ids: list[int], truncate: int | None) -> list[int]:
        """`truncate_prompt_tokens`: keep the last k tokens (-1: as many as the context allows
        with one generated token), as the engine does."""
        if truncate is None:
            return ids
        keep = self.max_model_len - 1 if truncate == -1 else truncate
        return ids[-keep:]

    def check_length(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """The number of tokens to generate, or a 400 when the context cannot hold them."""
        n = len(prompt_ids)
        if n == 0:
            raise bad_request("the prompt is empty: send at least one token", param)
        if n >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {n} tokens, which leaves no room to generate; shorten the prompt.",
                param,
            )
        if self.kv_capacity is not None and n + 1 > self.kv_capacity:
            raise bad_request(
                f"the prompt has {n} tokens but the whole KV cache holds {self.kv_capacity} "
                "tokens, so it can never run; shorten the prompt or give the server more KV "
                "cache memory",
                param,
            )
        if max_tokens is None:
            return self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return max_tokens

    def finish(
        self, reason: str | None, stop_reason: Any, num_tokens: int, prompt_len: int,
        max_tokens: int,
    ) -> tuple[str | None, int | str | None]:
        """OpenAI's finish reason and vLLM's stop reason. A sequence the engine ended with
        "length" before max_tokens and the context filled up ran out of KV cache with nothing
        else running: its stop reason says so (not only the server's log)."""
        finish = _FINISH_REASONS.get(reason or "", reason)
        stop = _stop_reason(reason, stop_reason)
        if (
            finish == "length"
            and num_tokens < max_tokens
            and prompt_len + num_tokens < self.max_model_len
        ):
            cap = f" ({self.kv_capacity} token slots)" if self.kv_capacity else ""
            stop = (
                f"kv_cache_full: the request's sequences outgrew the KV cache{cap} even with "
                "nothing else running; lower n or max_tokens, or give the server more KV cache "
                "memory"
            )
        return finish, stop

    # ---- sampling parameters -------------------------------------------------------------------
    def structured_outputs(
        self, req: Any, tool_schema: dict[str, Any] | None = None
    ) -> StructuredOutputsParams | None:
        """The request's output constraint from whichever field gives one (at most one)."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format",
                )
            strict = rf.json_schema.strict
            given.append(("response_format", {"json": rf.json_schema.json_schema,
                                              "strict": strict is not False}))
        if req.guided_json is not None:
            given.append(("guided_json", {"json": req.guided_json}))
        if req.guided_regex is not None:
            given.append(("guided_regex", {"regex": req.guided_regex}))
        if req.guided_choice is not None:
            given.append(("guided_choice", {"choice": req.guided_choice}))
        if req.guided_grammar is not None:
            given.append(("guided_grammar", {"grammar": req.guided_grammar}))
        if req.structured_outputs is not None:
            so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", so))
        if tool_schema is not None:
            given.append(("tool_choice", {"json": tool_schema}))
        backend = req.guided_decoding_backend
        if backend is not None and backend not in _BACKENDS:
            raise bad_request(
                f"guided_decoding_backend {backend!r} is not available: this server's grammar "
                "engine is llguidance ('llguidance' or 'auto')",
                "guided_decoding_backend",
            )
        if req.guided_whitespace_pattern is not None:
            raise bad_request(
                "guided_whitespace_pattern is not supported; use "
                "structured_outputs.disable_any_whitespace for compact JSON",
                "guided_whitespace_pattern",
            )
        if not given:
            return None
        if len(given) > 1:
            raise bad_request(
                f"give one output constraint, not several: {[name for name, _ in given]}",
                given[1][0],
            )
        param, kwargs = given[0]
        self.require_tokenizer(param, "structured output needs a tokenizer")
        try:
            return StructuredOutputsParams(**kwargs)
        except Exception as exc:  # the grammar compiler's word on the user's schema or regex
            raise bad_request(str(exc) or type(exc).__name__, param) from exc

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys are token ids, got {key!r}", "logit_bias"
                ) from None
            if not 0 <= tid < self.vocab_size:
                raise bad_request(
                    f"logit_bias has token id {tid}, outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    "logit_bias",
                )
            if not -100.0 <= value <= 100.0:
                raise bad_request(
                    f"logit_bias values must be in [-100, 100], got {value} for token {tid}",
                    "logit_bias",
                )
            out[tid] = float(value)
        return out

    def sampling_params(
        self,
        req: Any,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None else 0
        if top_k >= self.vocab_size:
            top_k = 0  # keeping every token is no top-k at all
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.allowed_token_ids:
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
        if req.stop:
            self.require_tokenizer("stop", "stop strings need one: use stop_token_ids")
        if req.bad_words:
            self.require_tokenizer("bad_words", "bad_words need one: use logit_bias")
        if req.prompt_logprobs is not None:
            prompt_logprobs = (
                req.prompt_logprobs
                if prompt_logprobs is None or req.prompt_logprobs == -1
                else max(prompt_logprobs, req.prompt_logprobs)
            )
        try:
            return SamplingParams(
                n=req.n if req.n is not None else 1,
                best_of=req.best_of,
                temperature=req.temperature if req.temperature is not None else 1.0,
                top_p=req.top_p if req.top_p is not None else 1.0,
                top_k=top_k,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty
                if req.repetition_penalty is not None
                else 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                ignore_eos=bool(req.ignore_eos),
                max_tokens=max_tokens,
                min_tokens=req.min_tokens or 0,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self._logit_bias(req.logit_bias),
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                structured_outputs=structured,
                use_beam_search=bool(req.use_beam_search),
                length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
                skip_special_tokens=req.skip_special_tokens is not False,
                spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    def check_streaming(self, req: Any, params: SamplingParams) -> bool:
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if stream and params.use_beam_search:
            raise bad_request("use_beam_search cannot be streamed; set stream to false", "stream")
        if stream and params.best_of is not None and params.best_of != params.n:
            raise bad_request("best_of != n cannot be streamed; set stream to false", "best_of")
        return stream

    def check_supported(self, req: Any) -> None:
        """A 400 for a field of OpenAI's or vLLM's API that pagedkv cannot honour."""
        for name, value in (req.model_extra or {}).items():
            known = UNSUPPORTED_FIELDS.get(name)
            if known is not None and not any(
                value == ok and type(value) is type(ok) for ok in known[0]
            ):
                raise bad_request(f"{name} is not supported by this server: {known[1]}", name)

    def check_alive(self) -> None:
        if getattr(self.engine, "errored", False):
            raise APIError(503, "the engine loop has stopped; restart the server")

    # ---- engine streams --------------------------------------------------------------------
    async def tracked(
        self, prompt: Any, params: SamplingParams, request_id: str, kind: str
    ) -> AsyncIterator[Any]:
        """The engine's stream for one prompt (`kind`: "delta" or "final" outputs), recording
        latency metrics; closing it aborts the request (and counts it as aborted)."""
        start = time.monotonic()
        first_token: float | None = None
        last_token: float | None = None
        finished = False
        failed = False
        num_tokens: dict[int, int] = {}
        reasons: dict[int, str | None] = {}
        gen = self.engine.generate(prompt, params, request_id, output_kind=kind)
        try:
            async for out in gen:
                now = time.monotonic()
                if any(o.token_ids for o in out.outputs):
                    if first_token is None:
                        first_token = now - start
                    elif last_token is not None and kind == "delta":
                        self.metrics.inter_token.observe(now - last_token)
                    last_token = now
                for o in out.outputs:
                    if kind == "delta":
                        num_tokens[o.index] = num_tokens.get(o.index, 0) + len(o.token_ids)
                    else:
                        num_tokens[o.index] = len(o.token_ids)
                    if o.finish_reason is not None or o.index not in reasons:
                        reasons[o.index] = o.finish_reason
                if out.finished:
                    finished = True
                    m = out.metrics
                    if m is not None and m.first_token_time is not None:
                        # when the first token reached this process (a final-only stream
                        # sees its tokens only at the end)
                        first_token = m.first_token_time - m.arrival_time
                    self.metrics.observe_finished(
                        first_token,
                        time.monotonic() - start,
                        max(num_tokens.values(), default=0),
                        reasons.values(),
                    )
                    self.metrics.observe_request(
                        m,
                        prompt_tokens=len(out.prompt_token_ids),
                        generation_tokens=sum(num_tokens.values()),
                        n=params.n,
                        max_tokens=params.max_tokens,
                    )
                    if any(r == "abort" for r in reasons.values()):
                        self.metrics.request_aborted.inc()  # an explicit abort
                yield out
        except Exception:
            failed = True  # refused by the engine (a 400) or the engine died: no abort
            raise
        finally:
            if not finished and not failed:
                # the client went away (the stream was closed or cancelled)
                self.metrics.request_aborted.inc()
                logger.debug("request %s ended before finishing: aborted", request_id)
            await aclose_quietly(gen)

    def _engine_error(self, exc: Exception) -> APIError | None:
        """The API error for an exception from the engine's stream; None: a bug of ours."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ValueError):
            return bad_request(str(exc))
        if getattr(self.engine, "errored", False):
            return APIError(503, f"the engine loop has stopped: {exc}")
        return None

    async def _prepare(self, prompts: list[PreparedPrompt], params: SamplingParams) -> list[Any]:
        """Each prompt checked and prepared by the engine on the tokenizer worker (grammars
        compile there); an engine without `prepare` takes the token ids as they are."""
        prepare = getattr(self.engine, "prepare", None)
        if prepare is None:
            return [p.token_ids for p in prompts]

        def all_of() -> list[Any]:
            return [prepare(p.token_ids, params) for p in prompts]

        try:
            return await self.worker.run(all_of)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    async def _start_streams(
        self,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        request_id: str,
        *,
        suffix: bool = True,
    ) -> list[AsyncIterator[Any]]:
        """Start one engine stream per prompt; a request the engine rejects is a 400 here."""
        prepared = await self._prepare(prompts, params)
        started: list[AsyncIterator[Any]] = []
        try:
            for i, p in enumerate(prepared):
                rid = f"{request_id}-{i}" if suffix else request_id
                stream = self.tracked(p, params, rid, "delta")
                started.append(await start_stream(stream))
        except Exception as exc:
            for it in started:
                await aclose_quietly(it)
            err = self._engine_error(exc)
            if err is None:
                raise
            raise err from exc
        return started

    async def _collect(
        self, prompts: list[Any], params: SamplingParams, request_id: str, suffix: bool
    ) -> list[Any]:
        streams = [
            self.tracked(p, params, f"{request_id}-{i}" if suffix else request_id, "final")
            for i, p in enumerate(prompts)
        ]
        finals: list[Any] = [None] * len(prompts)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return finals

    async def _generate_all(
        self,
        raw_request: Request,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        request_id: str,
        *,
        suffix: bool = True,
    ) -> list[Any]:
        prepared = await self._prepare(prompts, params)
        try:
            return await run_unless_disconnected(
                raw_request, self._collect(prepared, params, request_id, suffix)
            )
        except ClientDisconnected:
            raise
        except Exception as exc:
            err = self._engine_error(exc)
            if err is None:
                raise
            raise err from exc

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def prompt_logprobs_json(
        self, prompt_logprobs: list[dict[int, Any] | None] | None, as_id: bool
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, token id -> {logprob, rank,
        decoded_token}."""
        if prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for step in prompt_logprobs:
            if step is None:
                out.append(None)
                continue
            out.append({
                str(tid): {
                    "logprob": _clean_logprob(lp.logprob),
                    "rank": getattr(lp, "rank", None),
                    "decoded_token": self.decode_token(tid, lp, as_id),
                }
                for tid, lp in step.items()
            })
        return out

    # ---- /v1/completions -------------------------------------------------------------------
    async def prepare_completion_prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        p = req.prompt
        limit = self.text_limit(req.truncate_prompt_tokens)
        special = req.add_special_tokens is not False
        trunc = req.truncate_prompt_tokens
        if isinstance(p, str):
            return [PreparedPrompt(p, self.truncate(
                await self.encode(p, add_special_tokens=special, limit=limit), trunc))]
        if p and isinstance(p[0], str):
            return [
                PreparedPrompt(s, self.truncate(
                    await self.encode(s, add_special_tokens=special, limit=limit), trunc))
                for s in p  # type: ignore[union-attr]
            ]
        if p and isinstance(p[0], int):
            ids = list(p)  # type: ignore[arg-type]
            self.check_token_ids(ids, "prompt")
            return [PreparedPrompt(None, self.truncate(ids, trunc))]
        out = []
        for ids in p:  # type: ignore[union-attr]
            self.check_token_ids(ids, "prompt")  # type: ignore[arg-type]
            out.append(PreparedPrompt(None, self.truncate(list(ids), trunc)))  # type: ignore[arg-type]
        return out

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Any:
        self.check_alive()
        self.check_supported(req)
        model = self.resolve_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = await self.prepare_completion_prompts(req)
        max_tokens = min(self.check_length(p.token_ids, req.max_tokens, "prompt") for p in prompts)
        structured = None
        if _wants_structure(req):
            structured = await self.worker.run(self.structured_outputs, req, None)
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            # echo with logprobs returns the prompt tokens' logprobs too, as OpenAI does
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            structured=structured,
        )
        stream = self.check_streaming(req, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            streams = await self._start_streams(prompts, params, request_id)
            return self._stream_completion(
                req, model, prompts, params, request_id, created, streams
            )
        finals = await self._generate_all(raw_request, prompts, params, request_id)
        want_ids = self.returns_token_ids(req)
        as_id = bool(req.return_tokens_as_token_ids)
        choices: list[CompletionChoice] = []
        completion_tokens = 0
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                prefix = self._echo_text(prompt) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = self.completion_logprobs(
                        o.token_ids,
                        o.logprobs,
                        req.logprobs,
                        len(prefix),
                        echo_prompt=prompt if req.echo else None,
                        prompt_logprobs=getattr(out, "prompt_logprobs", None),
                        as_id=as_id,
                    )
                finish, stop = self.finish(
                    o.finish_reason, o.stop_reason, len(o.token_ids), len(prompt.token_ids),
                    max_tokens,
                )
                choices.append(
                    CompletionChoice(
                        index=i * (params.n) + o.index,
                        text=prefix + o.text,
                        logprobs=lp,
                        finish_reason=finish,
                        stop_reason=stop,
                        prompt_token_ids=list(prompt.token_ids) if want_ids else None,
                        token_ids=list(o.token_ids) if want_ids else None,
                        prompt_logprobs=self.prompt_logprobs_json(
                            getattr(out, "prompt_logprobs", None), as_id
                        )
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
        choices.sort(key=lambda c: c.index)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )

    def returns_token_ids(self, req: CompletionRequest) -> bool:
        """Choices carry `token_ids` (and `prompt_token_ids`) when asked with vLLM's
        `return_token_ids`, and always without a tokenizer, where the text is empty."""
        return bool(req.return_token_ids) or self.tokenizer is None

    def _echo_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        if self.tokenizer is None:
            return ""  # the echoed prompt is in prompt_token_ids
        return self.tokenizer.decode(prompt.token_ids)

    def completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, Any]] | None,
        num_top: int,
        offset: int,
        *,
        echo_prompt: PreparedPrompt | None = None,
        prompt_logprobs: list[dict[int, Any] | None] | None = None,
        as_id: bool = False,
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        pos = 0
        if echo_prompt is not None:
            # The prompt's tokens come first; their logprobs are known only when the engine
            # returned prompt logprobs (the first token never has one).
            for k, tid in enumerate(echo_prompt.token_ids):
                step = prompt_logprobs[k] if prompt_logprobs and k < len(prompt_logprobs) else None
                self._append_completion_step(result, tid, step, num_top, pos, as_id)
                pos += self._text_len(result.tokens[-1], as_id)
        pos = offset  # generated text starts after the echoed prompt text
        for k, tid in enumerate(token_ids):
            step = logprobs[k] if logprobs and k < len(logprobs) else None
            self._append_completion_step(result, tid, step, num_top, pos, as_id)
            pos += self._text_len(result.tokens[-1], as_id)
        return result

    def _text_len(self, token: str, as_id: bool = False) -> int:
        # Without a tokenizer the text is empty: every token's text offset is 0, although
        # its name in `tokens` is "token_id:<id>".
        return len(token) if self.tokenizer is not None and not as_id else 0

    def _append_completion_step(
        self,
        result: CompletionLogprobs,
        tid: int,
        step: dict[int, Any] | None,
        num_top: int,
        pos: int,
        as_id: bool = False,
    ) -> None:
        sampled = step.get(tid) if step else None
        token = self.decode_token(tid, sampled, as_id)
        result.tokens.append(token)
        result.text_offset.append(pos)
        if step is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            return
        result.token_logprobs.append(_clean_logprob(sampled.logprob) if sampled else None)
        top: dict[str, float] = {}
        if sampled is not None:
            top[token] = _clean_logprob(sampled.logprob)
        ranked = sorted(step.items(), key=lambda kv: -_clean_logprob(kv[1].logprob))
        for alt_id, alt in _top(ranked, num_top):
            top.setdefault(self.decode_token(alt_id, alt, as_id), _clean_logprob(alt.logprob))
        result.top_logprobs.append(top)

    async def _stream_completion(
        self,
        req: CompletionRequest,
        model: str,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        request_id: str,
        created: int,
        streams: list[AsyncIterator[Any]],
    ) -> AsyncIterator[str | bytes]:
        n = params.n
        want_ids = self.returns_token_ids(req)
        as_id = bool(req.return_tokens_as_token_ids)
        states: dict[int, _ChoiceState] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        completion_tokens: dict[int, int] = {}
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        max_tokens = params.max_tokens or 0
        merged = merge_streams(streams)
        # The chunk's fields in CompletionStreamResponse's order (`usage` only when asked).
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for i, out in merged:
                for o in out.outputs:  # delta outputs: only the choices with something new
                    index = i * n + o.index
                    st = states.get(index)
                    if st is None:
                        st = states[index] = _ChoiceState()
                    if st.finished:
                        continue
                    text = o.text
                    new_ids = o.token_ids
                    if not text and not new_ids and o.finish_reason is None and st.started:
                        continue
                    prefix = ""
                    first = not st.started
                    if req.echo and first:
                        prefix = self._echo_text(prompts[i])
                        st.prefix_len = len(prefix)
                    prompt_lps = getattr(out, "prompt_logprobs", None)
                    lp = None
                    if req.logprobs is not None:
                        lp = self.completion_logprobs(
                            new_ids,
                            o.logprobs,
                            req.logprobs,
                            st.prefix_len + st.text_len,
                            echo_prompt=prompts[i] if req.echo and first else None,
                            prompt_logprobs=prompt_lps,
                            as_id=as_id,
                        ).model_dump(mode="json")
                    st.started = True
                    st.text_len += len(text)
                    st.num_tokens += len(new_ids)
                    completion_tokens[index] = st.num_tokens
                    finish, stop = None, None
                    if o.finish_reason is not None:
                        st.finished = True
                        finish, stop = self.finish(
                            o.finish_reason, o.stop_reason, st.num_tokens,
                            len(prompts[i].token_ids), max_tokens,
                        )
                    choice = {
                        "index": index,
                        "text": prefix + text,
                        "logprobs": lp,
                        "finish_reason": finish,
                        "stop_reason": stop,
                        # like vLLM: the prompt's ids in each choice's first chunk
                        "prompt_token_ids": list(prompts[i].token_ids)
                        if want_ids and first
                        else None,
                        "token_ids": list(new_ids) if want_ids else None,
                    }
                    if req.prompt_logprobs is not None and first:
                        choice["prompt_logprobs"] = self.prompt_logprobs_json(prompt_lps, as_id)
                    chunk = {**head, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = self._usage(
                            prompt_tokens, sum(completion_tokens.values())
                        )
                    elif include_usage:
                        chunk["usage"] = None
                    chunk["system_fingerprint"] = None
                    yield sse_json(chunk)
            if include_usage:
                done = sum(completion_tokens.values())
                usage = UsageInfo(**self._usage(prompt_tokens, done))
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(final.model_dump(mode="json"))
        except Exception as exc:
            yield sse(self._stream_error(exc))
        finally:
            await aclose_quietly(merged)
        yield sse("[DONE]")

    def _stream_error(self, exc: Exception) -> dict[str, Any]:
        err = self._engine_error(exc)
        if err is None:
            logger.error("unexpected error while streaming", exc_info=exc)
            return error_body(500, f"internal server error: {type(exc).__name__}")
        return error_body(err.status_code, err.message, param=err.param, code=err.code)

    # ---- /v1/chat/completions --------------------------------------------------------------
    def chat_tools(self, req: ChatCompletionRequest, template: str | None) -> _Tools:
        """How this request uses tools (checked: tool_choice needs tools, a named function
        must be one of them)."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise bad_request(
                    "tool_choice needs tools: send the tools the model may call, or drop "
                    "tool_choice",
                    "tool_choice",
                )
            return _Tools(None)
        if choice == "none":
            return _Tools(None)
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tools must have distinct function names", "tools")
        parallel = req.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice names {choice.function.name!r}, which is not among the "
                    f"tools {names}",
                    "tool_choice",
                )
            return _Tools("named", tools, choice.function.name, parallel)
        if choice == "required":
            return _Tools("required", tools, None, parallel)
        return _Tools("auto", tools, None, parallel,
                      pick_parser(self.tool_call_parser, template))

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        self.check_alive()
        self.check_supported(req)
        model = self.resolve_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        template = req.chat_template or self.chat_template
        tools = self.chat_tools(req, template)
        continue_final = bool(req.continue_final_message)
        add_generation_prompt = req.add_generation_prompt is not False
        if continue_final and "add_generation_prompt" not in req.model_fields_set:
            add_generation_prompt = False  # continuing the last message adds no new one
        prompt_ids = await self.render_chat(
            req.messages,
            add_generation_prompt,
            continue_final_message=continue_final,
            add_special_tokens=bool(req.add_special_tokens),
            template=req.chat_template,
            template_kwargs=req.chat_template_kwargs,
            tools=tools.tools,
            limit=self.text_limit(req.truncate_prompt_tokens),
        )
        prompt_ids = self.truncate(prompt_ids, req.truncate_prompt_tokens)
        wanted = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.check_length(prompt_ids, wanted, "messages")
        tool_schema = None
        if tools.mode in ("required", "named"):
            tool_schema = forced_call_schema(tools.tools or [], tools.named, tools.parallel)
        structured = None
        if tool_schema is not None or _wants_structure(req):
            structured = await self.worker.run(self.structured_outputs, req, tool_schema)
        num_top = req.top_logprobs if req.top_logprobs is not None else 0
        params = self.sampling_params(
            req, max_tokens=max_tokens, logprobs=num_top if req.logprobs else None,
            structured=structured,
        )
        stream = self.check_streaming(req, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompt = PreparedPrompt(None, prompt_ids)
        last = req.messages[-1]
        echo = ""
        if req.echo and last.role == "assistant":
            # the reply continues (or follows) the last message, which has the reply's role
            echo = (
                "".join(p.text for p in last.content)
                if isinstance(last.content, list)
                else last.content or ""
            )
        if stream:
            (started,) = await self._start_streams([prompt], params, request_id, suffix=False)
            return self._stream_chat(
                req, model, prompt, params, request_id, created, num_top, started, tools, echo
            )
        (out,) = await self._generate_all(
            raw_request, [prompt], params, request_id, suffix=False
        )
        as_id = bool(req.return_tokens_as_token_ids)
        choices = []
        completion_tokens = 0
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            finish, stop = self.finish(
                o.finish_reason, o.stop_reason, len(o.token_ids), len(prompt_ids), max_tokens
            )
            content, calls = self._tool_calls(tools, o.text)
            if calls and finish == "stop" and tools.mode != "named":
                finish = "tool_calls"
            if echo:
                content = echo + (content or "")
            choices.append(
                ChatChoice(
                    index=o.index,
                    message=ChatResponseMessage(
                        content=content,
                        tool_calls=[
                            ToolCall(id=new_call_id(),
                                     function=FunctionCall(name=c.name, arguments=c.arguments))
                            for c in calls
                        ],
                    ),
                    logprobs=self.chat_logprobs(o.token_ids, o.logprobs, num_top, as_id)
                    if req.logprobs
                    else None,
                    finish_reason=finish,
                    stop_reason=stop,
                )
            )
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt_ids) + completion_tokens,
            ),
            prompt_logprobs=self.prompt_logprobs_json(
                getattr(out, "prompt_logprobs", None), as_id
            )
            if req.prompt_logprobs is not None
            else None,
        )

    def _tool_calls(self, tools: _Tools, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished reply under the request's tool mode."""
        if tools.mode in ("named", "required"):
            calls = parse_forced(text, tools.named)
            return (None, calls) if calls else (text, [])
        if tools.mode == "auto" and tools.parser is not None:
            content, calls = tools.parser.parse(text)
            if not tools.parallel:
                calls = calls[:1]
            return content, calls
        return text, []

    def chat_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, Any]] | None,
        num_top: int,
        as_id: bool = False,
    ) -> ChatLogprobs:
        content: list[ChatTokenLogprob] = []
        for k, tid in enumerate(token_ids):
            step = logprobs[k] if logprobs and k < len(logprobs) else {}
            sampled = step.get(tid)
            token = self.decode_token(tid, sampled, as_id)
            ranked = sorted(step.items(), key=lambda kv: -_clean_logprob(kv[1].logprob))
            tops = []
            for alt_id, alt in _top(ranked, num_top):
                alt_token = self.decode_token(alt_id, alt, as_id)
                tops.append(
                    TopLogprob(
                        token=alt_token,
                        logprob=_clean_logprob(alt.logprob),
                        bytes=list(alt_token.encode("utf-8")),
                    )
                )
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=_clean_logprob(sampled.logprob if sampled else None),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=tops,
                )
            )
        return ChatLogprobs(content=content)

    async def _stream_chat(
        self,
        req: ChatCompletionRequest,
        model: str,
        prompt: PreparedPrompt,
        params: SamplingParams,
        request_id: str,
        created: int,
        num_top: int,
        stream: AsyncIterator[Any],
        tools: _Tools,
        echo: str,
    ) -> AsyncIterator[str | bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        as_id = bool(req.return_tokens_as_token_ids)
        states: dict[int, _ChoiceState] = {}
        completion_tokens: dict[int, int] = {}
        n_prompt = len(prompt.token_ids)
        max_tokens = params.max_tokens or 0
        # The chunk's fields in ChatCompletionStreamResponse's order (`usage` only when asked).
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(index: int, delta: dict[str, Any], lp: Any = None, finish: Any = None,
                  stop: Any = None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": lp,
                      "finish_reason": finish, "stop_reason": stop}
            body = {**head, "choices": [choice]}
            if continuous:
                body["usage"] = self._usage(n_prompt, sum(completion_tokens.values()))
            elif include_usage:
                body["usage"] = None
            body["system_fingerprint"] = None
            return sse_json(body)

        def logprobs_json(entries: list[ChatTokenLogprob]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            return {"content": [e.model_dump(mode="json") for e in entries]}

        try:
            async for out in stream:
                for o in out.outputs:  # delta outputs: only the choices with something new
                    st = states.get(o.index)
                    if st is None:
                        st = states[o.index] = _ChoiceState()
                    if st.finished:
                        continue
                    if not st.started:
                        st.started = True
                        # the role only in a choice's first delta (with the echoed message)
                        yield chunk(o.index, {"role": "assistant", "content": echo})
                    text = o.text
                    new_ids = o.token_ids
                    if not text and not new_ids and o.finish_reason is None:
                        continue
                    if req.logprobs:
                        st.pending_logprobs.extend(
                            self.chat_logprobs(new_ids, o.logprobs, num_top, as_id).content or []
                        )
                    st.text_len += len(text)
                    st.text += text
                    st.num_tokens += len(new_ids)
                    completion_tokens[o.index] = st.num_tokens
                    finish, stop = None, None
                    if o.finish_reason is not None:
                        st.finished = True
                        finish, stop = self.finish(
                            o.finish_reason, o.stop_reason, st.num_tokens, n_prompt, max_tokens
                        )
                    for delta, done in self._chat_deltas(st, tools, finish is not None):
                        lp = logprobs_json(st.pending_logprobs)
                        st.pending_logprobs = []
                        if done and tools.mode is not None and finish == "stop":
                            called = "tool_calls" in delta or st.call_id is not None
                            if called and tools.mode != "named":
                                finish = "tool_calls"
                        yield chunk(o.index, delta, lp, finish if done else None,
                                    stop if done else None)
            if include_usage:
                done_tokens = sum(completion_tokens.values())
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=UsageInfo(**self._usage(n_prompt, done_tokens)),
                )
                yield sse(final.model_dump(mode="json"))
        except Exception as exc:
            yield sse(self._stream_error(exc))
        finally:
            await aclose_quietly(stream)
        yield sse("[DONE]")

    def _chat_deltas(
        self, st: _ChoiceState, tools: _Tools, finished: bool
    ) -> list[tuple[dict[str, Any], bool]]:
        """The deltas to send for a choice's new text: (delta, is it the last one).

        Without tools, the new text as content. A named function streams its arguments as they
        come; ``required`` and ``auto`` hold back text that may be a tool call and send the
        calls, parsed whole, when the reply ends."""
        out: list[tuple[dict[str, Any], bool]] = []
        text = st.text
        if tools.mode == "named":
            new = text[st.sent:]
            st.sent = len(text)
            if new or finished:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": new}}
                if st.call_id is None:
                    st.call_id = new_call_id()
                    call.update(id=st.call_id, type="function")
                    call["function"]["name"] = tools.named
                out.append(({"tool_calls": [call]}, finished))
            return out
        if tools.mode is None:
            new = text[st.sent:]
            st.sent = len(text)
            out.append(({"content": new if new or not finished else None}, finished))
            return out
        # required / auto: content up to where a call may begin; the calls at the end
        if tools.mode == "auto" and tools.parser is not None:
            hold = tools.parser.start(text)
        else:
            hold = 0
        upto = len(text) if hold is None else hold
        if not finished:
            if upto > st.sent:
                out.append(({"content": text[st.sent:upto]}, False))
                st.sent = upto
            return out
        _, calls = self._tool_calls(tools, text)
        if not calls:
            out.append(({"content": text[st.sent:] or None}, True))
            st.sent = len(text)
            return out
        if upto > st.sent:
            out.append(({"content": text[st.sent:upto]}, False))
        st.sent = len(text)
        deltas = [
            {"index": k, "id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(calls)
        ]
        out.append(({"tool_calls": deltas}, True))
        return out


def _wants_structure(req: Any) -> bool:
    """Whether the request sets any field of structured output (or a backend option)."""
    rf = req.response_format
    return (
        (rf is not None and rf.type != "text")
        or any(
            getattr(req, name) is not None
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "structured_outputs", "guided_decoding_backend",
                         "guided_whitespace_pattern")
        )
    )
