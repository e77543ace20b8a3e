"""Checking and tokenizing a request before anything is queued.

Everything a user can get wrong about one request is found here: the prompt (text without a
tokenizer, empty, token ids outside the vocabulary, longer than the model's context or than the
whole KV cache) and the sampling parameters' fit with the engine (beam width above
`max_num_seqs`, stop strings, bad words or a grammar without a tokenizer, `logit_bias` or
`allowed_token_ids` outside the vocabulary, a grammar the tokenizer cannot follow). A bad
request raises `ValueError` naming the problem and changes nothing, so the engine keeps serving
the others.

What the runner needs per request is prepared here, once, off the engine's step (the server
calls `prepare` from a worker thread): `truncate_prompt_tokens` applied, `bad_words` tokenized,
`allowed_token_ids` as a bitmask row, the grammar's matcher state (`RequestSampling`), and
`logprobs=-1` / `prompt_logprobs=-1` resolved to the vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.engine.sampling_params import RequestSampling, SamplingParams
from pagedkv.engine.structured.bitmask import tokens_to_bitmask


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
                 max_num_seqs: int, eos_token_ids: Sequence[int] = ()) -> None:
        """`kv_capacity`: token slots of the whole KV cache (blocks x block size)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity = kv_capacity
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = sorted(eos_token_ids)
        self._grammars = None  # structured.matchers.GrammarBackend, made on first use

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
        self._check_token_ids(params)
        ids, text = self._prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            if keep == -1:
                keep = self.max_model_len - 1
            ids = ids[-keep:]
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
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(internal, name) == -1:  # every token of the vocabulary
                internal = internal.clone() if internal is params else internal
                setattr(internal, name, self.vocab_size)
        sampling = RequestSampling.of(
            internal,
            structured=self._grammar(params),
            allowed_bitmask=(tokens_to_bitmask(params.allowed_token_ids, self.vocab_size)
                             if params.allowed_token_ids is not None else None),
            bad_words_token_ids=self._bad_words(params),
        )
        return PreparedRequest(text, ids, params, sampling, max_tokens)

    def _check_token_ids(self, params: SamplingParams) -> None:
        v = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            for t in ids:
                if t >= v:
                    raise ValueError(
                        f"{name} has token id {t}, outside the model's vocabulary [0, {v})"
                    )
        if self.tokenizer is None and (params.bad_words or params.structured_outputs):
            raise ValueError(
                "bad_words and structured outputs need a tokenizer, and this engine runs "
                "without one (--skip-tokenizer-init); use logit_bias or allowed_token_ids"
            )

    def _grammar(self, params: SamplingParams):
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            from pagedkv.engine.structured.matchers import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars.request(params.structured_outputs)

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad words: each word as it is (leading spaces dropped), and
        once more after a space when that gives a different first token but as many tokens
        (the word in the middle of a text)."""
        out: list[tuple[int, ...]] = []
        for word in params.bad_words or ():
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if plain:
                out.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return tuple(out)

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
            # Plain ints in the vocabulary are checked at C speed (a long prompt is 100k
            # tokens); anything else goes through the loop that names the first bad one.
            plain = (set(map(type, ids)) <= {int} and min(ids, default=0) >= 0
                     and max(ids, default=0) < self.vocab_size)  # fmt: skip
            if not plain:
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
