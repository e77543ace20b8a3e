"""Beam-search bookkeeping for one request, independent of the KV cache.

Semantics follow Hugging Face transformers' beam search (decoder-only models), so the same
model gives the same best sequence:

* each step, every live beam's next-token log-probabilities are added to its cumulative
  log-probability; the best `K = max(2, 1 + #stop tokens) x beam_width` continuations overall
  are ranked;
* a continuation that ends the sequence (EOS / stop token, or the last token allowed by
  `max_tokens`) becomes a finished hypothesis only if it ranks within the top `beam_width`;
  its score is `cumulative_logprob / generated_length ** length_penalty`; the best
  `beam_width` hypotheses are kept;
* the next live beams are the best `beam_width` continuations that did not end;
* the request is done when no live beam can still beat the kept hypotheses: with
  `early_stopping=False` (transformers' default heuristic) once `beam_width` hypotheses exist
  and the best live beam's score at its current length is not better than the worst kept one;
  `True` stops as soon as `beam_width` hypotheses exist; `"never"` (with a positive length
  penalty) assumes a live beam could grow to `max_tokens`.

The engine turns the chosen continuations into sequence operations (`BeamStepResult.fork_plan`):
a parent chosen once continues in place, a parent chosen k times is forked k - 1 times
(the children share its KV blocks by copy-on-write), a parent not chosen is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedkv.engine.sampling_params import SamplingParams


def num_beam_candidates(beam_width: int, num_stop_token_ids: int) -> int:
    """How many best next tokens each beam must offer so that the union holds the global top K."""
    return max(2, 1 + num_stop_token_ids) * beam_width


@dataclass(slots=True)
class Beam:
    """A live beam as the engine sees it: its sequence, generated tokens and score so far."""

    seq_id: int
    output_token_ids: Sequence[int]
    cum_logprob: float


@dataclass(slots=True)
class BeamChoice:
    """A continuation chosen as a live beam for the next step."""

    parent_seq_id: int
    token_id: int
    cum_logprob: float


@dataclass(slots=True)
class BeamHypothesis:
    """A finished sequence kept as one of the request's `beam_width` best."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float
    parent_seq_id: int
    # "stop" when it ended on a stop token (then `stop_token_id` says which), "length" otherwise.
    finish_reason: str = "stop"
    stop_token_id: int | None = None


@dataclass(slots=True)
class ForkPlan:
    """`BeamStepResult.fork_plan`: what to do with the sequences after a step.

    Apply in this order: fork `forks` (each child copies its parent *before* the parent gets
    its new token), then append each choice's token to its sequence (`continues` to the parent
    itself, `forks` to the new child), then free `dropped`.
    """

    continues: list[BeamChoice]
    forks: list[BeamChoice]
    dropped: list[int]


@dataclass(slots=True)
class BeamStepResult:
    beams: list[BeamChoice]  # next live beams, best first (empty when done)
    finished: list[BeamHypothesis]  # hypotheses admitted to the kept set this step
    done: bool

    def fork_plan(self, live_seq_ids: Iterable[int]) -> ForkPlan:
        live = list(live_seq_ids)
        used: set[int] = set()
        continues: list[BeamChoice] = []
        forks: list[BeamChoice] = []
        for c in self.beams:
            if c.parent_seq_id in used:
                forks.append(c)
            else:
                used.add(c.parent_seq_id)
                continues.append(c)
        dropped = [s for s in live if s not in used]
        return ForkPlan(continues, forks, dropped)


