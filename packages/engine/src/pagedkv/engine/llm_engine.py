"""`LLMEngine`: the scheduler, the model runner and the output processor composed into a step.

```
step():
  out = scheduler.schedule()              # who runs, how many tokens each, block operations
  result = runner.execute(out)            # swap/copy blocks, one forward pass, sample
  update = scheduler.update(out, samples) # append, fork, drop, stop checks, free blocks
  outputs = output_processor.process(...) # text, stop strings, logprobs -> RequestOutput
  observers(StepRecord)                   # metrics, tutorials: read-only
```

The engine holds no tensors: the runner (`pagedkv.engine.worker`) owns the model, the KV cache
and sampling, and hands back token ids. With asynchronous scheduling (on by default on one GPU)
`step` overlaps the host with the device for plain greedy batches (see `async_scheduling`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.async_scheduling import AsyncScheduling
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.distributed.executor import TensorParallelError, make_runner
from pagedkv.engine.input_processor import InputProcessor, PreparedRequest
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput, RunnerOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.step_record import ScheduledSeq, SeqBlocks, StepRecord
from pagedkv.engine.worker.model_runner import resolve_device
from pagedkv.scheduler import AsyncScheduler, RequestParams, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepRecord], None]


@dataclass(slots=True)
class EngineStats:
    """Counters for logs and the server's /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    gpu_kv_usage: float = 0.0
    cpu_kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0


def load_tokenizer(args: EngineArgs, model_config: ModelConfig):
    """The tokenizer, or None when the engine runs on token ids only (`skip_tokenizer_init`,
    or a bundled shape-only config, which has no tokenizer). The API process of a server loads
    its own with this, exactly as the engine core does."""
    if args.skip_tokenizer_init or (model_config.is_bundled_shape and not args.tokenizer):
        logger.info("no tokenizer: prompts must be token ids and outputs carry token ids only")
        return None
    if args.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    return model_config.get_tokenizer()


