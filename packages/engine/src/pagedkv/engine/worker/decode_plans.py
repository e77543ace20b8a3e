"""Decode attention plans for the model's layers.

On a GPU a decode step's attention runs by a plan (``pagedattn_kernels.plan_decode``): the
host, which knows every context length, cuts the long contexts into chunks balanced over the
batch so that no program walks many more tiles than the rest, and lists the chunks longest
first. All layers of a model share the plan: one KV head count, head dim and cache dtype.

The plan replaces the longest-first order (``inputs.longest_first``) where it pays
(``pagedattn_kernels.decode_plan_pays``: it is measured per cache dtype and batch size); elsewhere
the decode kernel keeps its automatic splits and the order. ``PAGEDKV_DECODE_PLAN=0`` (read at
import) turns plans off, for A/B runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

import pagedattn_kernels

#: Whether decode attention on a GPU runs by plans where they pay.
DECODE_PLAN = os.environ.get("PAGEDKV_DECODE_PLAN", "1") != "0"


class DecodePlanner:
    """Plans for one model's decode attention: its per-rank KV heads, head dim, query and
    cache dtypes, on its device."""

    def __init__(self, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.spec = {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype,
                     "kv_dtype": kv_dtype, "device": device}  # fmt: skip

    @classmethod
    def for_caches(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   dtype: torch.dtype) -> DecodePlanner | None:  # fmt: skip
        """The planner of a model with these layer caches (``[blocks, block_size, kv_heads,
        head_dim]``) and query dtype; None off a CUDA device or with plans off."""
        key_cache = kv_caches[0][0]
        if not DECODE_PLAN or key_cache.device.type != "cuda":
            return None
        return cls(num_kv_heads=key_cache.shape[2], head_dim=key_cache.shape[3], dtype=dtype,
                   kv_dtype=key_cache.dtype, device=key_cache.device)  # fmt: skip

    def pays(self, num_seqs: int) -> bool:
        """Whether a decode batch of ``num_seqs`` rows runs by a plan."""
        spec = self.spec
        return num_seqs > 0 and pagedattn_kernels.decode_plan_pays(
            num_seqs, num_kv_heads=spec["num_kv_heads"], kv_dtype=spec["kv_dtype"]
        )

    def plan(self, seq_lens: Sequence[int] | np.ndarray | torch.Tensor,
             padded: bool = False) -> pagedattn_kernels.DecodePlan:  # fmt: skip
        """The host plan of rows with these context lengths (0: a padding row); ``padded``:
        sized to the most any plan of that many rows needs (a CUDA graph's buffers)."""
        return pagedattn_kernels.plan_decode(seq_lens, padded=padded, **self.spec)
