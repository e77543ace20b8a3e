"""The API process's half of output processing: each step message from the engine core is
applied to the requests it names, and each request's stream takes what is new.

Per step (`FrontendOutputs.process`), in one pass over the message's entries: each new token
goes to its sequence (token ids, log-probabilities when asked, the cumulative log-probability)
and to its incremental detokenizer, the same `IncrementalDetokenizer` the offline engine uses,
which also finds stop strings. A stop string ends its sequence here; a request whose sequences
have all ended is reported for abort in the core (its remaining tokens were never wanted).
Touched requests are woken; nothing else is built per step.

A stream (`take`) builds its output only when it runs, from what accumulated since it last
ran: a consumer that falls behind (a slow client, a busy event loop) gets one bigger delta
instead of a queue of small ones. Three kinds of output:

* `"delta"`: what is new since the last output (text, token ids, logprobs), the server's
  streaming kind;
* `"cumulative"`: everything so far, like the offline engine's outputs (vLLM's default);
* `"final"`: only the finished output (non-streaming requests).

The final output is built as the offline engine builds it: `best_of > n` keeps the `n` best
sequences by cumulative log-probability, an aborted request's completions all end with
"abort", and beam search's result comes whole from the core (its text decoded here).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedkv.engine.core.messages import EngineCoreOutputs, EntryLogprobs, SeqFinish
from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize
from pagedkv.engine.input_processor import PreparedRequest
from pagedkv.engine.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)

OutputKind = Literal["delta", "cumulative", "final"]
OUTPUT_KINDS: tuple[str, ...] = ("delta", "cumulative", "final")


@dataclass(slots=True)
class SeqOutput:
    """One sequence as the API process knows it, and how much of it a stream has taken."""

    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False

    def text(self) -> str:
        """The text so far; while running, without a possible stop string in the making."""
        d = self.detok
        if d is None:
            return ""
        return d.text if self.finish_reason is not None else d.visible_text

    def finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        d = self.detok
        if d is not None and not d.finished:
            d.finish(reason, stop_reason)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text(), list(self.token_ids), self.cum_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            self.finish_reason, self.stop_reason,
        )


@dataclass(slots=True)
class RequestStream:
    """One request in the API process: its sequences, its state, and its stream's wake-up."""

    request_id: str
    prep: PreparedRequest
    kind: str
    event: asyncio.Event
    metrics: RequestMetrics
    seqs: dict[int, SeqOutput] = field(default_factory=dict)
    dirty: bool = False  # something new since the stream last took an output
    finished: bool = False  # the API process has everything (the core may still run it)
    core_done: bool = False  # the core has reported it finished, or was told to abort it
    aborted: bool = False
    delivered: bool = False  # the finished output was taken
    error: BaseException | None = None
    core_final: RequestOutput | None = None  # beam search: the core's result
    prompt_logprobs: list | None = None  # when asked: sent by the core once complete


