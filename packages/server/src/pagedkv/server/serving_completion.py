"""`CompletionServing`: /v1/completions, from a prompt (text, token ids, or a list of either)
to choices or their SSE chunks, with echo and OpenAI's legacy logprobs (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from pagedkv.engine import SamplingParams
from pagedkv.server.errors import bad_request
from pagedkv.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
)
from pagedkv.server.serving import (
    ChoiceState,
    OpenAIServing,
    PreparedPrompt,
    clean_logprob,
    sse,
    sse_json,
    top_alternatives,
    wants_structure,
)
from pagedkv.server.streams import aclose_quietly, merge_streams


class CompletionServing:
    """The completions endpoint over the app's shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        """The request's prompts as token ids (text tokenized on the worker, ids checked
        against the vocabulary), each truncated as `truncate_prompt_tokens` asks."""
        s = self.serving
        p = req.prompt
        limit = s.text_limit(req.truncate_prompt_tokens)
        special = req.add_special_tokens is not False
        trunc = req.truncate_prompt_tokens
        if isinstance(p, str):
            return [PreparedPrompt(p, s.truncate(
                await s.encode(p, add_special_tokens=special, limit=limit), trunc))]
        if p and isinstance(p[0], str):
            return [
                PreparedPrompt(text, s.truncate(
                    await s.encode(text, add_special_tokens=special, limit=limit), trunc))
                for text in p  # type: ignore[union-attr]
            ]
        if p and isinstance(p[0], int):
            ids = list(p)  # type: ignore[arg-type]
            s.check_token_ids(ids, "prompt")
            return [PreparedPrompt(None, s.truncate(ids, trunc))]
        out = []
        for ids in p:  # type: ignore[union-attr]
            s.check_token_ids(ids, "prompt")  # type: ignore[arg-type]
            out.append(PreparedPrompt(None, s.truncate(list(ids), trunc)))  # type: ignore[arg-type]
        return out

    async def create(self, req: CompletionRequest, raw_request: Request) -> Any:
        s = self.serving
        model = s.check_request(req)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = await self.prompts(req)
        max_tokens = min(s.check_length(p.token_ids, req.max_tokens, "prompt") for p in prompts)
        structured = None
        if wants_structure(req):
            structured = await s.worker.run(s.structured_outputs, req, None)
        params = s.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=req.logprobs,
            # echo with logprobs returns the prompt tokens' logprobs too, as OpenAI does
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            structured=structured,
        )
        stream = s.check_streaming(req, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            streams = await s.start_streams(prompts, params, request_id)
            return self._stream_completion(
                req, model, prompts, params, request_id, created, streams
            )
        finals = await s.generate_all(raw_request, prompts, params, request_id)
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
                finish, stop = s.finish(
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
                        prompt_logprobs=s.prompt_logprobs_json(
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
            usage=UsageInfo(**s.usage(prompt_tokens, completion_tokens)),
        )

    def returns_token_ids(self, req: CompletionRequest) -> bool:
        """Choices carry `token_ids` (and `prompt_token_ids`) when asked with vLLM's
        `return_token_ids`, and always without a tokenizer, where the text is empty."""
        return bool(req.return_token_ids) or self.serving.tokenizer is None

    def _echo_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        if self.serving.tokenizer is None:
            return ""  # the echoed prompt is in prompt_token_ids
        return self.serving.tokenizer.decode(prompt.token_ids)

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
        return len(token) if self.serving.tokenizer is not None and not as_id else 0

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
        token = self.serving.decode_token(tid, sampled, as_id)
        result.tokens.append(token)
        result.text_offset.append(pos)
        if step is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            return
        result.token_logprobs.append(clean_logprob(sampled.logprob) if sampled else None)
        top: dict[str, float] = {}
        if sampled is not None:
            top[token] = clean_logprob(sampled.logprob)
        ranked = sorted(step.items(), key=lambda kv: -clean_logprob(kv[1].logprob))
        for alt_id, alt in top_alternatives(ranked, num_top):
            alt_token = self.serving.decode_token(alt_id, alt, as_id)
            top.setdefault(alt_token, clean_logprob(alt.logprob))
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
        states: dict[int, ChoiceState] = {}
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
                        st = states[index] = ChoiceState()
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
                        finish, stop = self.serving.finish(
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
                        choice["prompt_logprobs"] = self.serving.prompt_logprobs_json(
                            prompt_lps, as_id
                        )
                    chunk = {**head, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = self.serving.usage(
                            prompt_tokens, sum(completion_tokens.values())
                        )
                    elif include_usage:
                        chunk["usage"] = None
                    chunk["system_fingerprint"] = None
                    yield sse_json(chunk)
            if include_usage:
                done = sum(completion_tokens.values())
                usage = UsageInfo(**self.serving.usage(prompt_tokens, done))
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(final.model_dump(mode="json"))
        except Exception as exc:
            yield sse(self.serving.stream_error(exc))
        finally:
            await aclose_quietly(merged)
        yield sse("[DONE]")