@dataclass
class BeamSearch:
    """The beam state of one request across steps.

    Create it when the request starts (its single prompt row is the first live beam, with
    no tokens and cumulative logprob 0). Each step call `step(beams, candidates)`; when the
    sequence cannot grow any more for another reason (context full), call `finish(beams)`.
    `results()` gives the kept hypotheses, best first (return the first `n`).
    """

    beam_width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_token_ids: frozenset[int] = frozenset()
    max_tokens: int | None = None
    hypotheses: list[BeamHypothesis] = field(default_factory=list)
    done: bool = False
    _improvable: bool = True

    @classmethod
    def from_params(
        cls,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        *,
        max_tokens: int | None = None,
    ) -> BeamSearch:
        """`max_tokens` overrides `params.max_tokens` (e.g. capped by the model's context)."""
        if not params.use_beam_search:
            raise ValueError("BeamSearch needs SamplingParams(use_beam_search=True, temperature=0)")
        mt = params.max_tokens if max_tokens is None else max_tokens
        return cls(
            beam_width=params.beam_width,
            length_penalty=float(params.length_penalty),
            early_stopping=params.early_stopping,
            stop_token_ids=frozenset(params.all_stop_token_ids(eos_token_ids)),
            max_tokens=mt,
        )

    @property
    def num_candidates(self) -> int:
        return num_beam_candidates(self.beam_width, len(self.stop_token_ids))

    def _score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / (length**self.length_penalty)

    def step(
        self,
        beams: Sequence[Beam],
        candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
    ) -> BeamStepResult:
        """Advance one token.

        `candidates[i]` are beam i's best next tokens and their log-probabilities (at least
        `num_candidates` of them, or the whole vocabulary; order does not matter); e.g. a
        sampler `RowSample`'s `(beam_token_ids, beam_logprobs)`.
        """
        if self.done:
            raise ValueError("beam search already finished; read results()")
        if not beams or len(beams) != len(candidates):
            raise ValueError(
                f"need one candidate list per live beam, got {len(beams)} beams and "
                f"{len(candidates)} candidate lists"
            )
        length = len(beams[0].output_token_ids)
        if any(len(b.output_token_ids) != length for b in beams):
            raise ValueError("live beams must all have the same number of generated tokens")
        new_len = length + 1
        at_max = self.max_tokens is not None and new_len >= self.max_tokens

        pool: list[tuple[float, int, int, int]] = []  # (total, beam index, rank in beam, token)
        for bi, (beam, (toks, lps)) in enumerate(zip(beams, candidates)):
            if len(toks) != len(lps):
                raise ValueError(f"beam {bi}: {len(toks)} tokens but {len(lps)} logprobs")
            for r, (tok, lp) in enumerate(zip(toks, lps)):
                if lp == -math.inf or lp != lp:
                    continue
                pool.append((beam.cum_logprob + float(lp), bi, r, int(tok)))
        pool.sort(key=lambda x: (-x[0], x[1], x[2]))
        top = pool[: self.num_candidates]

        next_beams: list[BeamChoice] = []
        admitted: list[BeamHypothesis] = []
        full_before = len(self.hypotheses) >= self.beam_width
        can_admit = self._improvable and not (self.early_stopping is True and full_before)
        for rank, (total, bi, _, tok) in enumerate(top):
            is_stop = tok in self.stop_token_ids
            if is_stop or at_max:
                if rank < self.beam_width and can_admit:
                    admitted.append(
                        BeamHypothesis(
                            output_token_ids=[*beams[bi].output_token_ids, tok],
                            cum_logprob=total,
                            score=self._score(total, new_len),
                            parent_seq_id=beams[bi].seq_id,
                            finish_reason="stop" if is_stop else "length",
                            stop_token_id=tok if is_stop else None,
                        )
                    )
            elif len(next_beams) < self.beam_width:
                next_beams.append(BeamChoice(beams[bi].seq_id, tok, total))

        if admitted:
            merged = self.hypotheses + admitted
            # Stable: an earlier hypothesis wins a tie, as in transformers' merge.
            merged.sort(key=lambda h: -h.score)
            self.hypotheses = merged[: self.beam_width]
            kept = {id(h) for h in self.hypotheses}
            admitted = [h for h in admitted if id(h) in kept]

        # Can a live beam still beat the worst kept hypothesis?
        if next_beams and len(self.hypotheses) >= self.beam_width:
            if (
                self.early_stopping == "never"
                and self.length_penalty > 0.0
                and self.max_tokens is not None
            ):
                best_len = self.max_tokens
            else:
                best_len = new_len
            best_possible = self._score(next_beams[0].cum_logprob, best_len)
            worst_kept = min(h.score for h in self.hypotheses)
            self._improvable = self._improvable and best_possible > worst_kept
        all_ended = bool(top) and all(t[3] in self.stop_token_ids or at_max for t in top)
        self.done = (
            not self._improvable
            or (self.early_stopping is True and len(self.hypotheses) >= self.beam_width)
            or all_ended
            or not next_beams
        )
        return BeamStepResult(
            beams=[] if self.done else next_beams, finished=admitted, done=self.done
        )

    def finish(self, beams: Sequence[Beam]) -> list[BeamHypothesis]:
        """End the search now (e.g. the context is full): live beams become hypotheses
        ("length") if they rank among the best; returns `results()`."""
        if not self.done:
            for b in beams:
                n = len(b.output_token_ids)
                if n == 0:
                    continue
                self.hypotheses.append(
                    BeamHypothesis(
                        output_token_ids=list(b.output_token_ids),
                        cum_logprob=b.cum_logprob,
                        score=self._score(b.cum_logprob, n),
                        parent_seq_id=b.seq_id,
                        finish_reason="length",
                    )
                )
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[self.beam_width :]
            self.done = True
        return self.results()

    def results(self) -> list[BeamHypothesis]:
        """Kept hypotheses, best score first."""
        return sorted(self.hypotheses, key=lambda h: -h.score)
