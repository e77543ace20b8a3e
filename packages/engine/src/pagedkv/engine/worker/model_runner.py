"""The model runner: owns the model and the KV cache, and turns one `SchedulerOutput` into
sampled tokens.

``execute(scheduler_output) -> RunnerOutput``:

1. swap and copy blocks as the scheduler planned (swap out, swap in, copy-on-write);
2. build the flat batch — token ids, positions, slot mapping, block tables, per-sequence
   lengths — for the mixed prefill/decode batch (a decode batch replays a CUDA graph, a batch
   with a prompt chunk a chain of graphs cut at attention: `piecewise_graphs`);
3. run the model once and compute the logits of the sequences that sample (and of the prompt
   positions of requests that asked for `prompt_logprobs`);
4. sample (an argmax for plain greedy batches; otherwise the token masks are computed on the
   host first, while the forward pass still runs on a GPU) and hand the token ids back.

``execute_async`` is the same pass for asynchronous scheduling: it returns at once with an
`InFlightStep` whose `result()` waits for the tokens, and a sequence scheduled ahead of its last
token reads that token on the device from the step launched before.

All layers' caches live in one tensor ``kv_cache[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``, so that one kernel launch copies or swaps a block in every layer.
Its dtype is the model's, or e4m3 with ``--kv-cache-dtype fp8`` (one byte per element: twice
the blocks of a bf16 cache in the same memory; the attention layers hold the scales).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from itertools import chain

import torch

from pagedattn_kernels import (
    FP8_DTYPE,
    argmax_rows,
    copy_blocks,
    swap_blocks,
    warm_up_decode_attention,
)
from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.attention import Attention
from pagedkv.engine.config import ModelConfig, kv_cache_dtype
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models.quantization import is_quantized, lm_head_quantized, quantization_of
from pagedkv.engine.outputs import PositionLogprobs, RunnerOutput
from pagedkv.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pagedkv.engine.worker.decode_plans import DecodePlanner
from pagedkv.engine.worker.inputs import StepBatch, build_inputs, step_batch
from pagedkv.engine.worker.piecewise_graphs import PiecewiseGraphs, piecewise_token_sizes
from pagedkv.engine.worker.sampler import prompt_logprobs
from pagedkv.engine.worker.sampling import BatchSampler
from pagedkv.engine.worker.staging import to_device

logger = logging.getLogger(__name__)

_GB = 1 << 30
#: Greedy tokens by `pagedattn_kernels.argmax_rows` (else torch's argmax);
#: ``PAGEDKV_ARGMAX_KERNEL=0`` for A/B runs.
ARGMAX_KERNEL = os.environ.get("PAGEDKV_ARGMAX_KERNEL", "1") != "0"


def resolve_device(name: str) -> torch.device:
    """`--device`: "auto" is CUDA when a GPU is there, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available; use --device cpu")
    return torch.device(name)


@dataclass(slots=True)
class PendingTokens:
    """Input tokens still being sampled on the device (asynchronous scheduling): flat input
    row `rows[i]` takes `tokens[sources[i]]`. The host holds a placeholder for them."""

    rows: list[int]
    sources: list[int]
    tokens: torch.Tensor  # int64 on the runner's device

    def write_into(self, input_ids: torch.Tensor) -> None:
        n = len(self.rows)
        both = to_device(self.rows + self.sources, input_ids.device)  # one copy, pinned
        input_ids.index_copy_(0, both[:n], self.tokens.index_select(0, both[n:]))


@dataclass(slots=True)
class PromptLogprobPlan:
    """Prompt positions of this step whose logits are wanted (`SamplingParams.prompt_logprobs`):
    flat token `rows` of the forward pass, and per request (request id, index of the first
    prompt token predicted, the prompt tokens predicted, top-N asked)."""

    rows: list[int]
    parts: list[tuple[str, int, list[int], int]]


