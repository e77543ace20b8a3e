"""What happens to sampled tokens after the scheduler applied them: text, stop strings,
log-probabilities, beam search and the `RequestOutput` objects a caller sees.

The scheduler owns the sequences (their tokens, forks, stop tokens, lengths). This module
keeps, per sequence, only what the scheduler does not need: the incremental detokenizer (and
the stop strings it finds), the log-probabilities asked for, the cumulative log-probability,
and per request its timings and, with beam search, the beam state. It never copies the
scheduler's state: it reads the sequence group the scheduler returned when the request was
queued.

Per step, the engine calls:

* `choose(out, result)` before `Scheduler.update`: the samples to apply. For most requests
  that is what the runner sampled; beam-search requests pick their next beams here from the
  runner's candidates (a parent chosen k times is forked k - 1 times, one not chosen dropped);
* `process(out, result, samples, update)` after it: forked sequences start as copies of their
  parent's output state, each new token goes to its sequence's detokenizer (a stop string
  ends the sequence through `finish_sequence`), and the requests touched get a
  `RequestOutput` (finished ones always; running ones when `emit_partial_outputs`).

The engine-core process (`pagedkv.engine.core`) runs without detokenization and without
partial outputs: it sets `deltas` to a `StepDeltas`, which collects each step's new tokens as
flat lists (one entry per token, no object per token), and sends those to the API process,
which detokenizes there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.engine.beam_search import Beam, BeamSearch
from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize
from pagedkv.engine.input_processor import PreparedRequest
from pagedkv.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    RunnerOutput,
    TokenLogprobs,
)
from pagedkv.scheduler import FinishReason

_FINISH_TEXT = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.REJECTED: "abort",
}


@dataclass(slots=True)
class SeqOutputState:
    """One sequence's output state (what the scheduler does not keep)."""

    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list | None  # one dict per generated position, when asked for
    cum_logprob: float = 0.0

    def fork(self, index: int) -> SeqOutputState:
        """A forked child's state: a copy of this one (before this sequence's new token)."""
        return SeqOutputState(
            index,
            self.detok.clone() if self.detok is not None else None,
            list(self.logprobs) if self.logprobs is not None else None,
            self.cum_logprob,
        )


@dataclass(slots=True)
class StepDeltas:
    """The tokens appended in one step, one entry per token, as flat parallel lists.

    Entry `i` is token `token_ids[i]` of sequence `seq_indices[i]` (the `CompletionOutput`
    index) of request `request_ids[i]`. Sparse extras point at their entry: `logprobs` holds
    `(i, TokenLogprobs)` for requests that asked for logprobs, `finishes` holds
    `(i, finish_reason, stop_reason)` when the sequence finished with that token. Beam-search
    requests are left out (their beams change wholesale; only the final output counts).
    """

    request_ids: list[str] = field(default_factory=list)
    seq_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    finishes: list[tuple[int, str, int | str | None]] = field(default_factory=list)

    def take(self) -> StepDeltas:
        """This step's entries; `self` starts empty again (the lists change hands, no copy)."""
        taken = StepDeltas(self.request_ids, self.seq_indices, self.token_ids, self.logprobs,
                           self.finishes)
        self.request_ids, self.seq_indices, self.token_ids = [], [], []
        self.logprobs, self.finishes = [], []
        return taken


@dataclass(slots=True)
class RequestState:
    request_id: str
    prep: PreparedRequest
    group: object  # pagedkv.scheduler.SequenceGroup: the scheduler's, read-only here
    metrics: RequestMetrics
    seqs: dict[int, SeqOutputState] = field(default_factory=dict)
    beam: BeamSearch | None = None
    #: With prompt_logprobs: [None] then one entry per prompt token computed so far.
    prompt_logprobs: list | None = None


