"""A step's token bitmask, built on the host while the forward pass runs.

Rows whose request masks tokens (`RequestSampling.needs_token_mask`: a grammar,
`allowed_token_ids`, `bad_words`) get their row of one `[rows, ceil(V / 32)]` int32 bitmask;
every other row allows everything (-1). Per masked row: the grammar's next allowed tokens
(llguidance, several rows at once on its own threads, without the GIL), AND the request's
`allowed_token_ids` row, minus the last token of each bad word whose other tokens end the
sequence's output (vLLM's rule). The sampler applies the whole tensor with one op.

The runner calls `build` after launching the forward pass and before anything waits for the
device, so on a GPU the host computes the masks while the model runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pagedkv.engine.structured.bitmask import ban_tokens, bitmask_width


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], seq) -> Iterator[int]:
    """The tokens `seq` may not take next: each bad word's last token, when the word's other
    tokens are the last tokens of `seq`'s output (a one-token word is always banned)."""
    toks = seq.token_ids
    n_out = len(toks) - seq.prompt_len
    end = len(toks)
    for word in bad_words:
        k = len(word) - 1
        if k > n_out:
            continue
        if k == 0 or all(toks[end - k + j] == word[j] for j in range(k)):
            yield word[-1]


class TokenMasks:
    """Builds each step's bitmask into a reused host buffer (pinned on a GPU)."""

    def __init__(self, vocab_size: int, pin: bool) -> None:
        self.vocab_size = vocab_size
        self.pin = pin
        self._buffer: torch.Tensor | None = None
        self._executor = None  # llguidance's thread pool, made on first use

    def _rows(self, n: int) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.shape[0] < n:
            # The previous step's copy to the device is done: the sampler waited for its
            # results before this step started.
            buf = torch.empty((max(n, 16), bitmask_width(self.vocab_size)), dtype=torch.int32,
                              pin_memory=self.pin)
            self._buffer = buf
        view = buf[:n]
        view.fill_(-1)
        return view

    def build(self, seqs: Sequence) -> torch.Tensor | None:
        """The bitmask of the sampling rows `seqs` (scheduler sequences), or None when no row
        masks anything."""
        masked = self._masked(seqs)
        if not masked:
            return None
        bitmask = self._rows(len(seqs))
        self._fill(masked, bitmask, [i for i, _, _ in masked])
        return bitmask

    def build_masked_rows(self, seqs: Sequence) -> tuple[list[int], torch.Tensor] | None:
        """Only the rows that mask something: their indices in `seqs` and their bitmask
        `[len(indices), ceil(V / 32)]`, or None when no row masks anything."""
        masked = self._masked(seqs)
        if not masked:
            return None
        bitmask = self._rows(len(masked))
        self._fill(masked, bitmask, range(len(masked)))
        return [i for i, _, _ in masked], bitmask

    @staticmethod
    def _masked(seqs: Sequence) -> list:
        return [(i, s, s.group.sampling) for i, s in enumerate(seqs)
                if s.group.sampling.needs_token_mask]

    def _fill(self, masked: list, bitmask: torch.Tensor, rows) -> None:
        """Row `rows[k]` of `bitmask` (all allowed on entry) gets the mask of `masked[k]`."""
        jobs = [(rs.structured, rs.structured.matcher(s), r)
                for r, (_, s, rs) in zip(rows, masked) if rs.structured is not None]
        if jobs:
            from pagedkv.engine.structured.matchers import fill_bitmask_rows

            if self._executor is None and len(jobs) > 1:
                import llguidance

                self._executor = llguidance.LLExecutor()
            fill_bitmask_rows(self._executor, jobs, bitmask)
        for r, (_, s, rs) in zip(rows, masked):
            if rs.allowed_bitmask is not None:
                bitmask[r].bitwise_and_(rs.allowed_bitmask)
            if rs.bad_words_token_ids:
                ban_tokens(bitmask[r], banned_by_bad_words(rs.bad_words_token_ids, s))
