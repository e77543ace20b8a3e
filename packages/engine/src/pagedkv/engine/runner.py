"""The model runner: owns the model and the KV caches, and turns one `SchedulerOutput` into
one forward pass.

Per step it (1) swaps and copies blocks as the scheduler planned, (2) builds the flat batch —
token ids, positions, slot mapping, block tables, per-sequence lengths — for the mixed
prefill/decode batch, (3) runs the model once, and (4) returns the logits of the sequences that
sample a token this step. Sampling itself belongs to the engine, which knows the requests.

All layers' caches live in one tensor `kv_cache[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`, so that one kernel launch copies or swaps a block in every layer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pagedattn_kernels import copy_blocks, swap_blocks
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.staging import StagedTables, host_tensor

logger = logging.getLogger(__name__)

_GB = 1 << 30
_MAX_GRAPH_BATCH = 1024  # larger decode batches run eagerly


@dataclass(slots=True)
class PendingTokens:
    """Input tokens still being sampled on the device (asynchronous scheduling): flat input
    row `rows[i]` takes `tokens[sources[i]]`. The host holds a placeholder for them."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor  # int64 on the runner's device

    def write_into(self, input_ids: torch.Tensor) -> None:
        dev = input_ids.device
        src = host_tensor(self.sources).to(dev, non_blocking=True)
        dst = host_tensor(self.rows).to(dev, non_blocking=True)
        input_ids.index_copy_(0, dst, self.tokens.index_select(0, src))


