"""`SamplingParams`: how one request picks its tokens, with vLLM's field names and meaning.

Everything a user can get wrong is checked once, here, in `__post_init__`, so the sampler,
the detokenizer and the beam search can trust the values. A bad value raises `ValueError`
naming the field and the allowed range, before anything is queued.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pagedkv.engine.structured.params import StructuredOutputsParams

#: Temperatures below this are greedy (argmax), like vLLM.
SAMPLING_EPS = 1e-5

#: Most top-N alternatives a request may ask for per token (`logprobs`, `prompt_logprobs`);
#: -1 asks for the whole vocabulary.
MAX_LOGPROBS = 20

#: Largest absolute bias in `logit_bias` (OpenAI's range, -100 to 100).
MAX_LOGIT_BIAS = 100.0


class SamplingType(IntEnum):
    """How the sampler picks a row's token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling options of one request (vLLM names and semantics).

    `temperature == 0` (below 1e-5) is greedy. `top_k` 0 or -1 means no top-k. `best_of`
    defaults to `n`; `n` of the `best_of` sequences are returned. With `use_beam_search`,
    `best_of` (or `n`) is the beam width and `temperature` must be 0. `max_tokens=None`
    means "until the model's context is full" (the engine caps it). `stop` strings end the
    text (the stop string itself is cut unless `include_stop_str_in_output`);
    `stop_token_ids` end it like EOS. `logprobs=N` returns the sampled token's log-probability
    and the N most likely alternatives of the model's raw distribution (-1: every token).

    Logits processing, in vLLM's order: `structured_outputs` (a grammar: `StructuredOutputsParams`;
    `guided_decoding` is vLLM's older name), `allowed_token_ids` (every other token masked) and
    `bad_words` (a word's last token is masked when the tokens before it end the output so
    far) as one token mask; `min_tokens`; `logit_bias` (token id -> bias added to its logit, in
    [-100, 100]); the penalties; then temperature, top-k, top-p, min-p. `prompt_logprobs=N`
    returns, per prompt token, its logprob and the N most likely alternatives (the first
    position is None). `truncate_prompt_tokens=k` keeps the last k prompt tokens (-1: as many
    as the model's context allows).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        # Normalise first (copies: never mutate the caller's lists), then validate everything.
        stop = self.stop
        if stop is None:
            stop_list: list[str] = []
        elif isinstance(stop, str):
            stop_list = [stop]
        elif isinstance(stop, list | tuple):
            stop_list = list(stop)
        else:
            raise ValueError(
                f"stop must be a string or a list of strings, got {type(stop).__name__}"
            )
        stop_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, list | tuple):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {type(stop_ids).__name__}"
            )
        self._validate(stop_list, list(stop_ids))
        self._validate_processing()
        self.stop = stop_list
        self.stop_token_ids = list(stop_ids)
        if self.best_of is None:
            self.best_of = self.n

    def _validate(self, stop: list[str], stop_token_ids: list[object]) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < 1:
                raise ValueError(f"best_of must be an integer >= 1, got {self.best_of!r}")
            if self.n > self.best_of:
                raise ValueError(
                    f"n must be <= best_of (n={self.n}, best_of={self.best_of}): "
                    "best_of is how many sequences are generated, n how many are returned"
                )
        if (
            not _is_number(self.temperature)
            or not (self.temperature >= 0.0)
            or math.isinf(self.temperature)
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (
            not _is_number(self.repetition_penalty)
            or not (0.01 <= self.repetition_penalty <= 100.0)
        ):
            # Outside this range the penalised logits overflow float32 and sampling is garbage.
            raise ValueError(
                f"repetition_penalty must be in [0.01, 100] (1 = off), got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens (min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not (-1 <= v <= MAX_LOGPROBS)):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], -1 (every token) or "
                    f"None, got {v!r}"
                )
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the text)")
        for t in stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {t!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        best_of = self.n if self.best_of is None else self.best_of
        if self.use_beam_search:
            if self.temperature >= SAMPLING_EPS:
                raise ValueError(
                    f"temperature must be 0 with use_beam_search (beam search is deterministic), "
                    f"got {self.temperature!r}"
                )
            if self.top_p < 1.0 or self.top_k not in (0, -1) or self.min_p > 0.0:
                raise ValueError(
                    "top_p, top_k and min_p must be off (1, 0, 0) with use_beam_search, got "
                    f"top_p={self.top_p!r}, top_k={self.top_k!r}, min_p={self.min_p!r}"
                )
            if stop:
                raise ValueError(
                    "stop strings are not supported with use_beam_search; use stop_token_ids"
                )
        else:
            if self.length_penalty != 1.0:
                raise ValueError(
                    f"length_penalty only applies to beam search (use_beam_search=True), "
                    f"got {self.length_penalty!r}"
                )
            if self.early_stopping is not False:
                raise ValueError(
                    f"early_stopping only applies to beam search (use_beam_search=True), "
                    f"got {self.early_stopping!r}"
                )
            if self.temperature < SAMPLING_EPS and best_of > 1:
                raise ValueError(
                    f"best_of (and n) must be 1 with greedy sampling (temperature=0), got "
                    f"best_of={best_of}: the copies would be identical; set temperature > 0"
                )

    def _validate_processing(self) -> None:
        """The token-level controls: logit_bias, allowed_token_ids, bad_words,
        truncate_prompt_tokens, structured outputs. Normalises them to fresh containers."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    "logit_bias must be a dict token id -> bias, got "
                    f"{type(self.logit_bias).__name__}"
                )
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}"
                    )
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids:
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}"
                )
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(
                        f"allowed_token_ids must be token ids (integers >= 0), got {t!r}"
                    )
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, list | tuple):
                raise ValueError(f"bad_words must be a list of strings, got {words!r}")
            for w in words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must be non-blank strings, got {w!r}")
            self.bad_words = list(words)
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or t >= 1)):
            raise ValueError(
                f"truncate_prompt_tokens must be an integer >= 1, -1 (the model's context) or "
                f"None, got {t!r}"
            )
        so, gd = self.structured_outputs, self.guided_decoding
        if so is not None and gd is not None and so is not gd:
            raise ValueError("give structured_outputs or guided_decoding (its old name), not both")
        so = so if so is not None else gd
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(so).__name__}"
            )
        self.structured_outputs = self.guided_decoding = so

    # ---- derived values -------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def beam_width(self) -> int:
        """Beams kept per step in beam search (= best_of, which defaults to n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_token_mask(self) -> bool:
        """Whether some tokens are masked per row (a grammar, allowed_token_ids, bad_words)."""
        return (
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def output_text_buffer_length(self) -> int:
        """Most characters streaming may hold back while a stop string could still be forming."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def all_stop_token_ids(self, eos_token_ids: object = ()) -> set[int]:
        """Tokens that end a sequence: the model's EOS ids (unless `ignore_eos`) and `stop_token_ids`."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(int(t) for t in eos_token_ids)  # type: ignore[attr-defined]
        return ids

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


@dataclass(slots=True, frozen=True)
class RequestSampling:
    """How the runner samples one queued request: the parameters it samples with (which may
    ask for more than the user did, e.g. logprobs to rank `best_of` samples) and whether an
    argmax is all it needs (greedy, one sequence, no logprobs, penalties, min_tokens, logit
    bias, token masks or prompt logprobs), so a batch of only such requests takes the argmax
    path without building a sampling batch (and may be scheduled asynchronously); a batch of
    such requests and greedy ones under token masks (`masked_argmax`: structured output with
    temperature 0, say) masks just those rows before the argmax.

    What the input processor prepared once for the token mask travels with it:
    `structured` (the request's grammar matchers, `structured.matchers.StructuredRequest`),
    `allowed_bitmask` (a host bitmask row of `allowed_token_ids`) and `bad_words_token_ids`.

    The engine attaches it to the scheduler's sequence group (`SequenceGroup.sampling`); the
    scheduler never reads it."""

    params: SamplingParams
    argmax_only: bool
    structured: Any = None
    allowed_bitmask: Any = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    #: Greedy like `argmax_only` but under token masks: an argmax over the masked logits.
    masked_argmax: bool = False

    @property
    def needs_token_mask(self) -> bool:
        return (self.structured is not None or self.allowed_bitmask is not None
                or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        """An argmax is all it takes, plain (`argmax_only`) or over masked logits."""
        return self.argmax_only or self.masked_argmax

    @classmethod
    def of(cls, params: SamplingParams, *, structured: Any = None, allowed_bitmask: Any = None,
           bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> RequestSampling:
        greedy = (
            params.sampling_type == SamplingType.GREEDY
            and params.best_of == 1
            and params.logprobs is None
            and params.prompt_logprobs is None
            and params.min_tokens == 0
            and not params.needs_penalties
            and not params.logit_bias
        )
        masked = (params.needs_token_mask or structured is not None
                  or allowed_bitmask is not None or bool(bad_words_token_ids))
        return cls(params, greedy and not masked, structured, allowed_bitmask,
                   tuple(bad_words_token_ids), greedy and masked)
