"""`LLM`: the offline API, for scripts and notebooks (vLLM users should feel at home)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """Generate text for a batch of prompts with one engine.

    `LLM()` loads the embedded default model; `LLM("path/to/folder-or.gguf", **engine_options)`
    any other. Engine options are the fields of `EngineArgs` (vLLM's names).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_options))
        self.engine.emit_partial_outputs = False  # generate() returns finished outputs only
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.get_tokenizer()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or a list of token ids. One `SamplingParams` applies to all prompts,
        or give one per prompt. Every prompt is validated before any is queued, so a bad one
        raises `ValueError` and leaves the engine untouched.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                    "give one for all prompts or one per prompt"
                )
        prepared = [self.engine.prepare_request(p, sp) for p, sp in zip(prompts, params_list)]
        ids = []
        for prep in prepared:
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_prepared_request(request_id, prep)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        tokenizer = self.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm, unit="req")
        try:
            while len(finals) < len(wanted) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted and out.request_id not in finals:
                        finals[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in request_ids:
                if rid not in finals:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        missing = [rid for rid in request_ids if rid not in finals]
        if missing:
            raise RuntimeError(f"engine stopped before finishing requests {missing}")
        return [finals[rid] for rid in request_ids]