def prompt_logprob_plan(out, seqs_to_check) -> PromptLogprobPlan | None:
    """The plan of a `SchedulerOutput`: for every scheduled chunk of a request with
    `prompt_logprobs` (its first live sequence only: siblings recomputed after a preemption
    share the prompt), positions p of the chunk with p + 1 inside the prompt predict prompt
    token p + 1. Chunked prefill gives each chunk's share; a recomputed prompt gives them again
    (the output processor keeps the first). `seqs_to_check` False: nothing to look for."""
    if not seqs_to_check:
        return None
    rows: list[int] = []
    parts: list[tuple[str, int, list[int], int]] = []
    offset = 0
    for ss, seq in zip(out.scheduled, out.seqs):
        first = offset
        offset += ss.num_tokens
        if not ss.is_prefill:
            continue
        g = seq.group
        num = g.sampling.params.prompt_logprobs
        if num is None or not g.seqs or seq is not g.seqs[0]:
            continue
        start = ss.start
        end = min(start + ss.num_tokens, seq.prompt_len - 1)
        if start >= end:
            continue
        rows.extend(range(first, first + end - start))
        parts.append((ss.request_id, start + 1, seq.token_ids[start + 1 : end + 1], num))
    return PromptLogprobPlan(rows, parts) if rows else None


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens are on their way to the host (asynchronous scheduling).

    With rows under token masks the copy waits for `finish()`: the masks need the tokens of
    the step before, which the engine applies after launching this one."""

    seqs: list  # the sampling sequences, in row order
    host: torch.Tensor  # where the argmax ids are copied (pinned on a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: already there)
    tokens: torch.Tensor | None = None  # the argmax ids on the device, until `finish()`
    logits: torch.Tensor | None = None  # the sampling rows' logits, while masks are pending
    masker: BatchSampler | None = None

    def finish(self) -> None:
        """Build the token masks of the masked rows (on the host, while the pass runs), take
        their masked argmax into the ids, and start the copy of the ids to the host."""
        tokens = self.tokens
        if tokens is None:
            return
        if self.logits is not None:
            with torch.inference_mode():  # the ids are an inference tensor
                self.masker.mask_argmax_rows(self.seqs, self.logits, tokens)
            self.logits = None
        self.tokens = None
        self.ready = start_copy(tokens, self.host)

    def result(self) -> RunnerOutput:
        """Wait for the tokens; the step's `RunnerOutput`."""
        self.finish()
        if self.ready is not None:
            self.ready.synchronize()
        return BatchSampler.argmax_output(self.seqs, self.host.tolist())


def sampling_seqs(out, batch: StepBatch) -> list:
    """The sequences of `out` that sample in `batch`, in row order."""
    seqs = out.seqs
    if len(batch.sample_idx) != len(seqs):
        seqs = [seqs[k] for k in batch.sample_idx]
    return seqs