class OutputProcessor:
    """Per-request output state, and the step's `RequestOutput` objects."""

    def __init__(
        self,
        tokenizer,
        eos_token_ids: list[int],
        finish_sequence: Callable[[int, FinishReason], bool],
    ) -> None:
        """`finish_sequence(seq_id, reason)`: ends a sequence in the scheduler (stop strings)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._finish_sequence = finish_sequence
        self._requests: dict[str, RequestState] = {}
        # Live requests that need more than an argmax (sampling, logprobs, beams...): while
        # there are none, asynchronous scheduling may overlap steps.
        self._num_not_argmax = 0
        self._num_not_greedy = 0
        # Beam search: the cumulative logprob of each choice of this step, per parent sequence
        # (continuation first, then one per fork, as `Scheduler.update` forks them).
        self._beam_cum: dict[int, list[float]] = {}
        #: Streaming callers want every request's cumulative output after each step; offline
        #: callers only the finished ones (building the rest copies every live sequence).
        self.emit_partial_outputs = True
        #: When set, every appended token is also recorded here (the engine core's step message).
        self.deltas: StepDeltas | None = None

    # ---- requests -----------------------------------------------------------------------------
    def add(self, request_id: str, prep: PreparedRequest, group, arrival_time: float) -> None:
        st = RequestState(request_id, prep, group, RequestMetrics(arrival_time=arrival_time))
        first = group.seqs[0] if group.seqs else group.finished_seqs[0]
        st.seqs[first.seq_id] = self._new_seq_state(prep, 0)
        p = prep.params
        if p.use_beam_search:
            st.beam = BeamSearch.from_params(p, self.eos_token_ids, max_tokens=prep.max_tokens)
        if p.prompt_logprobs is not None:
            st.prompt_logprobs = [None]
        self._requests[request_id] = st
        self._num_not_argmax += not prep.sampling.argmax_only
        self._num_not_greedy += not prep.sampling.greedy

    def _new_seq_state(self, prep: PreparedRequest, index: int) -> SeqOutputState:
        p = prep.sampling.params
        detok = None
        # Without text (detokenize=False, or no tokenizer) there is nothing for a detokenizer
        # to do: stop tokens and EOS are the scheduler's, and stop strings need text.
        if not p.use_beam_search and p.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prep.prompt_token_ids, p,
                                           eos_token_ids=self.eos_token_ids)
        return SeqOutputState(index, detok, [] if p.logprobs is not None else None)

    def _pop(self, request_id: str) -> RequestState | None:
        st = self._requests.pop(request_id, None)
        if st is not None:
            self._num_not_argmax -= not st.prep.sampling.argmax_only
            self._num_not_greedy -= not st.prep.sampling.greedy
        return st

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def prompt_logprobs_of(self, request_id: str) -> list | None:
        """The prompt logprobs computed so far for a live request that asked for them (the
        engine core sends them on once complete); None otherwise."""
        st = self._requests.get(request_id)
        return None if st is None else getattr(st, "prompt_logprobs", None)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def all_argmax(self) -> bool:
        """Whether every live request is plain greedy (see `RequestSampling`)."""
        return self._num_not_argmax == 0

    @property
    def all_greedy(self) -> bool:
        """Whether every live request takes an argmax, plain or under token masks."""
        return self._num_not_greedy == 0

    # ---- one step -----------------------------------------------------------------------------
    def note_scheduled(self, out, now: float) -> None:
        """Queue time of the requests scheduled for the first time, preemption counts."""
        requests = self._requests
        for ss in out.scheduled:
            # A request's first chunk computes (part of) its prompt: plain decodes are skipped.
            if ss.is_prefill:
                st = requests.get(ss.request_id)
                if st is not None and st.metrics.first_scheduled_time is None:
                    st.metrics.first_scheduled_time = now
                    st.metrics.time_in_queue = now - st.metrics.arrival_time
        for name, _mode in out.preempted:
            st = requests.get(name)
            if st is not None:
                st.metrics.num_preemptions += 1

    def finished_outside(self, groups, now: float) -> list[RequestOutput]:
        """Outputs of requests that ended outside `update` (rejected, aborted, ended for lack of
        KV memory): `SchedulerOutput.finished`."""
        results = []
        for g in groups:
            st = self._pop(g.request_id)
            if st is not None:
                st.metrics.finished_time = now
                results.append(self._final_output(st))
        return results

    def choose(self, out, result: RunnerOutput) -> dict[int, list[int]]:
        """The samples `Scheduler.update` applies: the runner's, plus the beams' choices."""
        if not result.beam_candidates:
            return result.sampled_token_ids
        samples = dict(result.sampled_token_ids)
        by_request: dict[str, list[tuple[int, tuple]]] = {}
        for ss in out.scheduled:
            cands = result.beam_candidates.get(ss.seq_id)
            if cands is not None:
                by_request.setdefault(ss.request_id, []).append((ss.seq_id, cands))
        self._beam_cum.clear()
        for rid, items in by_request.items():
            st = self._requests[rid]
            live = {s.seq_id: s for s in st.group.seqs}
            beams = [Beam(sid, live[sid].token_ids[live[sid].prompt_len:],
                          st.seqs[sid].cum_logprob) for sid, _ in items]
            res = st.beam.step(beams, [c for _, c in items])
            for sid, _ in items:
                samples[sid] = []  # dropped unless chosen below
            if res.done:
                continue
            plan = res.fork_plan([sid for sid, _ in items])
            for c in plan.continues + plan.forks:
                samples[c.parent_seq_id].append(c.token_id)
                self._beam_cum.setdefault(c.parent_seq_id, []).append(c.cum_logprob)
        return samples

    def process(self, out, result: RunnerOutput, samples, update, now: float) -> list[RequestOutput]:
        """Apply the step's new tokens to the output state; the step's `RequestOutput` objects.

        `samples` is what `Scheduler.update` applied (see `choose`) and `update` its result."""
        requests = self._requests
        touched: dict[str, RequestState] = {}
        if result.prompt_logprobs:
            self._add_prompt_logprobs(result.prompt_logprobs)
        logprobs = result.logprobs
        beam_cum = self._beam_cum
        children = None
        if update.forks:
            children = {}
            for parent, child in update.forks:
                children.setdefault(parent, []).append(child)
        for ss, seq in zip(out.scheduled, out.seqs):
            if not ss.do_sample:
                continue
            st = requests.get(ss.request_id)
            if st is None:  # ended since it was scheduled
                continue
            touched[ss.request_id] = st
            seq_id = ss.seq_id
            toks = samples.get(seq_id)
            if not toks:  # a beam that was not chosen, or a beam search that ended
                continue
            m = st.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            lps = logprobs.get(seq_id) if logprobs else None
            cums = beam_cum.get(seq_id) if beam_cum else None
            if len(toks) > 1:
                # Each child starts as a copy of its parent before the parent's new token.
                for j, child in enumerate(children[seq_id], start=1):
                    cseq = _find_seq(st.group, child)
                    st.seqs[child] = st.seqs[seq_id].fork(cseq.index)
                    self._append(st, child, cseq, toks[j], lps[j] if lps else None,
                                 cums[j] if cums else None)
            self._append(st, seq_id, seq, toks[0], lps[0] if lps else None,
                         cums[0] if cums else None)
        beam_cum.clear()
        results = []
        emit = self.emit_partial_outputs
        for rid, st in touched.items():
            if st.group.is_finished:
                st.metrics.finished_time = now
                if st.beam is not None and not st.beam.done:
                    st.beam.finish(self._live_beams(st))
                self._pop(rid)
                results.append(self._final_output(st))
            elif emit and st.beam is None:
                results.append(self._output(st, finished=False))
        return results

    def _add_prompt_logprobs(self, chunks) -> None:
        """Each request's prompt logprobs of this step, in prompt order; positions a recompute
        computed a second time are skipped."""
        for rid, (first, lps) in chunks.items():
            st = self._requests.get(rid)
            if st is None or st.prompt_logprobs is None:
                continue
            have = st.prompt_logprobs
            if first <= len(have):
                have.extend(lps[len(have) - first:])

    def _append(self, st: RequestState, seq_id: int, seq, tok: int, lp, cum: float | None) -> None:
        """One new token of one sequence: cumulative logprob, logprobs, text, stop strings."""
        sst = st.seqs[seq_id]
        if cum is not None:  # beam search: the choice's score
            sst.cum_logprob = cum
        elif lp is not None:
            sst.cum_logprob += lp.logprob
            if sst.logprobs is not None and st.prep.params.logprobs is not None:
                sst.logprobs.append(lp.to_dict())
        detok = sst.detok
        if detok is not None:
            detok.add_tokens((tok,))
            if isinstance(detok.stop_reason, str) and not seq.is_finished:
                seq.stop_reason = detok.stop_reason
                self._finish_sequence(seq_id, FinishReason.STOP)
        deltas = self.deltas
        if deltas is not None and st.beam is None:
            entry = len(deltas.token_ids)
            deltas.request_ids.append(st.request_id)
            deltas.seq_indices.append(sst.index)
            deltas.token_ids.append(tok)
            if lp is not None:
                deltas.logprobs.append((entry, lp))
            if seq.is_finished:
                deltas.finishes.append((entry, _FINISH_TEXT[seq.finish_reason], seq.stop_reason))

    # ---- outputs ------------------------------------------------------------------------------
    def _live_beams(self, st: RequestState) -> list[Beam]:
        return [Beam(s.seq_id, s.token_ids[s.prompt_len:], st.seqs[s.seq_id].cum_logprob)
                for s in st.group.seqs]

    def _completion(self, st: RequestState, seq, final: bool) -> CompletionOutput:
        sst = st.seqs.get(seq.seq_id)
        finish = stop_reason = None
        if seq.is_finished:
            finish = _FINISH_TEXT[seq.finish_reason]
            stop_reason = seq.stop_reason
        text = ""
        if sst is not None and sst.detok is not None:
            if seq.is_finished and not sst.detok.finished:
                sst.detok.finish(finish or "abort", stop_reason)
            text = sst.detok.text if (final or seq.is_finished) else sst.detok.visible_text
        want_lp = st.prep.params.logprobs is not None
        return CompletionOutput(
            index=sst.index if sst else seq.index,
            text=text,
            token_ids=seq.token_ids[seq.prompt_len:],
            cumulative_logprob=sst.cum_logprob if sst else None,
            logprobs=list(sst.logprobs) if (want_lp and sst and sst.logprobs is not None) else None,
            finish_reason=finish,
            stop_reason=stop_reason,
        )

    def _output(self, st: RequestState, finished: bool) -> RequestOutput:
        comps = [self._completion(st, s, finished) for s in st.group.all_seqs()]
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                             finished, st.metrics, self._prompt_lp(st))

    @staticmethod
    def _prompt_lp(st: RequestState) -> list | None:
        return list(st.prompt_logprobs) if st.prompt_logprobs is not None else None

    def _final_output(self, st: RequestState) -> RequestOutput:
        p = st.prep.params
        g = st.group
        if st.beam is not None and st.beam.hypotheses:
            comps = []
            for i, h in enumerate(st.beam.results()[: p.n]):
                text = ""
                if p.detokenize and self.tokenizer is not None:
                    text = detokenize(self.tokenizer, st.prep.prompt_token_ids,
                                      h.output_token_ids, p, eos_token_ids=self.eos_token_ids).text
                comps.append(CompletionOutput(i, text, list(h.output_token_ids), h.cum_logprob,
                                              None, h.finish_reason, h.stop_token_id))
            return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                                 True, st.metrics, self._prompt_lp(st))
        comps = [self._completion(st, s, True) for s in g.all_seqs()]
        if g.finish_reason is FinishReason.ABORTED or g.finish_reason is FinishReason.REJECTED:
            for c in comps:
                c.finish_reason = "abort"
        if p.best_of > p.n and not p.use_beam_search:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            comps = comps[: p.n]
            for i, c in enumerate(comps):
                c.index = i
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps, True,
                             st.metrics, self._prompt_lp(st))


def _find_seq(group, seq_id: int):
    """The sequence `seq_id` of a group (a forked child: looked up only when forks happen)."""
    for s in group.seqs:
        if s.seq_id == seq_id:
            return s
    for s in group.finished_seqs:
        if s.seq_id == seq_id:
            return s
    raise KeyError(seq_id)
