"""Sampling as the runner does it: from one step's logits to a `RunnerOutput`.

Each scheduled sequence's request carries its `RequestSampling` (attached by the engine when it
queued the request; the scheduler never reads it). A batch in which every sampling sequence is
plain greedy takes the throughput path: one argmax on the device, one copy of the ids to the
host. A batch of greedy requests some of which mask tokens (structured output at temperature
0) masks just those rows, then takes the same argmax. Any other batch builds a `SamplingBatch`
(token masks, logit bias, temperature,
top-k/p, penalties, logprobs, seeds, beam candidates) for the `Sampler`. The token bitmask
(grammars, allowed_token_ids, bad_words: `token_masks.TokenMasks`) is computed first, on the
host, before anything waits for the device: on a GPU that overlaps the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.outputs import RunnerOutput
from pagedkv.engine.structured.bitmask import apply_token_bitmask
from pagedkv.engine.worker.sampler import Sampler, SamplingBatch, SamplingRow
from pagedkv.engine.worker.staging import to_device
from pagedkv.engine.worker.token_masks import TokenMasks


def _plain_greedy(seq) -> bool:
    return seq.group.sampling.argmax_only


def _greedy(seq) -> bool:
    rs = seq.group.sampling
    return rs.argmax_only or rs.masked_argmax


class BatchSampler:
    """Samples the rows of a step: `sample(seqs, positions, logits) -> RunnerOutput`."""

    def __init__(self, device: torch.device, eos_token_ids: Sequence[int], seed: int,
                 vocab_size: int | None = None) -> None:
        self.sampler = Sampler()
        self.masks = TokenMasks(vocab_size, pin=device.type == "cuda") if vocab_size else None
        self.eos_token_ids = list(eos_token_ids)
        # Shared by unseeded rows; seeded rows draw from their own seed (see the sampler).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @staticmethod
    def all_plain_greedy(seqs: Sequence) -> bool:
        """Whether every sequence's request is plain greedy (an argmax is all it needs)."""
        return all(map(_plain_greedy, seqs))

    @staticmethod
    def argmax_output(seqs: Sequence, tokens: list[int]) -> RunnerOutput:
        return RunnerOutput({s.seq_id: [t] for s, t in zip(seqs, tokens)})

    def masked_argmax(self, seqs: Sequence, logits: torch.Tensor, masks: TokenMasks
                      ) -> RunnerOutput:
        """Greedy rows, some under token masks: one argmax over every row, and one over the
        masked rows only (their bitmask built on the host while the forward pass runs, then
        unpacked for those rows alone) which replaces theirs. The same tokens as the sampler's
        greedy path, without a sampling batch."""
        ids = logits.argmax(dim=-1)
        self._mask_rows(seqs, logits, ids, masks)
        return self.argmax_output(seqs, ids.tolist())

    def mask_argmax_rows(self, seqs: Sequence, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Replace, in the argmax `ids` of `logits`, those of the rows under token masks by
        their masked argmax (asynchronous scheduling: `InFlightStep.finish`)."""
        self._mask_rows(seqs, logits, ids, self._masks_for(logits))

    def _masks_for(self, logits: torch.Tensor) -> TokenMasks:
        """The bitmask builder for `logits`' vocabulary (made again if it changed)."""
        masks = self.masks
        if masks is None or masks.vocab_size != logits.shape[1]:
            masks = self.masks = TokenMasks(logits.shape[1], pin=logits.is_cuda)
        return masks

    @staticmethod
    def _mask_rows(seqs: Sequence, logits: torch.Tensor, ids: torch.Tensor, masks: TokenMasks
                   ) -> None:
        built = masks.build_masked_rows(seqs)
        if built is None:
            return
        rows, bitmask = built
        index = to_device(rows, logits.device)
        sub = logits.index_select(0, index)
        apply_token_bitmask(sub, bitmask.to(logits.device, non_blocking=True))
        ids.index_copy_(0, index, sub.argmax(dim=-1))

    def sample(self, seqs: Sequence, positions: Sequence[int], logits: torch.Tensor) -> RunnerOutput:
        """`seqs[i]` (a scheduler `Sequence`) samples the token at `positions[i]` from
        `logits[i]`."""
        if self.all_plain_greedy(seqs):
            return self.argmax_output(seqs, logits.argmax(dim=-1).tolist())
        masks = self._masks_for(logits)
        if all(map(_greedy, seqs)):
            return self.masked_argmax(seqs, logits, masks)
        bitmask = masks.build(seqs)
        rows: list[SamplingRow] = []
        for s, pos in zip(seqs, positions):
            p = s.group.sampling.params
            num = 1
            if p.best_of > 1 and not p.use_beam_search and s.num_output_tokens == 0:
                num = p.best_of  # the first token: best_of of them, the scheduler forks
            rows.append(SamplingRow(
                p, s.group.prompt_token_ids,
                s.token_ids[s.prompt_len:] if p.needs_penalties else (),
                num, s.index, pos,
            ))
        batch = SamplingBatch(rows, vocab_size=logits.shape[1], device=logits.device,
                              eos_token_ids=self.eos_token_ids, generator=self.generator,
                              token_bitmask=bitmask)
        result = RunnerOutput({})
        for s, rs in zip(seqs, self.sampler(logits, batch).rows):
            if rs.beam_token_ids is not None:
                if result.beam_candidates is None:
                    result.beam_candidates = {}
                result.beam_candidates[s.seq_id] = (rs.beam_token_ids, rs.beam_logprobs)
                continue
            result.sampled_token_ids[s.seq_id] = rs.token_ids
            if rs.logprobs is not None:
                if result.logprobs is None:
                    result.logprobs = {}
                result.logprobs[s.seq_id] = rs.logprobs
        return result
