"""Batched logits transforms used by the sampler, one function per rule, in vLLM's order:
min_tokens mask, repetition penalty, frequency and presence penalties, temperature, top-k,
top-p, min-p.

Each function takes logits `[N, V]` float32 and per-row parameter tensors on the same device,
works in place where it can (and returns the tensor it wrote), and never reads values back to
the host, so a step's sampling runs without host synchronisation. A row whose parameter says
"off" (top_k >= V, top_p >= 1, min_p == 0, penalties neutral) is left exactly unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch


@dataclass(slots=True)
class PenaltyPairs:
    """The (row, token) pairs that penalties touch, with their output counts (host tensors).

    `keys[j] = row * V + token` for every distinct token a row has seen (prompt or output),
    sorted; `rows[j]` is that row; `output_counts[j]` is how often the token occurs in the
    row's output (0 if only in the prompt). Penalties then cost O(tokens seen), not O(rows x V).
    """

    keys: torch.Tensor  # long [P]
    rows: torch.Tensor  # long [P]
    output_counts: torch.Tensor  # float32 [P]


def penalty_pairs(
    rows: Sequence[int],
    prompt_lists: Sequence[Sequence[int]],
    output_lists: Sequence[Sequence[int]],
    vocab_size: int,
) -> PenaltyPairs:
    """Distinct seen tokens per row and their output counts, computed with torch on the host."""

    def keys_of(lists: Sequence[Sequence[int]]) -> torch.Tensor:
        lengths = [len(t) for t in lists]
        if sum(lengths) == 0:
            return torch.empty(0, dtype=torch.long)
        flat = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
        if int(flat.min()) < 0 or int(flat.max()) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}) for the penalties")
        row_ids = torch.repeat_interleave(
            torch.tensor(list(rows), dtype=torch.long), torch.tensor(lengths)
        )
        return row_ids * vocab_size + flat

    out_keys, out_counts = torch.unique(keys_of(output_lists), return_counts=True)
    keys = torch.unique(torch.cat([keys_of(prompt_lists), out_keys]))
    counts = torch.zeros(keys.shape[0], dtype=torch.float32)
    if out_keys.numel():
        counts[torch.searchsorted(keys, out_keys)] = out_counts.to(torch.float32)
    return PenaltyPairs(keys, keys // vocab_size, counts)


def apply_penalties(
    logits: torch.Tensor,
    keys: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM/CTRL penalties on the (row, token) pairs `keys` (row * V + token), in place.

    Per pair (penalties are the pair's row's): repetition (tokens seen in prompt or output):
    a positive logit is divided by the penalty, a negative one multiplied; frequency: subtract
    penalty x output count; presence: subtract the penalty once if the token is in the output.
    """
    flat = logits.view(-1)
    vals = flat.index_select(0, keys)
    vals = torch.where(vals > 0, vals / repetition_penalties, vals * repetition_penalties)
    vals = vals - frequency_penalties * output_counts
    vals = vals - presence_penalties * (output_counts > 0).to(vals.dtype)
    flat.index_copy_(0, keys, vals)
    return logits


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (greedy rows pass 1.0), in place."""
    return logits.div_(temperatures.unsqueeze(1))


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None
) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (and any tied with the k-th), mask the rest to -inf.

    `top_k` is long `[N]`; a value >= V keeps the row unchanged. `max_k`, the batch's largest
    k as a host int (the caller knows it from the parameters, so no sync), lets `torch.topk`
    look at only that many values instead of sorting the vocabulary.
    """
    vocab = logits.shape[-1]
    max_k = vocab if max_k is None else max(1, min(int(max_k), vocab))
    top_values = torch.topk(logits, max_k, dim=-1, sorted=True).values  # [N, max_k] descending
    kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1).unsqueeze(1))  # [N, 1]
    keep_all = (top_k >= vocab).unsqueeze(1)
    return logits.masked_fill_((logits < kth) & ~keep_all, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    num_candidates: int | None = None,
) -> torch.Tensor:
    """Top-k, then top-p (nucleus) on the top-k-renormalised distribution.

    Top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (a token is dropped when the mass of the tokens ranked above it is already >= top_p);
    the most likely token is always kept. `top_p >= 1` keeps everything.

    By default one full sort does it (the right thing on a GPU). With `num_candidates`
    (meant for the CPU, where sorting the vocabulary is slow and reading a flag back is free),
    only the best `num_candidates` logits of each row are sorted, via `torch.topk`; a row
    whose nucleus does not close within them (a very flat distribution) falls back to the
    sort. It must be >= every row's top_k that is below V.
    """
    vocab = logits.shape[-1]
    if num_candidates is None or num_candidates >= vocab or logits.shape[0] == 0:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    p = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p)
    top_vals = torch.topk(logits, num_candidates, dim=-1, sorted=True).values
    k = top_k.clamp(1, vocab)
    k_inside = k <= num_candidates
    kth = top_vals.gather(1, (k.clamp(max=num_candidates) - 1).unsqueeze(1))
    masked = top_vals.masked_fill(k_inside.unsqueeze(1) & (top_vals < kth), float("-inf"))
    # Probabilities under the top-k-renormalised distribution: normalised over the
    # candidates when top-k cuts inside them, over the whole row otherwise.
    z = torch.where(k_inside, torch.logsumexp(masked, dim=-1), torch.logsumexp(logits, dim=-1))
    probs = (masked - z.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    keep = (cum - probs) < p.unsqueeze(1)
    keep[:, 0] = True
    keep &= masked > float("-inf")
    # Kept candidates form a prefix; the last one's logit is the row's threshold.
    threshold = top_vals.gather(1, keep.sum(dim=-1, keepdim=True).sub_(1))
    resolved = k_inside | (cum[:, -1] >= p)
    logits.masked_fill_((logits < threshold) & resolved.unsqueeze(1), float("-inf"))
    unresolved = (~resolved).nonzero().squeeze(1)
    if unresolved.numel():
        sub = logits.index_select(0, unresolved)
        _top_k_top_p_sorted(
            sub, top_k.index_select(0, unresolved), top_p.index_select(0, unresolved)
        )
        logits.index_copy_(0, unresolved, sub)
    return logits


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = top_k.clamp(1, vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    p = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p).unsqueeze(1)
    drop = mass_before >= p
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` x the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))
