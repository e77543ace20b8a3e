"""Grammar matchers on llguidance: one per sequence, advanced by the tokens it takes.

`GrammarBackend` (one per engine) holds llguidance's view of the model's tokenizer, built once
(about a second) the first time a request asks for structured output. `backend.request(params)`
checks the grammar against that tokenizer and returns a `StructuredRequest`, which lives as long
as the request (on its `RequestSampling`) and keeps one matcher per sequence, keyed by sequence
id:

* a matcher is advanced lazily, just before its sequence's next mask is computed, by the tokens
  the sequence took since: whatever happened in between (a step, a preemption by recompute or
  swap, which leave the tokens as they were) the matcher is exactly as far as the tokens;
* a sequence seen for the first time (a fork: parallel sampling's siblings, a beam) starts from
  a copy of the sibling whose tokens share the longest prefix with its own, rolled back to that
  prefix, then advanced by the rest: forks copy the state, nothing is replayed from the start.

Why llguidance (not xgrammar or outlines-core): see the engine README's measured table; in
short, the lowest per-token mask + accept cost of the three on the embedded model's 49k
vocabulary for JSON schemas and regexes, grammars compiled lazily in about a millisecond
(xgrammar and outlines-core spend 0.3-1.2 s per new schema), and a single wheel with no Python
dependencies.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.structured.bitmask import allow_only_tokens
from pagedkv.engine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarBackend:
    """llguidance's tokenizer for one model (built on first use) and a thread pool for masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        if hf_tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer, and this engine runs without one "
                "(--skip-tokenizer-init)"
            )
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # the server prepares requests from several threads

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            with self._lock:
                if self._ll_tokenizer is None:
                    import llguidance.hf

                    # The tokenizer may be smaller than the model's vocabulary (a benchmark
                    # model with another tokenizer): llguidance takes the EOS ids it knows.
                    size = len(self.hf_tokenizer)
                    eos = [t for t in self.eos_token_ids if t < size] or None
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos,
                    )
        return self._ll_tokenizer

    def request(self, params: StructuredOutputsParams) -> StructuredRequest:
        """A request's grammar state; raises `ValueError` when the grammar does not fit this
        tokenizer."""
        import llguidance

        tok = self.ll_tokenizer
        err = llguidance.LLMatcher.validate_grammar(params.grammar_text, tok)
        if err:
            raise ValueError(f"structured outputs: bad {params.kind}: {err.strip()}")
        root = llguidance.LLMatcher(tok, params.grammar_text)
        if root.is_error():
            raise ValueError(f"structured outputs: bad {params.kind}: {root.get_error()}")
        return StructuredRequest(root, self.eos_token_ids)


@dataclass(slots=True)
class _SeqMatcher:
    seq: Any  # the scheduler's Sequence
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # output tokens seen
    fed: int = 0  # of those, how many the matcher took (it stops taking once complete)


class StructuredRequest:
    """One request's grammar and the matcher of each of its sequences (see the module doc)."""

    def __init__(self, root: Any, eos_token_ids: list[int]) -> None:
        self._root = root  # the grammar's start state, never advanced
        self.eos_token_ids = eos_token_ids
        self._seqs: dict[int, _SeqMatcher] = {}

    def matcher(self, seq) -> Any:
        """`seq`'s matcher, advanced by every token `seq` took so far."""
        sm = self._seqs.get(seq.seq_id)
        if sm is None:
            sm = self._seqs[seq.seq_id] = self._fork_for(seq)
        toks = seq.token_ids
        start = seq.prompt_len + sm.consumed
        if len(toks) > start:
            m = sm.matcher
            if sm.fed == sm.consumed:
                for t in toks[start:]:
                    if m.is_stopped() or m.is_error():
                        break  # complete (only EOS was allowed) or broken: nothing to follow
                    sm.fed += 1
                    if not m.consume_token(t):
                        logger.warning("sequence %d took token %d its grammar refused: %s",
                                       seq.seq_id, t, m.get_error())
            sm.consumed = len(toks) - seq.prompt_len
        return sm.matcher

    def _fork_for(self, seq) -> _SeqMatcher:
        pl = seq.prompt_len
        mine = seq.token_ids
        best, best_lcp = None, -1
        for sm in self._seqs.values():
            other = sm.seq
            lcp = 0
            n = min(sm.consumed, len(mine) - pl)
            theirs = other.token_ids
            while lcp < n and theirs[pl + lcp] == mine[pl + lcp]:
                lcp += 1
            if lcp > best_lcp:
                best, best_lcp = sm, lcp
        if best is None:
            return _SeqMatcher(seq, self._root.deep_copy())
        m = best.matcher.deep_copy()
        back = max(0, best.fed - best_lcp)
        if back:
            m.rollback(back)
        # Finished sequences (pruned beams, stopped samples) are no longer needed as sources.
        for sid in [sid for sid, sm in self._seqs.items() if sm.seq.is_finished]:
            del self._seqs[sid]
        return _SeqMatcher(seq, m, best_lcp, min(best.fed, best_lcp))

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a host bitmask: the tokens `matcher` allows next (only EOS when the
        grammar is complete or the matcher broke)."""
        import llguidance.torch

        if matcher.is_error() or matcher.is_stopped():
            allow_only_tokens(bitmask[row], self.eos_token_ids)
            return
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)


def fill_bitmask_rows(executor: Any, jobs: list[tuple[StructuredRequest, Any, int]],
                      bitmask: torch.Tensor) -> None:
    """Fill the rows of several matchers: (request, matcher, row) each. With more than one,
    llguidance computes them on its own threads (without the GIL)."""
    import llguidance.torch

    par = []
    for req, m, row in jobs:
        if m.is_error() or m.is_stopped() or len(jobs) == 1:
            req.fill(m, bitmask, row)
        else:
            par.append((m, row))
    if par:
        llguidance.torch.fill_next_token_bitmask_par(executor, par, bitmask)