@dataclass(slots=True)
class StepInputs:
    """The tensors of one forward pass (kept for tests and debugging)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the flat token dimension, one per sampling sequence


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes scheduler outputs."""

    def __init__(
        self,
        model_config: ModelConfig,
        args: EngineArgs,
        device: torch.device,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.config = model_config
        self.args = args
        self.device = device
        self.dtype = model_config.dtype
        self.block_size = args.block_size
        self.max_model_len = model_config.max_model_len
        self.max_num_batched_tokens = args.max_num_batched_tokens or max(2048, self.max_model_len)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self._table_cols = torch.arange(self.max_blocks_per_seq)
        # (tokens, sequences, KV tokens attended, query-key pairs) per forward pass, when a
        # benchmark asks for it (`step_log = []`): the roofline of a run is computed from these.
        self.step_log: list[tuple[int, int, int, int]] | None = None
        # With `step_log` on a GPU: the device time of each pass, from its first kernel to its
        # logits (CUDA events, read after the run). The step's wall time minus this is the time
        # the GPU waited for the host.
        self.step_gpu_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._span_start: torch.cuda.Event | None = None

        # A caller may hand in an already loaded model (tests build several engines over one).
        self.model = model if model is not None else load_model(
            model_config, load_format=args.load_format, device=device, dtype=self.dtype,
            seed=args.seed,
        )
        self.block_bytes = (
            2 * model_config.num_layers * self.block_size * model_config.num_kv_heads
            * model_config.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )
        self.num_gpu_blocks = args.num_gpu_blocks_override or self._num_blocks_that_fit()
        if self.num_gpu_blocks < 1:
            raise ValueError(
                "not enough memory for even one KV block: lower --max-num-batched-tokens or "
                "raise --gpu-memory-utilization / --kv-cache-gb"
            )
        if args.num_cpu_blocks_override is not None:
            self.num_cpu_blocks = args.num_cpu_blocks_override
        else:
            self.num_cpu_blocks = int(args.swap_space * _GB // self.block_bytes)
        shape = (model_config.num_layers, 2, self.num_gpu_blocks, self.block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])]
        swap_shape = (shape[0], 2, self.num_cpu_blocks, *shape[3:])
        pin = device.type == "cuda"
        self.swap_cache = torch.empty(swap_shape, dtype=self.dtype, device="cpu", pin_memory=pin)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda" and not args.enforce_eager:
            self._capture_decode_graphs()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB) on %s, %d swap blocks (%.2f GB) on the host",
            self.num_gpu_blocks, self.block_size, self.num_gpu_blocks * self.block_bytes / _GB,
            device, self.num_cpu_blocks, self.num_cpu_blocks * self.block_bytes / _GB,
        )

    # ---- sizing ---------------------------------------------------------------------------
    def _num_blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return int(self.args.kv_cache_gb * _GB // self.block_bytes)
        return self._profile_gpu_blocks()

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after the peak activation
        memory of the largest batch (a profiling forward pass of `max_num_batched_tokens`)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        base_allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.max_num_batched_tokens
        seq_len = min(self.max_model_len, num_tokens)
        num_seqs = max(1, min(self.args.max_num_seqs, num_tokens // seq_len))
        lens = [seq_len] * num_seqs
        blocks = sum(math.ceil(n / self.block_size) for n in lens)
        c = self.config
        tmp = torch.zeros((c.num_layers, 2, blocks, self.block_size, c.num_kv_heads, c.head_dim),
                          dtype=self.dtype, device=self.device)
        caches = [(tmp[i, 0], tmp[i, 1]) for i in range(c.num_layers)]
        tables, b = [], 0
        for n in lens:
            k = math.ceil(n / self.block_size)
            tables.append(list(range(b, b + k)))
            b += k
        inputs = self._build_inputs(
            [([i % c.vocab_size for i in range(n)], 0, t) for n, t in zip(lens, tables)],
            [i for i in range(num_seqs)],
        )
        hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta)
        rows = torch.zeros(self.args.max_num_seqs, dtype=torch.long, device=self.device)
        self.model.compute_logits(hidden[rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base_allocated - tmp.numel() * tmp.element_size()
        del tmp, caches, hidden
        torch.cuda.empty_cache()
        # This engine's share: its weights and peak activations count against
        # `gpu_memory_utilization`, other engines in the same process do not; and it never
        # takes more than is free now.
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        weights += sum(t.numel() * t.element_size() for t in self.model.buffers())
        context = max((total - free) - torch.cuda.memory_reserved(self.device), 0)
        budget = total * self.args.gpu_memory_utilization - weights - peak - context
        free_now, _ = torch.cuda.mem_get_info(self.device)
        budget = min(budget, free_now - peak - (256 << 20))
        logger.info(
            "memory profile: total %.1f GB, weights %.2f GB, peak activations %.2f GB, "
            "CUDA context and others %.2f GB -> %.2f GB for the KV cache",
            total / _GB, weights / _GB, peak / _GB, context / _GB, budget / _GB,
        )
        return int(max(budget, 0) // self.block_bytes)

    # ---- CUDA graphs for decode ---------------------------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes that get a captured graph: 1, 2, 4, 8, every 16 up to 512, then
        every 64 up to `max_num_seqs` (at most 1024, as large GPUs run). A batch is padded to
        the next size, which wastes at most 1/8 of a pass above 512."""
        top = min(self.args.max_num_seqs, _MAX_GRAPH_BATCH)
        sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, min(top, 512) + 1, 16))
        sizes += range(576, top + 1, 64)
        if sizes[-1] != top:
            sizes.append(top)
        return sizes

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        """Capture one graph per bucketed decode batch size, sharing one memory pool.

        Inputs live in static buffers; a replay copies the real batch into their first rows and
        pads the rest (slot -1: nothing written; length 0: attention returns zeros). The
        attention kernels get `max_seq_len = max_model_len` so their launch grid is the same
        for every replay; programs past a sequence's end exit at once."""
        sizes = self.graph_batch_sizes()
        dev = self.device
        self._alloc_graph_inputs(sizes[-1])
        pool = None
        start = torch.cuda.memory_allocated(dev)
        for b in reversed(sizes):
            meta = AttentionMetadata(
                slot_mapping=self._g_slots[:b], block_tables=self._g_tables[:b],
                seq_lens=self._g_lens[:b], cu_query_lens=self._g_cu[: b + 1],
                max_query_len=1, max_seq_len=self.max_model_len, decode_only=True,
            )
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                self.model(self._g_ids[:b], self._g_pos[:b], self.kv_caches, meta)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(self._g_ids[:b], self._g_pos[:b], self.kv_caches, meta)
            pool = graph.pool() if pool is None else pool
            self._graphs[b] = (graph, hidden)
        torch.cuda.synchronize(dev)
        logger.info("captured %d decode CUDA graphs (batch sizes %s), %.2f GB",
                    len(sizes), sizes, (torch.cuda.memory_allocated(dev) - start) / _GB)

    def release_graphs(self) -> None:
        """Drop the captured graphs and wait for the GPU. Tensor-parallel ranks do this before
        leaving their process groups: NCCL does not finish tearing down a communicator while
        graphs that captured its collectives are alive."""
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _alloc_graph_inputs(self, top: int) -> None:
        """Static device inputs of the decode graphs (`top` rows) and their pinned host
        staging buffers."""
        dev = self.device
        pin = dev.type == "cuda"
        self._g_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self._g_pos = torch.zeros(top, dtype=torch.long, device=dev)
        self._g_slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self._g_tables = torch.zeros((top, self.max_blocks_per_seq), dtype=torch.int32, device=dev)
        self._g_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self._g_cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        # Two sets of pinned staging buffers, used in turn: with asynchronous scheduling the
        # host fills the next step's while the copies of the step before may still be queued.
        self._g_stages = [torch.zeros((3, top), dtype=torch.long, pin_memory=pin)
                          for _ in range(2)]
        self._g_table_stages = [
            StagedTables(torch.zeros((top, self.max_blocks_per_seq), dtype=torch.int32,
                                     pin_memory=pin))
            for _ in range(2)
        ]
        self._g_turn = 0

    def _graph_for(self, num_seqs: int) -> int | None:
        fits = [b for b in self._graphs if b >= num_seqs]
        return min(fits) if fits else None

    def _replay_decode(
        self, toks: Sequence[list[int]], pos: Sequence[int], tables: Sequence[list[int]], b: int,
        pending: PendingTokens | None = None,
    ) -> torch.Tensor:
        """Replay the decode graph of `b` rows on one token per sequence: `toks`, `pos` and
        `tables` are the columns of `execute`'s `seqs`."""
        n = len(toks)
        bs = self.block_size
        ids = [t[0] for t in toks]
        slots = [t[p // bs] * bs + p % bs for p, t in zip(pos, tables)]
        if self.step_log is not None:
            kv = sum(pos) + n
            self.step_log.append((n, n, kv, kv))
        # One pinned staging row per input, filled from one host tensor, one copy each; the
        # copies are ordered before the replay on the same stream. A buffer set is rewritten
        # two steps later, after the engine has synchronised on the step in between.
        turn = self._g_turn
        self._g_turn = 1 - turn
        stage = self._g_stages[turn]
        stage[:, :n] = host_tensor(ids + list(pos) + slots, torch.long).view(3, n)
        self._g_ids[:n].copy_(stage[0, :n], non_blocking=True)
        if pending is not None:
            pending.write_into(self._g_ids)
        self._g_pos[:n].copy_(stage[1, :n], non_blocking=True)
        self._g_slots[:n].copy_(stage[2, :n], non_blocking=True)
        self._g_slots[n:b].fill_(-1)
        self._g_lens[:n].copy_(self._g_pos[:n])
        self._g_lens[:n] += 1
        self._g_lens[n:b].zero_()
        table_stage = self._g_table_stages[turn]
        width = table_stage.update(tables)
        self._g_tables[:n, :width].copy_(table_stage.buf[:n, :width], non_blocking=True)
        graph, hidden = self._graphs[b]
        self._begin_span()
        graph.replay()
        return hidden[:n]

    def _pack_tables(self, tables: list[list[int]], out: torch.Tensor) -> int:
        """Write ragged block tables into the rows of `out` (left-aligned; the tail of each row
        is left as is, since no kernel reads past a sequence's length). One host tensor for
        all of them instead of one per row. Returns the width used."""
        lens = host_tensor(list(map(len, tables)))
        width = int(lens.max())
        flat = host_tensor(list(chain.from_iterable(tables)), torch.int32)
        view = out[: len(tables), :width]
        view[self._table_cols[:width] < lens[:, None]] = flat
        return width

    def _begin_span(self) -> None:
        if self.step_log is not None and self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._span_start = start

    def _end_span(self) -> None:
        if self.step_log is not None and self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.step_gpu_events.append((self._span_start, end))

    # ---- one step -------------------------------------------------------------------------
    def _build_inputs(
        self,
        seqs: list[tuple[list[int], int, list[int]]],
        sample_seq_indices: list[int],
    ) -> StepInputs:
        """seqs: per sequence (token ids of the positions computed now, first position,
        block table). Positions and slots are computed on the device from these few lists."""
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        width = 1
        for toks, start, table in seqs:
            ids.extend(toks)
            starts.append(start)
            qlens.append(len(toks))
            width = max(width, len(table))
        dev = self.device
        num_seqs = len(seqs)
        qlens_t = host_tensor(qlens, torch.int32)
        cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(qlens_t, 0, out=cu[1:])
        starts_t = host_tensor(starts, torch.int32)
        seq_lens = starts_t + qlens_t
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), qlens_t.long())
        total = len(ids)
        positions = torch.arange(total) - cu[:-1].long()[seq_idx] + starts_t.long()[seq_idx]
        block_tables = torch.zeros((num_seqs, width), dtype=torch.int32)
        self._pack_tables([table for _, _, table in seqs], block_tables)
        slots = block_tables.long()[seq_idx, positions // bs] * bs + positions % bs
        sample_rows = (cu[1:].long() - 1)[host_tensor(sample_seq_indices)]
        max_q = max(qlens)
        num_decode = 0  # leading single-token sequences (running decodes come first)
        if max_q > 1:
            while qlens[num_decode] == 1:
                num_decode += 1
        if self.step_log is not None:
            pairs = sum(q * s + q * (q + 1) // 2 for q, s in zip(qlens, starts))
            self.step_log.append((total, num_seqs, sum(starts) + total, pairs))
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            seq_lens=seq_lens.to(dev, non_blocking=True),
            cu_query_lens=cu.to(dev, non_blocking=True),
            max_query_len=max_q,
            max_seq_len=int(seq_lens.max()),
            decode_only=max_q == 1,
            num_decode_seqs=num_decode,
            prefill_cu_query_lens=(cu[num_decode:] - num_decode).to(dev, non_blocking=True)
            if num_decode else None,
        )
        return StepInputs(
            input_ids=host_tensor(ids).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            meta=meta,
            sample_rows=sample_rows.to(dev, non_blocking=True),
        )

    def apply_block_ops(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        copies: list[tuple[int, int]],
    ) -> None:
        """Swap out, swap in, then copy-on-write, in that order, before the forward pass.

        The swaps are ordered on the compute stream: a block swapped out may be handed to
        another sequence in this very step, and its new K/V must not be written before the
        old contents left."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if swap_out:
            swap_blocks(self.kv_cache, self.swap_cache, torch.tensor(swap_out, dtype=torch.long),
                        stream=stream)
        if swap_in:
            swap_blocks(self.swap_cache, self.kv_cache, torch.tensor(swap_in, dtype=torch.long),
                        stream=stream)
        if copies:
            copy_blocks(self.kv_cache, torch.tensor(copies, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[tuple[list[int], int, list[int]]],
        sample_seq_indices: list[int],
        pending: PendingTokens | None = None,
    ) -> torch.Tensor:
        """Run one forward pass; return float32 logits [len(sample_seq_indices), vocab].
        `pending`: input tokens that are still on the device (placeholders in `seqs`)."""
        if self._graphs and seqs:
            toks, pos, tables = zip(*seqs)
            b = self._graph_for(len(seqs)) if max(map(len, toks)) == 1 else None
            if b is not None:
                hidden = self._replay_decode(toks, pos, tables, b, pending)
                if sample_seq_indices != list(range(len(seqs))):  # else every row samples
                    rows = host_tensor(sample_seq_indices).to(self.device, non_blocking=True)
                    hidden = hidden[rows]
                logits = self.model.compute_logits(hidden)
                self._end_span()
                return logits
        inputs = self._build_inputs(seqs, sample_seq_indices)
        if pending is not None:
            pending.write_into(inputs.input_ids)
        self._begin_span()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not sample_seq_indices:
            logits = hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
        self._end_span()
        return logits
