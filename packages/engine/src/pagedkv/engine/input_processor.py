"""Checking and tokenizing a request before anything is queued.

Everything a user can get wrong about one request is found here: the prompt (text without a
tokenizer, empty, token ids outside the vocabulary, longer than the model's context or than the
whole KV cache) and the sampling parameters' fit with the engine (beam width above
`max_num_seqs`, stop strings without a tokenizer). A bad request raises `ValueError` naming
the problem and changes nothing, so the engine keeps serving the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.engine.sampling_params import RequestSampling, SamplingParams


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request that can be queued without further checks."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as the user gave them
    sampling: RequestSampling  # what the runner samples with
    max_tokens: int  # max_tokens capped by the model's context


class InputProcessor:
    """Validates and tokenizes requests for one engine (its tokenizer, model and KV cache)."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, kv_capacity: int,
                 max_num_seqs: int) -> None:
        """`kv_capacity`: token slots of the whole KV cache (blocks x block size)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity = kv_capacity
        self.max_num_seqs = max_num_seqs

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize; raises `ValueError` naming the problem, changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(
                "this engine runs without a tokenizer (--skip-tokenizer-init): give the prompt as "
                "a list of token ids"
            )
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need a tokenizer, and this engine runs without one "
                "(--skip-tokenizer-init): use stop_token_ids"
            )
        ids, text = self._prompt_ids(prompt)
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; with at least one generated token that is "
                f"longer than max_model_len={self.max_model_len}; shorten the prompt"
            )
        if len(ids) + 1 > self.kv_capacity:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the whole KV cache holds "
                f"{self.kv_capacity}; shorten the prompt or give the KV cache more memory"
            )
        if params.beam_width > self.max_num_seqs:
            raise ValueError(
                f"best_of/beam width {params.beam_width} exceeds max_num_seqs={self.max_num_seqs}"
            )
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        internal = params
        if self.tokenizer is None and params.detokenize:
            internal = params.clone()
            internal.detokenize = False
        if params.best_of > params.n and not params.use_beam_search and params.logprobs is None:
            internal = internal.clone() if internal is params else internal
            internal.logprobs = 0  # choosing the best n needs each token's logprob
        return PreparedRequest(text, ids, params, RequestSampling.of(internal), max_tokens)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token")
            ids = list(self.tokenizer(prompt).input_ids)
            if not ids:
                raise ValueError("the prompt is empty after tokenization; give at least one token")
            return ids, prompt
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"prompt token id {t!r} is not an int in [0, {self.vocab_size}) "
                        "(the model's vocabulary)"
                    )
            if not ids:
                raise ValueError("the prompt is empty; give at least one character or token")
            return ids, None
        raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
