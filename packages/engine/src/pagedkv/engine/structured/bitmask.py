"""Token bitmasks: which tokens a row may take, 32 tokens per int32 word.

Row `i` of a bitmask `[rows, ceil(V / 32)]` allows token `t` when bit `t % 32` of word
`t // 32` is set (llguidance's and xgrammar's layout). A whole batch's masks are one tensor,
applied to the logits with one `masked_fill_` (`apply_token_bitmask`); -1 (every bit set)
allows everything, so unconstrained rows of a mixed batch are left exactly as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def bitmask_width(vocab_size: int) -> int:
    """Words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def _signed32(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def full_bitmask(rows: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor:
    """A host bitmask that allows every token in every row."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def tokens_to_bitmask(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One row `[ceil(V / 32)]` allowing exactly `token_ids`."""
    width = bitmask_width(vocab_size)
    bits = torch.zeros(width * 32, dtype=torch.int64)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    bits[ids] = 1
    words = (bits.view(width, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def ban_tokens(row: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Clear the bits of `token_ids` in one bitmask row, in place."""
    for t in token_ids:
        w = t >> 5
        row[w] = _signed32(int(row[w]) & ~(1 << (t & 31)))


def allow_only_tokens(row: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Set one bitmask row to allow exactly `token_ids`, in place."""
    row.zero_()
    for t in token_ids:
        w = t >> 5
        row[w] = _signed32(int(row[w]) | (1 << (t & 31)))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool `[rows, V]`: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place (`bitmask` on the logits' device,
    one row per logits row)."""
    if bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))
