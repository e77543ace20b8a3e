"""What the engine hands back for a request: `RequestOutput` with one `CompletionOutput` per
returned sequence, per-token `Logprob` values and timing `RequestMetrics`.

Field names and positional order follow vLLM so code written against vLLM reads our outputs.
Streaming outputs are cumulative: `text` and `token_ids` hold everything generated so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: `finish_reason` values.
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the model's context length
FINISH_ABORT = "abort"  # aborted by the user (e.g. the client went away)


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position.

    `rank` is 1 for the most likely token of the distribution; `decoded_token` is the token's
    own text (filled by the detokenizer when asked).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's log-probabilities: the sampled token and the top-N alternatives, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one generated position (raw model distribution), as the runner
    hands them back: the sampled token's, its rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]

    def to_dict(self) -> PositionLogprobs:
        """vLLM's per-position dict: the sampled token first, then the top-N alternatives."""
        out = {self.token_id: Logprob(self.logprob, self.rank)}
        for r, (t, lp) in enumerate(zip(self.top_token_ids, self.top_logprobs), start=1):
            if t not in out:
                out[t] = Logprob(lp, r)
        return out


@dataclass(slots=True)
class RunnerOutput:
    """What the model runner hands back for one step: plain host data, no tensors.

    `sampled_token_ids` is the input of `Scheduler.update`: per sampling sequence its new
    token, or several (a request's first token with `best_of > 1`: the scheduler forks one
    sequence per extra token), or none (an empty list drops the sequence). Beam-search
    sequences are absent there: `beam_candidates` holds each one's best next tokens and their
    log-probabilities, from which the engine's beam search picks. `logprobs` holds one entry
    per sampled token for the requests that asked for them. `prompt_logprobs` holds, per
    request that asked for them and computed prompt positions in this step, the index of the
    first prompt token predicted and one `PositionLogprobs` per prompt token from there.
    """

    sampled_token_ids: dict[int, list[int]]
    logprobs: dict[int, list[TokenLogprobs]] | None = None
    beam_candidates: dict[int, tuple[list[int], list[float]]] | None = None
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (so far, while streaming)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time() seconds) of one request's life, for latency figures."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """Everything about one request so far: its prompt and its (cumulative) completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    #: With `SamplingParams.prompt_logprobs`: per prompt token its logprob and rank and the
    #: top-N alternatives, None for the first token (nothing predicts it), as vLLM.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int | None = field(default=None)
