"""Incremental detokenization and stop checks for one sequence.

Text is produced token by token with the prefix-offset / read-offset technique: decode a small
window of recent token ids twice (without and with the new tokens) and emit the difference, so
that tokenizers whose pieces depend on their neighbours (SentencePiece's leading space,
byte-level BPE) give exactly the text a full decode gives. A token that ends in the middle of a
UTF-8 character decodes to U+FFFD; such a window is not emitted until a later token completes
the character.

Stop conditions are checked per token, in vLLM's order: nothing before `min_tokens` tokens;
then EOS (unless `ignore_eos`) and `stop_token_ids` (their text is left out unless
`include_stop_str_in_output`); then stop strings, which may span tokens and are cut exactly
(the text ends right before the stop string, or right after it with
`include_stop_str_in_output`); then `max_tokens`. While streaming, the end of the text that
could still become a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.engine.outputs import FINISH_LENGTH, FINISH_STOP, PositionLogprobs
from pagedkv.engine.sampling_params import SamplingParams

#: Prompt tokens kept as decoding context for the first generated tokens.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"
# Drop consumed ids from the window list once this many have piled up.
_TRIM_AT = 256


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, deltas and a stop decision.

    `add_tokens(new_ids) -> (delta, stop_reason)`: `delta` is the newly visible text (safe to
    stream), `stop_reason` is what ended the sequence in this call (a stop string, a stop
    token id, or None for EOS / length / still running; see `finished` and `finish_reason`).
    Tokens passed after the sequence finished are ignored. `eos_token_ids` are the model's EOS
    ids (ignored with `ignore_eos`). With `params.detokenize=False` no text is produced and only
    the token-based checks run.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        eos = {int(t) for t in eos_token_ids}
        self._eos_ids = set() if params.ignore_eos else eos
        self._stop_ids = set(params.stop_token_ids or ())
        self._stop_strs: list[str] = list(params.stop or ()) if params.detokenize else []
        self._hold_back = bool(self._stop_strs) and not params.include_stop_str_in_output
        tail = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.output_token_ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    # ---- public ---------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """All output text so far (cut at a stop string), including any held-back end."""
        return self._text

    @property
    def visible_text(self) -> str:
        """The text that is safe to show now: `text` minus a possible partial stop string."""
        return self._text[: self._emitted]

    def add_tokens(self, new_token_ids: Iterable[int]) -> tuple[str, int | str | None]:
        was_finished = self.finished
        for tid in new_token_ids:
            if self.finished:
                break
            self._add_one(int(tid))
        return self._advance_visible(), (None if was_finished else self.stop_reason)

    def flush(self) -> str:
        """End the sequence from outside (context full, abort): emit everything held back."""
        if not self.finished:
            self._text += self._flush_pending()
            self.finished = True
        return self._advance_visible()

    def finish(self, finish_reason: str, stop_reason: int | str | None = None) -> str:
        """Mark finished for a reason decided elsewhere; returns the last delta."""
        delta = self.flush()
        if self.finish_reason is None:
            self.finish_reason = finish_reason
            self.stop_reason = stop_reason
        return delta

    def clone(self) -> IncrementalDetokenizer:
        """An independent copy (for a forked sequence); the tokenizer is shared."""
        new = copy.copy(self)
        new._ids = list(self._ids)
        new.output_token_ids = list(self.output_token_ids)
        new._stop_strs = list(self._stop_strs)
        return new

    def decode_logprobs(self, positions: Iterable[PositionLogprobs | None]) -> None:
        """Fill `decoded_token` of every `Logprob` with its token's own text."""
        for pos in positions:
            if not pos:
                continue
            for tid, lp in pos.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)

    # ---- internals ------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_next(self, tid: int) -> str:
        """Append one id to the window; return the text it completes (maybe "")."""
        if not self.params.detokenize:
            return ""
        self._ids.append(tid)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset > _TRIM_AT:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return new_text[len(prefix_text) :]
        return ""

    def _flush_pending(self) -> str:
        """Text of ids not yet emitted (e.g. an incomplete character at the very end)."""
        if not self.params.detokenize or self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _add_one(self, tid: int) -> None:
        p = self.params
        self.output_token_ids.append(tid)
        n = len(self.output_token_ids)
        checks = n >= p.min_tokens
        if checks and (tid in self._eos_ids or tid in self._stop_ids):
            if p.include_stop_str_in_output:
                self._text += self._decode_next(tid)
                self._text += self._flush_pending()
            else:
                self._text += self._flush_pending()
            self._finish(FINISH_STOP, None if tid in self._eos_ids else tid)
            return
        delta = self._decode_next(tid)
        self._text += delta
        if checks and delta and self._stop_strs and self._check_stop_strings(len(delta)):
            return
        if p.max_tokens is not None and n >= p.max_tokens:
            self._text += self._flush_pending()
            self._finish(FINISH_LENGTH, None)

    def _check_stop_strings(self, new_chars: int) -> bool:
        """Find the stop string completed first among those ending in the newest `new_chars`
        characters (earliest end, then earliest start), as if text arrived one character at a
        time: the cut does not depend on how the text was split into tokens."""
        text = self._text
        best: tuple[int, int, str] | None = None
        for s in self._stop_strs:
            start = max(0, len(text) - new_chars - len(s) + 1)
            idx = text.find(s, start)
            if idx != -1:
                cand = (idx + len(s), idx, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return False
        _, idx, s = best
        cut = idx + len(s) if self.params.include_stop_str_in_output else idx
        # Never cut into text already streamed (holding back makes this a no-op guard).
        self._text = text[: max(cut, self._emitted)]
        self._finish(FINISH_STOP, s)
        return True

    def _held_back(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        text = self._text
        hold = 0
        for s in self._stop_strs:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _advance_visible(self) -> str:
        if self.finished or not self._hold_back:
            visible = len(self._text)
        else:
            visible = len(self._text) - self._held_back()
        if visible <= self._emitted:
            return ""
        delta = self._text[self._emitted : visible]
        self._emitted = visible
        return delta


def detokenize(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_ids: Iterable[int] = (),
) -> IncrementalDetokenizer:
    """Detokenize a whole finished sequence at once (e.g. a beam-search hypothesis)."""
    d = IncrementalDetokenizer(tokenizer, prompt_token_ids, params, eos_token_ids=eos_token_ids)
    d.add_tokens(output_token_ids)
    if not d.finished:
        d.flush()
    return d
