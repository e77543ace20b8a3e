"""`ChatServing`: /v1/chat/completions, from messages to a reply or its SSE chunks.

The messages become a prompt through the model's chat template (Jinja, rendered and tokenized
on the tokenizer worker); a reply may call tools, which are parsed from its text (`auto`) or
forced by a grammar (`required`, a named function). A streamed reply holds back text that may
begin a tool call and sends the calls, parsed whole, when it ends.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedkv.engine import SamplingParams
from pagedkv.server.errors import bad_request
from pagedkv.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    TopLogprob,
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
from pagedkv.server.streams import aclose_quietly
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

#: chat_template_kwargs names that the request's own fields set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
     "continue_final_message", "chat_template", "documents", "return_dict"}
)


@dataclass(slots=True)
class ToolUse:
    """A chat request's tool handling: `mode` None (no tools or "none"), "auto", "required"
    or "named"."""

    mode: str | None
    tools: list[dict[str, Any]] | None = None
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None


class ChatServing:
    """The chat endpoint over the app's shared `OpenAIServing`; it owns the chat template
    (the model's, or `--chat-template`) and the tool-call parser. /tokenize renders messages
    through it too."""

    def __init__(
        self,
        serving: OpenAIServing,
        *,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        trust_request_chat_template: bool = False,
    ) -> None:
        self.serving = serving
        tokenizer = serving.tokenizer
        self.chat_template: str | None = chat_template or getattr(
            tokenizer, "chat_template", None
        )
        self.tool_call_parser = tool_call_parser
        self.trust_request_chat_template = trust_request_chat_template
        pick_parser(tool_call_parser, self.chat_template)  # a bad name fails at start
        # apply_chat_template's own parameters: chat_template_kwargs may not set them
        apply = getattr(tokenizer, "apply_chat_template", None)
        self._template_params: frozenset[str] = frozenset(
            name
            for name, p in (inspect.signature(apply).parameters.items() if apply else ())
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )

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
        tokenizer = self.serving.worker.tokenizer
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
        return self.serving.worker.encode(str(text), add_special_tokens, limit, "messages")

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
        self.serving.require_tokenizer(
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
        return await self.serving.worker.run(
            self._render_sync, conversation, template, tools, add_generation_prompt,
            continue_final_message, add_special_tokens, kwargs, limit,
        )

    # ---- the endpoint ------------------------------------------------------------------------
    def tool_use(self, req: ChatCompletionRequest, template: str | None) -> ToolUse:
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
            return ToolUse(None)
        if choice == "none":
            return ToolUse(None)
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
            return ToolUse("named", tools, choice.function.name, parallel)
        if choice == "required":
            return ToolUse("required", tools, None, parallel)
        return ToolUse("auto", tools, None, parallel,
                       pick_parser(self.tool_call_parser, template))

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        s = self.serving
        model = s.check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        template = req.chat_template or self.chat_template
        tools = self.tool_use(req, template)
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
            limit=s.text_limit(req.truncate_prompt_tokens),
        )
        prompt_ids = s.truncate(prompt_ids, req.truncate_prompt_tokens)
        wanted = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = s.check_length(prompt_ids, wanted, "messages")
        tool_schema = None
        if tools.mode in ("required", "named"):
            tool_schema = forced_call_schema(tools.tools or [], tools.named, tools.parallel)
        structured = None
        if tool_schema is not None or wants_structure(req):
            structured = await s.worker.run(s.structured_outputs, req, tool_schema)
        num_top = req.top_logprobs if req.top_logprobs is not None else 0
        params = s.sampling_params(
            req, max_tokens=max_tokens, logprobs=num_top if req.logprobs else None,
            structured=structured,
        )
        stream = s.check_streaming(req, params)
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
            (started,) = await s.start_streams([prompt], params, request_id, suffix=False)
            return self._stream_chat(
                req, model, prompt, params, request_id, created, num_top, started, tools, echo
            )
        (out,) = await s.generate_all(
            raw_request, [prompt], params, request_id, suffix=False
        )
        as_id = bool(req.return_tokens_as_token_ids)
        choices = []
        completion_tokens = 0
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            finish, stop = s.finish(
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
            usage=UsageInfo(**s.usage(len(prompt_ids), completion_tokens)),
            prompt_logprobs=s.prompt_logprobs_json(
                getattr(out, "prompt_logprobs", None), as_id
            )
            if req.prompt_logprobs is not None
            else None,
        )

    def _tool_calls(self, tools: ToolUse, text: str) -> tuple[str | None, list[ParsedCall]]:
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
            token = self.serving.decode_token(tid, sampled, as_id)
            ranked = sorted(step.items(), key=lambda kv: -clean_logprob(kv[1].logprob))
            tops = []
            for alt_id, alt in top_alternatives(ranked, num_top):
                alt_token = self.serving.decode_token(alt_id, alt, as_id)
                tops.append(
                    TopLogprob(
                        token=alt_token,
                        logprob=clean_logprob(alt.logprob),
                        bytes=list(alt_token.encode("utf-8")),
                    )
                )
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=clean_logprob(sampled.logprob if sampled else None),
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
        tools: ToolUse,
        echo: str,
    ) -> AsyncIterator[str | bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        as_id = bool(req.return_tokens_as_token_ids)
        states: dict[int, ChoiceState] = {}
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
                body["usage"] = self.serving.usage(n_prompt, sum(completion_tokens.values()))
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
                        st = states[o.index] = ChoiceState()
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
                        finish, stop = self.serving.finish(
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
                    usage=UsageInfo(**self.serving.usage(n_prompt, done_tokens)),
                )
                yield sse(final.model_dump(mode="json"))
        except Exception as exc:
            yield sse(self.serving.stream_error(exc))
        finally:
            await aclose_quietly(stream)
        yield sse("[DONE]")

    def _chat_deltas(
        self, st: ChoiceState, tools: ToolUse, finished: bool
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
