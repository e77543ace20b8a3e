"""`OpenAIServing`: what every OpenAI endpoint shares, from a request's checks to its engine
streams. The endpoints themselves are in `serving_completion` and `serving_chat`.

Everything a user can get wrong is checked before the engine sees the request: the model
name, the prompt (empty, out-of-vocabulary token ids, longer than the context), and every
sampling value (the engine's `SamplingParams` validates them and its `ValueError` becomes a
400). The engine loop must never die of a user's input, and a field we accept is a field we
honour: one we cannot honour gets a 400 that says so.

Whole prompts are tokenized on the `TokenizerWorker`'s thread, never on the event loop.
Streams ask the engine for *delta* outputs (what is new since the stream last ran: a client
that falls behind gets bigger chunks, never a queue), non-streaming requests for the final
output only. Each streamed chunk is built as a plain dict and encoded by msgspec: per-token
work for hundreds of streams is what this process spends its time on, so it stays lean.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request

from pagedkv.engine import SamplingParams
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.server.errors import APIError, bad_request, error_body
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import UNSUPPORTED_FIELDS
from pagedkv.server.streams import (
    ClientDisconnected,
    aclose_quietly,
    merge_streams,
    run_unless_disconnected,
    start_stream,
)
from pagedkv.server.tokenizer_worker import TokenizerWorker

logger = logging.getLogger(__name__)

#: JSON has no -inf: a logprob of -inf (a token the filters ruled out) is sent as this, like vLLM.
LOGPROB_FLOOR = -9999.0

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}

#: What a request that needs text gets from a server whose engine has no tokenizer.
NO_TOKENIZER = (
    "this server runs without a tokenizer (--skip-tokenizer-init): send prompts as token ids"
)

#: Backends `guided_decoding_backend` may name: pagedkv has one (llguidance).
_BACKENDS = ("auto", "llguidance", "guidance")


def clean_logprob(value: float | None) -> float:
    """A logprob JSON can carry: NaN and -inf become `LOGPROB_FLOOR`."""
    if value is None or math.isnan(value):
        return LOGPROB_FLOOR
    return max(float(value), LOGPROB_FLOOR)


def top_alternatives(ranked: list[Any], num_top: int) -> list[Any]:
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
class ChoiceState:
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


class OpenAIServing:
    """Holds the engine, a tokenizer worker and the metrics; one instance per app, shared by
    its endpoints.

    An engine without a tokenizer (`--skip-tokenizer-init`, or a bundled shape-only config for
    benchmarks) is served on token ids alone, as vLLM does: completions take token-id prompts
    and answer with `token_ids` and empty text; whatever needs text (text prompts, chat, stop
    strings, /tokenize, /detokenize) gets a 400 that says so.
    """

    def __init__(self, engine: Any, served_model_names: list[str], metrics: ServerMetrics
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
        self._decode_cache: dict[int, str] = {}

    # ---- checks shared by all endpoints ----------------------------------------------------
    def check_request(self, req: Any) -> str:
        """What every endpoint checks first: the engine is alive, every field given is one we
        honour; returns the model name the response carries."""
        self.check_alive()
        self.check_supported(req)
        return self.resolve_model(req.model)

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

    async def start_streams(
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

    async def generate_all(
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

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
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
                    "logprob": clean_logprob(lp.logprob),
                    "rank": getattr(lp, "rank", None),
                    "decoded_token": self.decode_token(tid, lp, as_id),
                }
                for tid, lp in step.items()
            })
        return out

    def stream_error(self, exc: Exception) -> dict[str, Any]:
        """The error event a stream sends when its request fails after it started."""
        err = self._engine_error(exc)
        if err is None:
            logger.error("unexpected error while streaming", exc_info=exc)
            return error_body(500, f"internal server error: {type(exc).__name__}")
        return error_body(err.status_code, err.message, param=err.param, code=err.code)


def wants_structure(req: Any) -> bool:
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