class LLMEngine:
    """One model, one KV cache, one scheduler; `step()` runs one iteration."""

    def __init__(self, args: EngineArgs, *, model=None) -> None:
        """`model`: an already loaded model of `args.model` to reuse (skips loading)."""
        self.args = args
        self.device = resolve_device(args.device)
        self.model_config = ModelConfig.from_model(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            load_format=args.load_format, device=self.device,
        )
        mc = self.model_config
        self.tokenizer = self._load_tokenizer()
        # tensor_parallel_size 1: a ModelRunner; more: rank 0 of a tensor-parallel group
        self.runner = make_runner(mc, args, self.device, model=model)
        # Asynchronous scheduling: on by default on a GPU, with one rank or several (a
        # tensor-parallel group computes the argmax on every rank, see distributed.executor).
        use_async = args.async_scheduling
        if use_async is None:
            use_async = self.device.type == "cuda"
        self.scheduler = (AsyncScheduler if use_async else Scheduler)(SchedulerConfig(
            block_size=args.block_size,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            max_model_len=mc.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode,
        ))
        self.eos_token_ids = sorted(mc.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self._primary_eos = tok_eos if tok_eos in mc.eos_token_ids else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        self.inputs = InputProcessor(
            self.tokenizer, vocab_size=mc.vocab_size, max_model_len=mc.max_model_len,
            kv_capacity=self.runner.num_gpu_blocks * args.block_size,
            max_num_seqs=args.max_num_seqs, eos_token_ids=self.eos_token_ids,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                       self.scheduler.finish_sequence)
        self._observers: list[StepObserver] = []
        self._table_observers: list[StepObserver] = []  # those that asked for block_tables
        self._num_steps = 0
        self._fatal: TensorParallelError | None = None  # set when a tensor-parallel rank died
        self._async = AsyncScheduling(self) if use_async else None
        if self.device.type == "cuda":
            # A full collection of Python's cyclic GC walks every tracked object: after loading
            # torch, transformers and a model that is hundreds of thousands, and a step stalls
            # for up to hundreds of milliseconds while the GPU waits. What is alive now lives as
            # long as the engine, so it is frozen out of collections (as vLLM does); objects
            # that requests create are still collected.
            gc.collect()
            gc.freeze()
        logger.info("engine ready: %s on %s, %d KV blocks of %d tokens",
                    mc.name, self.device, self.runner.num_gpu_blocks, args.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """The engine for `args` (vLLM's constructor name)."""
        return cls(args)

    def _load_tokenizer(self):
        return load_tokenizer(self.args, self.model_config)

    def get_tokenizer(self):
        """The Hugging Face tokenizer, or None when the engine runs on token ids only."""
        return self.tokenizer

    @property
    def emit_partial_outputs(self) -> bool:
        """Whether `step` returns running requests' cumulative outputs (streaming), or only
        finished ones (offline `LLM.generate`, which saves copying every live sequence)."""
        return self.outputs.emit_partial_outputs

    @emit_partial_outputs.setter
    def emit_partial_outputs(self, value: bool) -> None:
        self.outputs.emit_partial_outputs = value

    def shutdown(self) -> None:
        """Release what outlives the engine object: tensor-parallel workers and process groups
        (nothing to do on one device). Also done at garbage collection and interpreter exit."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @property
    def is_healthy(self) -> bool:
        """Whether the engine can run another step. False for good once a tensor-parallel
        rank is gone: noticed at once (a monitor thread watches the workers), also while no
        request runs. Cheap; safe to read from any thread (a server's /health)."""
        try:
            self.check_health()
        except TensorParallelError:
            return False
        return True

    def check_health(self) -> None:
        """Raise `TensorParallelError`, naming the rank that died, when the engine cannot run
        another step; return quietly otherwise. Safe to call from any thread."""
        if self._fatal is not None:
            raise self._fatal
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def fail(self, exc: TensorParallelError) -> None:
        """Stop the engine for good (a tensor-parallel rank died): every later step raises
        `exc`."""
        self._fatal = exc

    # ---- requests ---------------------------------------------------------------------------
    def prepare_request(self, prompt: str | Sequence[int], params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize a request without queueing it; raises `ValueError` naming the
        problem and changes nothing (see `input_processor`)."""
        if (isinstance(params, SamplingParams) and params.prompt_logprobs is not None
                and self.args.tensor_parallel_size > 1):
            raise ValueError("prompt_logprobs is not supported with tensor parallelism yet; "
                             "run with --tensor-parallel-size 1")
        return self.inputs.prepare(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate, tokenize and queue a request; its outputs come from `step()`.
        Raises `ValueError` (and queues nothing) for a bad request or an id in use."""
        self.add_prepared_request(
            request_id, self.prepare_request(prompt, params or SamplingParams()), arrival_time
        )

    def add_prepared_request(
        self, request_id: str, prep: PreparedRequest, arrival_time: float | None = None
    ) -> None:
        """Queue a request `prepare_request` already checked (the async server prepares off
        the engine's thread)."""
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        p = prep.params
        eos = self._primary_eos
        stop_ids = list(p.stop_token_ids or ())
        stop_ids += [t for t in self.eos_token_ids if t != eos and not p.ignore_eos]
        # Prompt logprobs need the logits of every prompt position: such a request takes no
        # cached prefix (a key of its own keeps its blocks apart), as in vLLM.
        extra_key = None
        if p.prompt_logprobs is not None and self.args.enable_prefix_caching:
            extra_key = ("prompt_logprobs", request_id)
        group = self.scheduler.add_request(request_id, prep.prompt_token_ids, RequestParams(
            n=p.beam_width if p.use_beam_search else p.best_of,
            max_tokens=prep.max_tokens,
            min_tokens=min(p.min_tokens, prep.max_tokens),
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            eos_token_id=eos,
            ignore_eos=p.ignore_eos,
        ), extra_key=extra_key)
        group.sampling = prep.sampling  # read by the runner, never by the scheduler
        self.outputs.add(request_id, prep, group,
                         arrival_time if arrival_time is not None else time.time())

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Abort requests in any state; their KV blocks are freed at once and each is reported
        finished ("abort") by the next step. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, or finished but not yet reported."""
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests whose final output `step()` has not returned yet."""
        return len(self.outputs)

    def get_stats(self) -> EngineStats:
        """Queue lengths, KV cache usage and token counters (O(blocks in use))."""
        s = self.scheduler.stats()
        kv = s.kv
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
            gpu_kv_usage=s.gpu_kv_usage, cpu_kv_usage=s.cpu_kv_usage,
            num_preemptions=s.num_preemptions, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_gpu_blocks=kv.gpu_total, num_cpu_blocks=kv.cpu_total,
        )

    def add_step_observer(
        self, observer: StepObserver, *, block_tables: bool = False
    ) -> Callable[[], None]:
        """Call `observer(StepRecord)` after every step that ran a batch; returns a function
        that removes it. Observers must not change the engine.

        `block_tables=True`: the records also carry every live sequence's blocks after the step
        (`StepRecord.block_tables`), a copy of O(blocks in use) per step that only such an
        observer pays for."""
        self._observers.append(observer)
        if block_tables:
            self._table_observers.append(observer)

        def remove() -> None:
            self._observers.remove(observer)
            if observer in self._table_observers:
                self._table_observers.remove(observer)

        return remove

    @property
    def observed(self) -> bool:
        """Whether a step observer is registered (steps are recorded only then)."""
        return bool(self._observers)

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; the `RequestOutput` of each request it touched (finished ones,
        and with `emit_partial_outputs` the running ones, cumulatively)."""
        if self._fatal is not None:
            raise self._fatal
        if self._async is not None:
            return self._async.step()
        return self.plain_step()

    def plain_step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> outputs, one after the other."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        now = time.time()
        results = self.outputs.finished_outside(out.finished, now)
        if out.is_empty:
            return results
        t1 = time.perf_counter()
        result = self.execute(out)
        if result is None:  # the batch failed and was aborted
            return results
        t2 = time.perf_counter()
        self.outputs.note_scheduled(out, now)
        samples = self.outputs.choose(out, result)
        update = self.scheduler.update(out, samples)
        t3 = time.perf_counter()
        results += self.outputs.process(out, result, samples, update, time.time())
        if self._observers:
            self.observe(out, samples, update, results,
                         schedule=t1 - t0, execute=t2 - t1, update=t3 - t2,
                         output=time.perf_counter() - t3)
        return results

    def execute(self, out) -> RunnerOutput | None:
        """The runner's step. One bad batch must not wedge the engine: on an error its
        requests end as aborted (blocks freed) and None is returned; a dead tensor-parallel
        rank stops the engine for good."""
        try:
            return self.runner.execute(out)
        except TensorParallelError as exc:
            self.fail(exc)
            raise
        except Exception:
            self.abort_batch(out)
            return None

    def abort_batch(self, out) -> None:
        """Abort every request of a batch that could not run (call from an `except` block)."""
        logger.exception("step failed; aborting the %d requests of this batch", len(out.request_ids))
        for rid in out.request_ids:
            self.scheduler.abort(rid)
        self.scheduler.update(out, {})

    def observe(self, out, samples, update, results, /, *, tables=None, **timings: float) -> None:
        """Tell the step observers what the step did (a `StepRecord`). The first four are
        positional-only: the timings have the phases' names, `update` among them. `tables`:
        the scheduled sequences' block tables as the step launched with them (asynchronous
        scheduling has grown kvblocks' lists for the next step by now); None: read them now."""
        self._num_steps += 1
        sched = self.scheduler
        record = StepRecord(
            step=self._num_steps,
            scheduled=tuple(ScheduledSeq(ss.seq_id, ss.request_id, ss.start, ss.num_tokens,
                                         ss.is_prefill, ss.do_sample,
                                         tables[i] if tables is not None else tuple(ss.block_table))
                            for i, ss in enumerate(out.scheduled)),
            blocks_to_swap_out=tuple(out.blocks_to_swap_out),
            blocks_to_swap_in=tuple(out.blocks_to_swap_in),
            blocks_to_copy=tuple(out.blocks_to_copy),
            preempted=tuple((rid, str(mode)) for rid, mode in out.preempted),
            sampled={k: list(v) for k, v in samples.items()},
            forks=tuple(update.forks),
            finished=tuple(r.request_id for r in results if r.finished),
            num_free_blocks=sched.block_manager.num_free_blocks,
            num_gpu_blocks=sched.config.num_gpu_blocks,
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_swapped=sched.num_swapped,
            timings=timings,
            num_free_cpu_blocks=sched.block_manager.cpu_pool.num_free,
            num_cpu_blocks=sched.config.num_cpu_blocks,
            block_tables=self._block_tables() if self._table_observers else (),
        )
        for fn in list(self._observers):
            fn(record)

    def _block_tables(self) -> tuple[SeqBlocks, ...]:
        """Every live sequence's blocks now (running, then swapped groups)."""
        sched = self.scheduler
        bm = sched.block_manager
        return tuple(
            SeqBlocks(seq.seq_id, group.request_id, bm.num_slots(seq.seq_id),
                      bm.location(seq.seq_id), tuple(bm.block_table_ref(seq.seq_id)))
            for group in (*sched.running, *sched.swapped)
            for seq in group.seqs
            if not seq.is_finished and bm.has_seq(seq.seq_id)
        )