class FrontendOutputs:
    """Every live request of an API process, and what each step message does to them."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._requests: dict[str, RequestStream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    # ---- requests ---------------------------------------------------------------------------
    def add(self, request_id: str, prep: PreparedRequest, kind: str,
            arrival_time: float) -> RequestStream:
        """A stream for a request about to go to the core; `ValueError` when the id is live."""
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {kind!r}")
        p = prep.params
        if kind == "delta" and (p.use_beam_search or (p.best_of or p.n) != p.n):
            raise ValueError("delta outputs need best_of == n and no beam search (their "
                             "result is known only at the end): use output_kind='final'")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        st = RequestStream(request_id, prep, kind, asyncio.Event(),
                           RequestMetrics(arrival_time=arrival_time))
        st.seqs[0] = self._new_seq(st, 0)
        self._requests[request_id] = st
        return st

    def pop(self, request_id: str) -> RequestStream | None:
        return self._requests.pop(request_id, None)

    def _new_seq(self, st: RequestStream, index: int) -> SeqOutput:
        p = st.prep.params
        detok = None
        if self.tokenizer is not None and p.detokenize and not p.use_beam_search:
            detok = IncrementalDetokenizer(self.tokenizer, st.prep.prompt_token_ids, p,
                                           eos_token_ids=self.eos_token_ids)
        return SeqOutput(index, detok, [] if p.logprobs is not None else None)

    # ---- one step message -------------------------------------------------------------------
    def process(self, msg: EngineCoreOutputs) -> list[str]:
        """Apply one step's outputs; wake the streams touched. Returns the ids of requests
        that ended here (stop strings) while the core still runs them: abort them there."""
        requests = self._requests
        now = time.time()
        lps: dict[int, EntryLogprobs] | None = None
        fins: dict[int, SeqFinish] | None = None
        if msg.logprobs:
            lps = {e.entry: e for e in msg.logprobs}
        if msg.seq_finishes:
            fins = {f.entry: f for f in msg.seq_finishes}
        touched: dict[str, RequestStream] = {}
        for rid, blob in msg.prompt_logprobs:
            st = requests.get(rid)
            if st is not None:
                st.prompt_logprobs = pickle.loads(blob)
                touched[rid] = st
        entry = -1
        for rid, index, tok in zip(msg.request_ids, msg.seq_indices, msg.token_ids):
            entry += 1
            st = requests.get(rid)
            if st is None or st.finished:
                continue
            seq = st.seqs.get(index)
            if seq is None:
                seq = st.seqs[index] = self._new_seq(st, index)
            if seq.finish_reason is None:
                self._add_token(seq, tok, lps.get(entry) if lps else None,
                                fins.get(entry) if fins else None)
            touched[rid] = st
        for fin in msg.finished:
            st = requests.get(fin.request_id)
            if st is None or st.finished:
                continue
            st.core_done = True
            st.finished = True
            st.aborted = fin.aborted
            m = st.metrics
            m.finished_time = now
            m.first_scheduled_time = fin.first_scheduled_time
            if fin.first_scheduled_time is not None:
                m.time_in_queue = fin.first_scheduled_time - fin.queued_time
            if fin.final is not None:
                st.core_final = pickle.loads(fin.final)
            reasons = {i: (r, s) for i, r, s in fin.seq_finishes}
            for seq in st.seqs.values():
                if seq.finish_reason is None:
                    r, s = reasons.get(seq.index, (None, None))
                    if fin.aborted or r is None:
                        r, s = "abort", None
                    seq.finish(r, s)
            touched[fin.request_id] = st
        for rid, why in msg.rejected:
            st = requests.get(rid)
            if st is not None and not st.finished:
                st.core_done = True
                st.error = ValueError(why)
                st.event.set()
        to_abort = []
        for st in touched.values():
            m = st.metrics
            if st.seqs[0].token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
            st.dirty = True
            if not st.core_done:
                p = st.prep.params
                if len(st.seqs) >= (p.best_of or p.n) and all(
                    s.finish_reason is not None for s in st.seqs.values()
                ):
                    # Every sequence ended here (stop strings): the request is done, and the
                    # core, which does not know, stops it.
                    st.finished = st.core_done = True
                    m.finished_time = now
                    to_abort.append(st.request_id)
            st.event.set()
        return to_abort

    @staticmethod
    def _add_token(seq: SeqOutput, tok: int, lp: EntryLogprobs | None,
                   fin: SeqFinish | None) -> None:
        seq.token_ids.append(tok)
        if lp is not None:
            seq.cum_logprob += lp.logprob
            if seq.logprobs is not None:
                seq.logprobs.append(TokenLogprobs(tok, lp.logprob, lp.rank, lp.top_token_ids,
                                                  lp.top_logprobs).to_dict())
        d = seq.detok
        if d is not None:
            d.add_tokens((tok,))
            if isinstance(d.stop_reason, str):  # a stop string: only the text knows it
                seq.finish("stop", d.stop_reason)
                return
        if fin is not None:
            seq.finish(fin.finish_reason, fin.stop_reason)

    def fail_all(self, exc: BaseException) -> None:
        """End every live stream with `exc` (the engine core died)."""
        for st in self._requests.values():
            if st.error is None and not st.delivered:
                st.error = exc
                st.core_done = True
                st.event.set()

    # ---- what a stream takes ------------------------------------------------------------------
    def take(self, st: RequestStream) -> RequestOutput | None:
        """The output a stream gets now, or None when there is nothing new (see the module
        docstring for the kinds)."""
        if not st.dirty or st.delivered:
            return None
        st.dirty = False
        kind = st.kind
        if st.finished and kind != "delta":
            st.delivered = True
            return self.final_output(st)
        if kind == "final":
            return None
        if kind == "cumulative":
            if st.prep.params.use_beam_search:
                return None
            comps = [s.completion() for _, s in sorted(st.seqs.items())]
            return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                                 False, st.metrics, prompt_logprobs=st.prompt_logprobs)
        comps = []
        for _, s in sorted(st.seqs.items()) if len(st.seqs) > 1 else st.seqs.items():
            text = s.text()
            n_tok = len(s.token_ids)
            if (n_tok == s.sent_tokens and len(text) == s.sent_text
                    and (s.finish_reason is None or s.sent_finish)):
                continue
            lps = None
            if s.logprobs is not None:
                lps = s.logprobs[s.sent_logprobs:]
                s.sent_logprobs = len(s.logprobs)
            comps.append(CompletionOutput(
                s.index, text[s.sent_text:], s.token_ids[s.sent_tokens:], s.cum_logprob, lps,
                s.finish_reason, s.stop_reason,
            ))
            s.sent_tokens = n_tok
            s.sent_text = len(text)
            s.sent_finish = s.finish_reason is not None
        if st.finished:
            st.delivered = True
            if st.aborted:
                for c in comps:
                    c.finish_reason = "abort"
        elif not comps:
            return None
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                             st.finished, st.metrics, prompt_logprobs=st.prompt_logprobs)

    def final_output(self, st: RequestStream) -> RequestOutput:
        """The finished request's output, as the offline engine gives it."""
        p = st.prep.params
        core = st.core_final
        if p.use_beam_search and core is not None:
            if p.detokenize and self.tokenizer is not None:
                for c in core.outputs:
                    c.text = detokenize(self.tokenizer, st.prep.prompt_token_ids, c.token_ids, p,
                                        eos_token_ids=self.eos_token_ids).text
            core.prompt = st.prep.prompt
            core.metrics = st.metrics
            core.prompt_logprobs = st.prompt_logprobs
            return core
        comps = [s.completion() for _, s in sorted(st.seqs.items())]
        if st.aborted:
            for c in comps:
                c.finish_reason = "abort"
        if (p.best_of or p.n) > p.n and not p.use_beam_search:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            comps = comps[: p.n]
            for i, c in enumerate(comps):
                c.index = i
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps, True,
                             st.metrics, prompt_logprobs=st.prompt_logprobs)
