"""The OpenAI endpoints' logic: requests in, engine streams, responses (or SSE chunks) out.

Everything a user can get wrong is checked here, before the engine sees the request: the
model name, the prompt (empty, out-of-vocabulary token ids, longer than the context), and
every sampling value (the engine's `SamplingParams` validates them and its `ValueError` becomes
a 400). The engine loop must never die of a user's input.

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
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from pagedkv.engine import SamplingParams
from pagedkv.server.errors import APIError, bad_request, error_body
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
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

logger = logging.getLogger(__name__)

#: JSON has no -inf: a logprob of -inf (a token the filters ruled out) is sent as this, like vLLM.
LOGPROB_FLOOR = -9999.0

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}

#: What a request that needs text gets from a server whose engine has no tokenizer.
NO_TOKENIZER = (
    "this server runs without a tokenizer (--skip-tokenizer-init): send prompts as token ids"
)


def _clean_logprob(value: float | None) -> float:
    if value is None or math.isnan(value):
        return LOGPROB_FLOOR
    return max(float(value), LOGPROB_FLOOR)


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


class OpenAIServing:
    """Holds the engine, a private tokenizer and the metrics; one instance per app.

    An engine without a tokenizer (`--skip-tokenizer-init`, or a bundled shape-only config for
    benchmarks) is served on token ids alone, as vLLM does: completions take token-id prompts
    and answer with `token_ids` and empty text; whatever needs text (text prompts, chat, stop
    strings, /tokenize, /detokenize) gets a 400 that says so.
    """

    def __init__(self, engine: Any, served_model_names: list[str], metrics: ServerMetrics) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        # The engine's own (API-process) tokenizer: it tokenizes and detokenizes on this event
        # loop's thread only, as we do, so sharing it is safe.
        self.tokenizer: Any = engine.get_tokenizer()
        if self.tokenizer is None:
            logger.info("the engine has no tokenizer: serving token-id prompts only")
        config = engine.model_config
        self.max_model_len = int(config.max_model_len)
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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.require_tokenizer("prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_token(self, token_id: int, logprob: Any = None) -> str:
        """A token's text; without a tokenizer `token_id:<id>`, as vLLM writes it."""
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

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        self.require_tokenizer(
            "messages",
            "chat messages need its chat template: use /v1/completions with token-id prompts",
        )
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        conversation = []
        for m in messages:
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            role = "system" if m.role == "developer" else m.role
            conversation.append({"role": role, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise bad_request(
                f"the chat template refused these messages: {exc}", "messages"
            ) from exc
        return self.encode(str(text), add_special_tokens=False)

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

    def sampling_params(
        self, req: Any, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None else 0
        if top_k >= self.vocab_size:
            top_k = 0  # keeping every token is no top-k at all
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.stop:
            self.require_tokenizer("stop", "stop strings need one: use stop_token_ids")
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
                use_beam_search=bool(req.use_beam_search),
                length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
                skip_special_tokens=req.skip_special_tokens is not False,
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

    def check_alive(self) -> None:
        if getattr(self.engine, "errored", False):
            raise APIError(503, "the engine loop has stopped; restart the server")

    # ---- engine streams --------------------------------------------------------------------
    async def tracked(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, kind: str
    ) -> AsyncIterator[Any]:
        """The engine's stream for one prompt (`kind`: "delta" or "final" outputs), recording
        latency metrics; closing it aborts the request."""
        start = time.monotonic()
        first_token: float | None = None
        finished = False
        num_tokens: dict[int, int] = {}
        reasons: dict[int, str | None] = {}
        gen = self.engine.generate(prompt_ids, params, request_id, output_kind=kind)
        try:
            async for out in gen:
                if first_token is None and any(o.token_ids for o in out.outputs):
                    first_token = time.monotonic() - start
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
                    self.metrics.observe_scheduling(m)
                yield out
        finally:
            if not finished:
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

    async def _start_streams(
        self,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        request_id: str,
        *,
        suffix: bool = True,
    ) -> list[AsyncIterator[Any]]:
        """Start one engine stream per prompt; a request the engine rejects is a 400 here."""
        started: list[AsyncIterator[Any]] = []
        try:
            for i, p in enumerate(prompts):
                rid = f"{request_id}-{i}" if suffix else request_id
                stream = self.tracked(p.token_ids, params, rid, "delta")
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
        self, prompts: list[PreparedPrompt], params: SamplingParams, request_id: str
    ) -> list[Any]:
        streams = [
            self.tracked(p.token_ids, params, f"{request_id}-{i}", "final")
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
    ) -> list[Any]:
        try:
            return await run_unless_disconnected(
                raw_request, self._collect(prompts, params, request_id)
            )
        except ClientDisconnected:
            raise
        except Exception as exc:
            err = self._engine_error(exc)
            if err is None:
                raise
            raise err from exc

    # ---- /v1/completions -------------------------------------------------------------------
    def prepare_completion_prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        p = req.prompt
        if isinstance(p, str):
            return [PreparedPrompt(p, self.encode(p))]
        if p and isinstance(p[0], str):
            return [PreparedPrompt(s, self.encode(s)) for s in p]  # type: ignore[arg-type]
        if p and isinstance(p[0], int):
            ids = list(p)  # type: ignore[arg-type]
            self.check_token_ids(ids, "prompt")
            return [PreparedPrompt(None, ids)]
        out = []
        for ids in p:  # type: ignore[union-attr]
            self.check_token_ids(ids, "prompt")  # type: ignore[arg-type]
            out.append(PreparedPrompt(None, list(ids)))  # type: ignore[arg-type]
        return out

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Any:
        self.check_alive()
        model = self.resolve_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = self.prepare_completion_prompts(req)
        max_tokens = min(self.check_length(p.token_ids, req.max_tokens, "prompt") for p in prompts)
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            # echo with logprobs returns the prompt tokens' logprobs too, as OpenAI does
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
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
                    )
                choices.append(
                    CompletionChoice(
                        index=i * (params.n) + o.index,
                        text=prefix + o.text,
                        logprobs=lp,
                        finish_reason=_FINISH_REASONS.get(o.finish_reason or "", o.finish_reason),
                        stop_reason=o.stop_reason if isinstance(o.stop_reason, int | str) else None,
                        prompt_token_ids=list(prompt.token_ids) if want_ids else None,
                        token_ids=list(o.token_ids) if want_ids else None,
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
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        pos = 0
        if echo_prompt is not None:
            # The prompt's tokens come first; their logprobs are known only when the engine
            # returned prompt logprobs (the first token never has one).
            for k, tid in enumerate(echo_prompt.token_ids):
                step = prompt_logprobs[k] if prompt_logprobs and k < len(prompt_logprobs) else None
                self._append_completion_step(result, tid, step, num_top, pos)
                pos += self._text_len(result.tokens[-1])
        pos = offset  # generated text starts after the echoed prompt text
        for k, tid in enumerate(token_ids):
            step = logprobs[k] if logprobs and k < len(logprobs) else None
            self._append_completion_step(result, tid, step, num_top, pos)
            pos += self._text_len(result.tokens[-1])
        return result

    def _text_len(self, token: str) -> int:
        # Without a tokenizer the text is empty: every token's text offset is 0, although
        # its name in `tokens` is "token_id:<id>".
        return len(token) if self.tokenizer is not None else 0

    def _append_completion_step(
        self,
        result: CompletionLogprobs,
        tid: int,
        step: dict[int, Any] | None,
        num_top: int,
        pos: int,
    ) -> None:
        sampled = step.get(tid) if step else None
        token = self.decode_token(tid, sampled)
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
        for alt_id, alt in ranked[:num_top]:
            top.setdefault(self.decode_token(alt_id, alt), _clean_logprob(alt.logprob))
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
        states: dict[int, _ChoiceState] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens: dict[int, int] = {}
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
                    finish = o.finish_reason
                    if not text and not new_ids and finish is None and st.started:
                        continue
                    prefix = ""
                    first = not st.started
                    if req.echo and first:
                        prefix = self._echo_text(prompts[i])
                        st.prefix_len = len(prefix)
                    lp = None
                    if req.logprobs is not None:
                        lp = self.completion_logprobs(
                            new_ids,
                            o.logprobs,
                            req.logprobs,
                            st.prefix_len + st.text_len,
                            echo_prompt=prompts[i] if req.echo and first else None,
                            prompt_logprobs=getattr(out, "prompt_logprobs", None),
                        ).model_dump(mode="json")
                    st.started = True
                    st.text_len += len(text)
                    st.num_tokens += len(new_ids)
                    completion_tokens[index] = st.num_tokens
                    if finish is not None:
                        st.finished = True
                    choice = {
                        "index": index,
                        "text": prefix + text,
                        "logprobs": lp,
                        "finish_reason": _FINISH_REASONS.get(finish or "", finish),
                        "stop_reason": _stop_reason(finish, o.stop_reason),
                        # like vLLM: the prompt's ids in each choice's first chunk
                        "prompt_token_ids": list(prompts[i].token_ids)
                        if want_ids and first
                        else None,
                        "token_ids": list(new_ids) if want_ids else None,
                    }
                    chunk = {**head, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    chunk["system_fingerprint"] = None
                    yield sse_json(chunk)
            if include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                done = sum(completion_tokens.values())
                usage = UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=done,
                    total_tokens=prompt_tokens + done,
                )
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
    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        self.check_alive()
        model = self.resolve_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        prompt_ids = self.render_chat(req.messages, req.add_generation_prompt is not False)
        wanted = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = self.check_length(prompt_ids, wanted, "messages")
        num_top = req.top_logprobs or 0
        params = self.sampling_params(
            req, max_tokens=max_tokens, logprobs=num_top if req.logprobs else None
        )
        stream = self.check_streaming(req, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompt = PreparedPrompt(None, prompt_ids)
        if stream:
            (started,) = await self._start_streams([prompt], params, request_id, suffix=False)
            return self._stream_chat(
                req, model, prompt, params, request_id, created, num_top, started
            )
        (out,) = await self._generate_all(raw_request, [prompt], params, request_id)
        choices = []
        completion_tokens = 0
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            choices.append(
                ChatChoice(
                    index=o.index,
                    message=ChatResponseMessage(content=o.text),
                    logprobs=self.chat_logprobs(o.token_ids, o.logprobs, num_top)
                    if req.logprobs
                    else None,
                    finish_reason=_FINISH_REASONS.get(o.finish_reason or "", o.finish_reason),
                    stop_reason=o.stop_reason if isinstance(o.stop_reason, int | str) else None,
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
        )

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Any]] | None, num_top: int
    ) -> ChatLogprobs:
        content: list[ChatTokenLogprob] = []
        for k, tid in enumerate(token_ids):
            step = logprobs[k] if logprobs and k < len(logprobs) else {}
            sampled = step.get(tid)
            token = self.decode_token(tid, sampled)
            ranked = sorted(step.items(), key=lambda kv: -_clean_logprob(kv[1].logprob))
            tops = []
            for alt_id, alt in ranked[:num_top]:
                alt_token = self.decode_token(alt_id, alt)
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
    ) -> AsyncIterator[str | bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states: dict[int, _ChoiceState] = {}
        completion_tokens: dict[int, int] = {}
        # The chunk's fields in ChatCompletionStreamResponse's order (`usage` only when asked).
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(choice: dict[str, Any]) -> bytes:
            body = {**head, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            body["system_fingerprint"] = None
            return sse_json(body)

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
                        yield chunk(
                            {
                                "index": o.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                                "stop_reason": None,
                            }
                        )
                    text = o.text
                    new_ids = o.token_ids
                    finish = o.finish_reason
                    if not text and not new_ids and finish is None:
                        continue
                    lp = None
                    if req.logprobs:
                        lp = self.chat_logprobs(new_ids, o.logprobs, num_top).model_dump(
                            mode="json"
                        )
                    st.text_len += len(text)
                    st.num_tokens += len(new_ids)
                    completion_tokens[o.index] = st.num_tokens
                    if finish is not None:
                        st.finished = True
                    content = text if text or finish is None else None
                    yield chunk(
                        {
                            "index": o.index,
                            "delta": {"role": None, "content": content},
                            "logprobs": lp,
                            "finish_reason": _FINISH_REASONS.get(finish or "", finish),
                            "stop_reason": _stop_reason(finish, o.stop_reason),
                        }
                    )
            if include_usage:
                done = sum(completion_tokens.values())
                n_prompt = len(prompt.token_ids)
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=UsageInfo(
                        prompt_tokens=n_prompt, completion_tokens=done, total_tokens=n_prompt + done
                    ),
                )
                yield sse(final.model_dump(mode="json"))
        except Exception as exc:
            yield sse(self._stream_error(exc))
        finally:
            await aclose_quietly(stream)
        yield sse("[DONE]")
