"""The attention ops: causal paged attention over a mixed batch of prefill chunks and decode
tokens, and paged decode attention (flash-decoding on the GPU).

Each op checks its inputs (``checks``), then runs the implementation that fits the tensors'
device (``pagedattn_kernels.common.resolve_backend``): the Triton kernels (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``). ``reference`` holds the float64
definitions they are tested against. Public through ``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.attention import torch_impl, triton_launch
from pagedattn_kernels.attention.checks import (
    check_attention,
    check_new_kv,
    check_triton_attention,
)
from pagedattn_kernels.attention.plan import DecodePlan
from pagedattn_kernels.common import check_kv_scales, fail, resolve_backend

__all__ = ["paged_attention", "paged_decode_attention"]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention for a packed, mixed batch of prefill chunks and decode tokens.

    Sequence i owns query rows ``cu_query_lens[i]:cu_query_lens[i+1]``: the last q_len_i
    tokens of its ``seq_lens[i]``-token context, whose K/V are already in the cache. The token
    at context position p sees keys 0..p. Returns ``out`` (allocated when None).
    With ``max_query_len == 1`` (all decode) the flash-decoding kernel runs instead.
    fp8 caches: keys read as ``fp8 * k_scale``, values as ``fp8 * v_scale`` (float32 tensors
    of one element; None = 1.0); the query and ``out`` keep their float dtype.

    ``key``/``value`` (optional, ``[num_tokens, num_kv_heads, head_dim]``, row for row with
    ``query``): the keys and values of the query tokens themselves, as just written to the
    caches (so of the caches' dtype: not for fp8 caches). Given them, the Triton kernel reads
    each chunk's own keys from these contiguous rows, through TMA on Hopper, and only the
    earlier context through the block table: the same result, faster (the gather is what
    kept the kernel at 0.67x cuDNN on an H200). The torch path ignores them.
    """
    op = "paged_attention"
    check_attention(
        op, query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, out,
        scale, max_query_len, max_seq_len,
    )  # fmt: skip
    check_kv_scales(op, key_cache, k_scale, v_scale)
    if key is not None or value is not None:
        check_new_kv(op, query, key_cache, key, value)
    scale = float(scale) if scale is not None else query.shape[2] ** -0.5
    if out is None:
        out = torch.empty_like(query)
    if resolve_backend(key_cache.device, backend) == "torch":
        return torch_impl.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, out,
            k_scale, v_scale,
        )  # fmt: skip
    check_triton_attention(op, query, key_cache, value_cache, out)
    query = query if query.stride(-1) == 1 else query.contiguous()
    if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
        return triton_launch.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return triton_launch.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, out,
        k_scale=k_scale, v_scale=v_scale, key=key, value=value,
    )  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
    seq_order: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query token per sequence (``query [num_seqs, num_heads, head_dim]``) attending its
    whole context of ``seq_lens[i]`` tokens. On the GPU, long contexts are split over several
    programs (flash-decoding) and merged; ``num_splits`` overrides the automatic choice
    (Triton backend only). A sequence of length 0 (batch padding) gets zeros.
    ``seq_order`` (int32 ``[num_seqs]``, a permutation of the rows, e.g. longest context
    first): the order in which the Triton kernel starts the sequences' programs, a schedule
    that leaves the output unchanged (``triton_launch.paged_decode_attention`` says why);
    checked to be a permutation on the CPU only (on a GPU that would wait for the device).
    ``plan`` (from :func:`plan_decode` for these rows, moved to the query's device): which
    program attends which chunk of which row, balanced over the batch's real context lengths;
    it takes the place of the split count and ``seq_order`` (Triton backend; the torch path
    has no programs to plan and ignores it).
    fp8 caches: ``k_scale`` / ``v_scale`` as in :func:`paged_attention`.
    """
    op = "paged_decode_attention"
    check_attention(
        op, query, key_cache, value_cache, block_tables, seq_lens, None, out,
        scale, None, max_seq_len,
    )  # fmt: skip
    check_kv_scales(op, key_cache, k_scale, v_scale)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise fail(op, f"num_splits must be a positive int, got {num_splits!r}")
    if seq_order is not None:
        _check_order(op, seq_order, query)
    if plan is not None:
        _check_plan(op, plan, query, num_splits, seq_order)
    scale = float(scale) if scale is not None else query.shape[2] ** -0.5
    if out is None:
        out = torch.empty_like(query)
    if resolve_backend(key_cache.device, backend) == "torch":
        return torch_impl.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out, k_scale, v_scale
        )
    check_triton_attention(op, query, key_cache, value_cache, out)
    query = query if query.stride(-1) == 1 else query.contiguous()
    return triton_launch.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out,
        num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, seq_order=seq_order, plan=plan,
    )  # fmt: skip


def _check_plan(op: str, plan: DecodePlan, query: torch.Tensor, num_splits: int | None,
                seq_order: torch.Tensor | None) -> None:  # fmt: skip
    """A plan's tensors: int32, contiguous, on the query's device, of the right widths; and
    no split count or order beside it. (Their contents are the planner's: checking them
    would read the device.)"""
    if not isinstance(plan, DecodePlan):
        raise fail(op, f"plan must be a DecodePlan, got {type(plan).__name__}")
    if num_splits is not None or seq_order is not None:
        raise fail(op, "a plan decides the splits and the order: pass neither num_splits nor "
                       "seq_order with it")  # fmt: skip
    for name, t, width in (("work", plan.work, 4), ("merges", plan.merges, 3)):
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != width:
            raise fail(op, f"plan.{name} must be int32 [rows, {width}], got {t.dtype} "
                           f"{list(t.shape)}")  # fmt: skip
        if t.device != query.device:
            raise fail(op, f"plan.{name} must be on {query.device} (the query's device), got "
                           f"{t.device}")  # fmt: skip
        if not t.is_contiguous():
            raise fail(op, f"plan.{name} must be contiguous")


def _check_order(op: str, order: torch.Tensor, query: torch.Tensor) -> None:
    num_seqs = query.shape[0]
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int32 or order.dim() != 1:
        raise fail(op, "seq_order must be a 1-D int32 tensor")
    if order.shape[0] != num_seqs or order.device != query.device:
        raise fail(op, f"seq_order must hold the {num_seqs} rows on {query.device}, got "
                       f"{order.shape[0]} on {order.device}")  # fmt: skip
    if not order.is_contiguous():
        raise fail(op, "seq_order must be contiguous")
    if order.device.type == "cpu" and not torch.equal(
        torch.sort(order).values, torch.arange(num_seqs, dtype=torch.int32)
    ):
        raise fail(op, "seq_order must be a permutation of the rows 0 .. num_seqs - 1")