def start_copy(tokens: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
    """Copy `tokens` into `host`: on a GPU without waiting, returning the event recorded
    after the copy; on the CPU at once (None)."""
    if not tokens.is_cuda:
        host.copy_(tokens)
        return None
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return ready


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes scheduler outputs."""

    def __init__(
        self,
        model_config: ModelConfig,
        args: EngineArgs,
        device: torch.device,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`model`: an already loaded model of `model_config` to reuse (tests build several
        engines over one)."""
        self.config = model_config
        self.args = args
        self.device = device
        self.dtype = model_config.dtype
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.block_size = args.block_size
        self.max_model_len = model_config.max_model_len
        self.max_num_batched_tokens = args.max_num_batched_tokens or max(2048, self.max_model_len)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        # (tokens, sequences, KV tokens attended, query-key pairs) per forward pass, when a
        # benchmark asks for it (`step_log = []`): the roofline of a run is computed from these.
        self.step_log: list[tuple[int, int, int, int]] | None = None
        # With `step_log` on a GPU: the device time of each pass, from its first kernel to its
        # logits (CUDA events, read after the run). The step's wall time minus this is the time
        # the GPU waited for the host.
        self.step_gpu_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._span_start: torch.cuda.Event | None = None
        # Forward passes so far, by how they ran: a decode batch replaying a captured CUDA
        # graph, or eagerly (tests check that graphs are replayed, on every rank).
        self.graph_replays = 0
        self.eager_passes = 0

        torch.manual_seed(args.seed)
        if model is not None and is_quantized(model) != (args.quantization == "fp8"):
            raise ValueError(
                f"the model given was loaded with quantization={quantization_of(model)!r} but "
                f"the engine asks for {args.quantization!r}; load it with the engine's option"
            )
        if model is not None and lm_head_quantized(model) != args.quantize_lm_head:
            raise ValueError(
                f"the model given was loaded with quantize_lm_head={lm_head_quantized(model)} "
                f"but the engine asks for {args.quantize_lm_head}; load it with the engine's option"
            )
        self.model = model if model is not None else load_model(
            model_config, load_format=args.load_format, device=device, dtype=self.dtype,
            seed=args.seed, quantization=args.quantization,
            quantize_lm_head=args.quantize_lm_head,
        )
        self.sampler = BatchSampler(device, sorted(model_config.eos_token_ids), args.seed,
                                    model_config.vocab_size)
        self._allocate_kv_cache()
        self._warm_up_attention()
        # decode attention by plans where they pay (None off a GPU)
        self.planner = DecodePlanner.for_caches(self.kv_caches, self.dtype)
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not args.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, block_size=self.block_size,
                max_model_len=self.max_model_len, max_blocks_per_seq=self.max_blocks_per_seq,
                max_num_seqs=args.max_num_seqs, device=device, planner=self.planner,
            )
            self.graphs.capture()
        # Batches with a prompt chunk: piecewise graphs (one GPU; not yet over tensor-parallel
        # ranks, which would have to capture and replay the same chains in step).
        self.piecewise: PiecewiseGraphs | None = None
        sizes = piecewise_token_sizes(self.max_num_batched_tokens)
        if self.graphs is not None and args.tensor_parallel_size == 1 and sizes:
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, sizes=sizes,
                                             device=device, dtype=self.dtype)
            self.piecewise.capture()
        self.piecewise_replays = 0
        if device.type == "cuda" and args.tensor_parallel_size == 1:
            # compile the greedy argmax now, not in the first step, and load the logits'
            # kernels (tensor-parallel ranks reduce their vocabulary slices another way:
            # RankRunner.greedy_tokens, and load their slice's kernels there)
            with torch.inference_mode():
                self.greedy_tokens(torch.zeros(1, self.config.hidden_size, dtype=self.dtype,
                                               device=device))  # fmt: skip
            self._load_logits_kernels(args.max_num_seqs)
        # Asynchronous scheduling: the argmax of the step launched last, on the device, and
        # the row of each sampling sequence in it; two host buffers for the ids, used in turn.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[int, int] = {}
        pin = device.type == "cuda"
        self._token_hosts = [torch.zeros(args.max_num_seqs, dtype=torch.long, pin_memory=pin)
                             for _ in range(2)]
        self._token_turn = 0

    # ---- sizing -------------------------------------------------------------------------------
    def _allocate_kv_cache(self) -> None:
        c = self.config
        self.block_bytes = c.kv_bytes_per_token(self.kv_dtype) * self.block_size
        args = self.args
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
        shape = (c.num_layers, 2, self.num_gpu_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])]
        swap_shape = (shape[0], 2, self.num_cpu_blocks, *shape[3:])
        pin = self.device.type == "cuda"
        self.swap_cache = torch.empty(swap_shape, dtype=self.kv_dtype, device="cpu",
                                      pin_memory=pin)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB, %s) on %s, %d swap blocks (%.2f GB) on "
            "the host", self.num_gpu_blocks, self.block_size,
            self.num_gpu_blocks * self.block_bytes / _GB, str(self.kv_dtype).removeprefix("torch."),
            self.device, self.num_cpu_blocks, self.num_cpu_blocks * self.block_bytes / _GB,
        )

    @torch.inference_mode()
    def _warm_up_attention(self) -> None:
        """With ``PAGEDKV_WARM_UP_ATTENTION=1``: compile every decode-attention variant a pass
        can pick now, not in a pass. A CUDA graph's capture compiles what its replays run, but
        a mixed pass's decode rows run eagerly, their tiles and split count chosen from the
        batch in hand: on an H200 a split count met for the first time compiled for 1.1 s in
        the first prompt pass of a Llama-3-8B run (f86058c, `triton_compiled_during_run`),
        and with the warm-up nothing compiled (cdbf897). Off by default until measured: in
        that same call the fp8 run's decode batches of 65+ sequences ran 26-42% slower with
        it (13,450 against 15,263-15,345 output tok/s in five runs without, on other machines
        of the same session), with no mechanism found yet. Nothing off a GPU."""
        if self.device.type != "cuda" or os.environ.get("PAGEDKV_WARM_UP_ATTENTION") != "1":
            return
        attn = next((m for m in self.model.modules() if isinstance(m, Attention)), None)
        if attn is None:
            return
        key_cache, value_cache = self.kv_caches[0]
        scales = {}
        if key_cache.dtype == FP8_DTYPE:
            scales = {"k_scale": attn.k_scale, "v_scale": attn.v_scale}
        start = time.perf_counter()
        calls = warm_up_decode_attention(
            attn.num_heads, key_cache, value_cache, dtype=self.dtype,
            max_num_seqs=self.args.max_num_seqs, max_seq_len=self.max_model_len, **scales,
        )  # fmt: skip
        torch.cuda.synchronize(self.device)
        logger.info("decode attention warmed up: %d calls in %.1f s", calls,
                    time.perf_counter() - start)

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
        per_seq = math.ceil(seq_len / self.block_size)
        c = self.config
        tmp = torch.zeros((c.num_layers, 2, num_seqs * per_seq, self.block_size, c.num_kv_heads,
                           c.head_dim), dtype=self.kv_dtype, device=self.device)
        caches = [(tmp[i, 0], tmp[i, 1]) for i in range(c.num_layers)]
        batch = StepBatch(
            token_ids=[[i % c.vocab_size for i in range(seq_len)] for _ in range(num_seqs)],
            starts=[0] * num_seqs,
            block_tables=[list(range(k * per_seq, (k + 1) * per_seq)) for k in range(num_seqs)],
            sample_idx=list(range(num_seqs)),
        )
        inputs, _ = build_inputs(batch, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta)
        rows = torch.zeros(self.args.max_num_seqs, dtype=torch.long, device=self.device)
        self.model.compute_logits(hidden[rows])
        torch.cuda.synchronize(self.device)
        peak = (torch.cuda.max_memory_allocated(self.device) - base_allocated
                - tmp.numel() * tmp.element_size())
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

    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes that get (or would get) a captured CUDA graph."""
        return graph_batch_sizes(self.args.max_num_seqs)

    def release_graphs(self) -> None:
        """Drop the captured graphs and wait for the GPU. Tensor-parallel ranks do this before
        leaving their process groups: NCCL does not finish tearing down a communicator while
        graphs that captured its collectives are alive."""
        if self.graphs is not None:
            self.graphs.release()
        if self.piecewise is not None:
            self.piecewise.release()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out) -> RunnerOutput:
        """Run one scheduled step (a `pagedkv.scheduler.SchedulerOutput`): block operations,
        the forward pass, sampling. Returns the sampled token ids per sequence."""
        batch = step_batch(out)
        plain, plan = self.plan_logits(out, batch)
        logits = self.run(batch, prompt_rows=plan.rows if plan is not None else None)
        return self.sample(out, batch.sample_idx, logits, plan, plain=plain)

    @staticmethod
    def plan_logits(out, batch: StepBatch) -> tuple[bool, PromptLogprobPlan | None]:
        """Whether every sampling sequence is plain greedy, and which prompt positions of this
        step need logits (see `prompt_logprob_plan`). A batch whose sequences all sample and
        are plain greedy has none: it costs the one pass over them that `sample` needs anyway."""
        seqs = out.seqs
        every = batch.samples_every_row
        plain = BatchSampler.all_plain_greedy(
            seqs if every else [seqs[k] for k in batch.sample_idx])
        return plain, prompt_logprob_plan(out, not (plain and every))

    def sample(self, out, sample_idx: list[int], logits: torch.Tensor,
               plan: PromptLogprobPlan | None = None, *, plain: bool | None = None
               ) -> RunnerOutput:
        """Sample the rows of `out` listed in `sample_idx` from their `logits` (followed by
        the rows of `plan`'s prompt positions, when given). `plain`: whether every sampling
        sequence is plain greedy, when the caller knows."""
        seqs, sched = out.seqs, out.scheduled
        if len(sample_idx) != len(seqs):
            seqs = [seqs[k] for k in sample_idx]
            sched = [sched[k] for k in sample_idx]
        prompt_lp = None
        if plan is not None:
            prompt_lp = self._prompt_logprobs(plan, logits[len(seqs):])
            logits = logits[: len(seqs)]
        if plain is None:
            plain = BatchSampler.all_plain_greedy(seqs)
        if plain:  # the throughput path
            result = BatchSampler.argmax_output(seqs, logits.argmax(dim=-1).tolist())
        else:
            positions = [ss.start + ss.num_tokens for ss in sched]
            result = self.sampler.sample(seqs, positions, logits)
        result.prompt_logprobs = prompt_lp
        return result

    @staticmethod
    def _prompt_logprobs(
        plan: PromptLogprobPlan, logits: torch.Tensor
    ) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        out = {}
        at = 0
        for rid, first, nxt, num in plan.parts:
            out[rid] = (first, prompt_logprobs(logits[at : at + len(nxt)], nxt, num))
            at += len(nxt)
        return out

    #: `execute_async` takes greedy rows under token masks too (see `InFlightStep.finish`).
    masks_in_flight = True

    @torch.inference_mode()
    def execute_async(self, out) -> InFlightStep:
        """Launch one greedy step without waiting for it (asynchronous scheduling): block
        operations, the forward pass, the argmax and the copy of the ids to the host. A
        sequence scheduled ahead of its last token reads it here from the step launched before,
        on the device. Rows under token masks keep their logits until `InFlightStep.finish()`."""
        batch = step_batch(out)
        pending = self.pending_tokens(batch)
        if not any(s.group.sampling.needs_token_mask for s in sampling_seqs(out, batch)):
            return self.in_flight(out, batch, self.run(batch, pending, greedy=True))
        logits = self.run(batch, pending)
        step = self.in_flight(out, batch, logits.argmax(dim=-1), copy=False)
        step.logits = logits
        step.masker = self.sampler
        return step

    def pending_tokens(self, batch: StepBatch) -> PendingTokens | None:
        """Where the placeholders of `batch` read their tokens: the argmax rows of the step
        launched before (None without placeholders)."""
        if not batch.placeholders:
            return None
        rows = self._last_rows
        return PendingTokens([r for r, _ in batch.placeholders],
                             [rows[sid] for _, sid in batch.placeholders], self._last_tokens)

    def in_flight(self, out, batch: StepBatch, tokens: torch.Tensor, copy: bool = True
                  ) -> InFlightStep:
        """Remember the launched step's `tokens` (device, one per sampling row) for the next
        step's placeholders and start copying them to the host (`copy` False: at the step's
        `finish()`; a masked argmax still writes into them). The next step is launched after
        that, so its placeholders read the final tokens (one stream orders them)."""
        seqs = sampling_seqs(out, batch)
        self._last_tokens = tokens
        self._last_rows = {s.seq_id: r for r, s in enumerate(seqs)}
        turn = self._token_turn
        self._token_turn = 1 - turn
        host = self._token_hosts[turn][: len(seqs)]
        if not copy:
            return InFlightStep(seqs, host, None, tokens)
        return InFlightStep(seqs, host, start_copy(tokens, host))

    def run(
        self, batch: StepBatch, pending: PendingTokens | None = None, *, greedy: bool = False,
        prompt_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Block operations, then one forward pass; float32 logits of the sampling rows,
        followed by those of the flat token rows `prompt_rows` (prompt logprobs) when given, or
        with `greedy` the sampling rows' argmax token ids (int64, `greedy_tokens`).

        Tensor-parallel ranks all call this with the same arguments."""
        if batch.swap_out or batch.swap_in or batch.copies:
            self.apply_block_ops(batch.swap_out, batch.swap_in, batch.copies)
        if self.step_log is not None:
            self._log_pass(batch)
        graphs = self.graphs
        b = graphs.size_for(batch.num_seqs) if graphs is not None else None
        if b is not None and batch.is_decode:
            write = pending.write_into if pending is not None else None
            ids = [t[0] for t in batch.token_ids]
            self._begin_span()
            hidden = graphs.replay(ids, batch.starts, batch.block_tables, b, write)
            self.graph_replays += 1
            if prompt_rows:
                rows = batch.sample_idx + prompt_rows
                hidden = hidden[to_device(rows, self.device)]
            elif not batch.samples_every_row:
                hidden = hidden[to_device(batch.sample_idx, self.device)]
            logits = self.greedy_tokens(hidden) if greedy else self.model.compute_logits(hidden)
            self._end_span()
            return logits
        inputs, _ = build_inputs(batch, self.block_size, self.device, self.planner)
        if pending is not None:
            pending.write_into(inputs.input_ids)
        self._begin_span()
        piecewise = self.piecewise
        t = piecewise.size_for(inputs.input_ids.shape[0]) if piecewise is not None else None
        if t is not None:
            hidden = piecewise.replay(inputs.input_ids, inputs.positions, inputs.meta, t)
            self.piecewise_replays += 1
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            self.eager_passes += 1
        if not batch.sample_idx and not prompt_rows:
            logits = (hidden.new_empty(0, dtype=torch.long) if greedy else
                      hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32))
        elif greedy:
            logits = self.greedy_tokens(hidden[inputs.sample_rows])
        else:
            rows = inputs.sample_rows
            if prompt_rows:
                extra = to_device(prompt_rows, self.device)
                rows = torch.cat([rows, extra])
            logits = self.model.compute_logits(hidden[rows])
        self._end_span()
        return logits

    @torch.inference_mode()
    def _load_logits_kernels(self, max_rows: int) -> None:
        """Run `greedy_logits` once for every row count a step can sample (1 to `max_rows`),
        so that every kernel it uses is loaded now, not in a step.

        The logits are computed outside the CUDA graphs, on as many rows as sequences
        sample, and cuBLAS picks its kernel by that count. CUDA loads a kernel on its first
        launch (lazy loading), and that waits until the GPU has finished everything queued:
        under asynchronous scheduling the host, which runs a whole pass ahead, then waits for
        that pass and the GPU for the host. On an H200 (Llama-3-8B, real ShareGPT run) the
        `aten::mm` of the logits blocked the host 15-245 ms at the first use of each new
        kernel, 0.3 ms otherwise (`scripts/step_trace.py`); the GPU sat idle 0.33 s of an
        fp8 run (`*_device_wait_seconds`). For Llama-3-8B up to 1,024 rows this costs about
        0.7 s of GPU work at start-up (by the roofline)."""
        hidden = torch.zeros(max_rows, self.config.hidden_size, dtype=self.dtype,
                             device=self.device)  # fmt: skip
        for rows in range(1, max_rows + 1):
            self.greedy_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    def greedy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits `greedy_tokens` takes the argmax of, in the model dtype (a
        tensor-parallel rank: its own vocabulary slice)."""
        return self.model.compute_logits(hidden, float32=False)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token id (int64, on the device) of each row of `hidden`, over the logits
        in the model dtype: float32 would give the same ids (an exact, order-keeping
        conversion) at the cost of a kernel that reads the logits and writes them twice as
        wide. `pagedattn_kernels.argmax_rows` is torch's argmax (ties, NaN) in a kernel that
        spreads a row over many programs on a GPU, where torch's reduction is latency-bound
        at decode batch sizes (`ARGMAX_KERNEL`). A tensor-parallel rank overrides this to
        reduce its vocabulary slice with the others'."""
        logits = self.greedy_logits(hidden)
        return argmax_rows(logits) if ARGMAX_KERNEL else logits.argmax(dim=-1)

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
            # pinned, not torch.tensor(..., device=...): that copy waits for the whole stream
            pairs = to_device(list(chain.from_iterable(copies)), self.device).view(-1, 2)
            copy_blocks(self.kv_cache, pairs)

    # ---- benchmark instrumentation --------------------------------------------------------
    def _log_pass(self, batch: StepBatch) -> None:
        qlens = [len(t) for t in batch.token_ids]
        total = sum(qlens)
        pairs = sum(q * s + q * (q + 1) // 2 for q, s in zip(qlens, batch.starts))
        self.step_log.append((total, len(qlens), sum(batch.starts) + total, pairs))

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
