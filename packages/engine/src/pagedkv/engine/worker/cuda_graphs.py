"""Decode steps replayed as CUDA graphs.

A decode step of a large batch is hundreds of small kernel launches for a few milliseconds of
GPU work; launched one by one from Python, the GPU would wait for the host. So the runner
captures the decode forward pass once per bucketed batch size (sharing one memory pool, as
nano-vllm and vLLM do) and replays it: the real batch is copied into the first rows of static
input buffers and the rest is padding (length 0: attention returns zeros; slot -1: nothing is
written).

The slot mapping is computed inside the graph from the staged block tables and positions
(``inputs.slot_mapping``), so the host sends only token ids, positions and the block-table
entries that changed since the last step (``staging.StagedTables``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from pagedattn_kernels import DecodePlan
from pagedkv.engine.attention import AttentionMetadata
from pagedkv.engine.worker import inputs
from pagedkv.engine.worker.decode_plans import DecodePlanner
from pagedkv.engine.worker.inputs import longest_first, slot_mapping
from pagedkv.engine.worker.staging import StagedTables, host_tensor

logger = logging.getLogger(__name__)

_GB = 1 << 30
MAX_GRAPH_BATCH = 1024  # larger decode batches run eagerly


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a captured graph: 1, 2, 4, 8, every 16 up to 512, then
    every 64 up to `max_num_seqs` (at most 1024, as large GPUs run). A batch is padded to the
    next size, which wastes at most 1/8 of a pass above 512."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, min(top, 512) + 1, 16))
    sizes += range(576, top + 1, 64)
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Static decode inputs, their pinned staging buffers, and one graph per batch size."""

    def __init__(
        self, model: torch.nn.Module, kv_caches: list, *, block_size: int, max_model_len: int,
        max_blocks_per_seq: int, max_num_seqs: int, device: torch.device,
        planner: DecodePlanner | None = None,
    ) -> None:
        """`planner`: decode attention by plans for the batch sizes where they pay (each
        graph captured with static plan buffers of its capacity)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.planner = planner
        # per planned batch size: (items, merges) of its plan buffers, and the kernel tile
        self.plan_sizes: dict[int, tuple[int, int, int]] = {}
        if planner is not None:
            for b in self.sizes:
                if planner.pays(b):  # an all-padding plan has the graph's layout
                    empty = planner.plan([0] * b, padded=True)
                    self.plan_sizes[b] = (*empty.work.shape[:1], *empty.merges.shape[:1],
                                          empty.tile_n)  # fmt: skip
        self._alloc_inputs(self.sizes[-1], max_blocks_per_seq)

    def _alloc_inputs(self, top: int, width: int) -> None:
        dev = self.device
        pin = dev.type == "cuda"
        self.ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top, dtype=torch.long, device=dev)
        self.tables = torch.zeros((top, width), dtype=torch.int32, device=dev)
        self.lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.order = torch.arange(top, dtype=torch.int32, device=dev)  # attention's schedule
        self.cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(top, device=dev)
        # Two sets of pinned staging buffers, used in turn: with asynchronous scheduling the
        # host fills the next step's while the copies of the step before may still be queued.
        self._stages = [torch.zeros((2, top), dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._order_stages = [torch.zeros(top, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._table_stages = [
            StagedTables(torch.zeros((top, width), dtype=torch.int32, pin_memory=pin))
            for _ in range(2)
        ]
        self._turn = 0
        self._padding_rows = torch.arange(top, dtype=torch.int32)
        # decode plans: one static buffer of the largest capacity, each graph using its first
        # rows (work rows, then merge rows), and pinned stages in turn; all padding (-1) to start
        items = max((c[0] * 4 + c[1] * 3 for c in self.plan_sizes.values()), default=0)
        self.plan_buf = torch.full((items,), -1, dtype=torch.int32, device=dev)
        self._plan_stages = [torch.full((items,), -1, dtype=torch.int32, pin_memory=pin)
                             for _ in range(2)]  # fmt: skip

    def _forward(self, b: int) -> torch.Tensor:
        """The decode pass over the first `b` static rows (what each graph captures)."""
        pos = self.pos[:b]
        lens = self.lens[:b]
        slots = slot_mapping(self.tables[:b], self.rows[:b], pos, self.block_size)
        plan = self._plan_views(b)
        meta = AttentionMetadata(
            slot_mapping=torch.where(lens > 0, slots, -1), block_tables=self.tables[:b],
            seq_lens=lens, cu_query_lens=self.cu[: b + 1], max_query_len=1,
            max_seq_len=self.max_model_len, decode_only=True,
            decode_order=self.order[:b] if inputs.DECODE_ORDER and plan is None else None,
            decode_plan=plan,
        )
        return self.model(self.ids[:b], pos, self.kv_caches, meta)

    def _plan_views(self, b: int, buf: torch.Tensor | None = None) -> DecodePlan | None:
        """The plan of the graph of `b` rows as views of `buf` (the static plan buffer, or a
        staging one of the same layout); None where plans do not pay."""
        if b not in self.plan_sizes:
            return None
        items, merges, tile_n = self.plan_sizes[b]
        buf = self.plan_buf if buf is None else buf
        work = buf[: items * 4].view(items, 4)
        return DecodePlan(work, buf[items * 4 : items * 4 + merges * 3].view(merges, 3), tile_n)

    def _stage_plan(self, b: int, positions: torch.Tensor, turn: int) -> None:
        """Plan this step's rows (contexts: position + 1; padding rows 0) into the pinned stage
        of `turn`, then copy it to the static plan buffer, ordered before the replay."""
        n = positions.shape[0]
        lens = np.zeros(b, dtype=np.int64)
        lens[:n] = positions.numpy() + 1
        plan = self.planner.plan(lens, padded=True)
        stage = self._plan_stages[turn]
        staged = self._plan_views(b, stage)
        staged.work.copy_(plan.work)
        staged.merges.copy_(plan.merges)
        used = staged.work.numel() + staged.merges.numel()
        self.plan_buf[:used].copy_(stage[:used], non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, sharing one memory pool. The
        attention kernels get `max_seq_len = max_model_len` so their launch grid is the same
        for every replay; programs past a sequence's end exit at once.

        Each graph is replayed once right away, on inputs that are all padding (length 0:
        nothing is written to the cache): a graph's first launch costs more than the next
        ones (on an H200, Llama-3-8B fp8: 0.5-0.9 ms more host time and 0.1-0.6 ms more
        device time, 26 and 9 ms over the 44 graphs; `scripts/graph_first_replay.py`), and
        would otherwise land inside a serving run."""
        dev = self.device
        pool = None
        start = torch.cuda.memory_allocated(dev)
        for b in reversed(self.sizes):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                self._forward(b)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = (graph, hidden)
            graph.replay()  # the static lengths are still 0: every row is padding
        torch.cuda.synchronize(dev)
        logger.info("captured %d decode CUDA graphs (batch sizes %s), %.2f GB",
                    len(self.sizes), self.sizes, (torch.cuda.memory_allocated(dev) - start) / _GB)

    def release(self) -> None:
        self.graphs.clear()

    def size_for(self, num_seqs: int) -> int | None:
        """The captured batch size a decode batch of `num_seqs` pads to (None: none fits)."""
        if not self.graphs or num_seqs > self.sizes[-1]:
            return None
        for b in self.sizes:
            if b >= num_seqs:
                return b
        return None

    def replay(
        self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[list[int]], b: int,
        write_pending=None,
    ) -> torch.Tensor:
        """Replay the graph of `b` rows on one token per sequence; returns the hidden states
        of the real rows. `write_pending(input_ids)` fills input tokens still on the device.

        One pinned staging row per input, filled from one host tensor, one copy each; the
        copies are ordered before the replay on the same stream. A buffer set is rewritten
        two steps later, after the engine has synchronised on the step in between."""
        n = len(ids)
        turn = self._turn
        self._turn = 1 - turn
        stage = self._stages[turn]
        stage[:, :n] = host_tensor(list(ids) + list(positions), torch.long).view(2, n)
        self.ids[:n].copy_(stage[0, :n], non_blocking=True)
        if write_pending is not None:
            write_pending(self.ids)
        self.pos[:n].copy_(stage[1, :n], non_blocking=True)
        self.lens[:n].copy_(self.pos[:n])
        self.lens[:n] += 1
        self.lens[n:b].zero_()
        # attention's schedule: the real rows longest first (by position: length - 1), then
        # the padding rows in their own order
        if b in self.plan_sizes:
            self._stage_plan(b, stage[1, :n], turn)
        elif inputs.DECODE_ORDER:
            order_stage = self._order_stages[turn]
            order_stage[:n] = longest_first(stage[1, :n])
            order_stage[n:b] = self._padding_rows[n:b]
            self.order[:b].copy_(order_stage[:b], non_blocking=True)
        table_stage = self._table_stages[turn]
        width = table_stage.update(tables)
        self.tables[:n, :width].copy_(table_stage.buf[:n, :width], non_blocking=True)
        graph, hidden = self.graphs[b]
        graph.replay()
        return hidden[:n]
