"""`LLMEngine`: the scheduler, the model runner and the sampler composed into one step.

```
step():
  out = scheduler.schedule()            # who runs, how many tokens each, block ops
  logits = runner.execute(out)          # swap/copy blocks, one forward pass
  tokens = sampler(logits)              # (beam search: pick beams from candidates)
  scheduler.update(out, tokens)         # append, fork, drop, stop checks, free blocks
  -> RequestOutput per request touched  # text detokenized incrementally, stop strings cut
```

With asynchronous scheduling (on by default on one GPU; `--async-scheduling`) a step of
plain greedy requests overlaps the host with the device: it builds and launches step N+1
(`scheduler.schedule_ahead`, input tokens read on the device from step N's argmax) before it
waits for step N's tokens and applies them. Any other request, a lack of free blocks or swapped
requests make the engine finish the step in flight and run the plain loop above.

The engine keeps, per sequence, what the scheduler does not need: the incremental
detokenizer, the seeded generator, log-probabilities. Everything a user can get wrong is
checked in `prepare_request`, before anything is queued, so a bad request raises
`ValueError` and the engine keeps serving the others.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.beam_search import Beam, BeamSearch
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize
from pagedkv.engine.distributed.executor import TensorParallelError, make_runner
from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedkv.engine.runner import ModelRunner, PendingTokens
from pagedkv.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    child_seed,
    make_generator,
)
from pagedkv.engine.sampling_params import SamplingParams, SamplingType
from pagedkv.scheduler import (
    AsyncScheduler,
    FinishReason,
    RequestParams,
    Scheduler,
    SchedulerConfig,
)

logger = logging.getLogger(__name__)

_FINISH_TEXT = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.REJECTED: "abort",
}


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


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request that can be queued without further checks."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as the user gave them
    internal_params: SamplingParams  # what the sampler uses (may ask for logprobs internally)
    max_tokens: int
    # plain greedy (one sequence, no logprobs, penalties or min_tokens): an argmax is all the
    # sampling it needs, so a batch of only these skips building a SamplingBatch
    argmax_only: bool = False


@dataclass(slots=True)
class _SeqState:
    index: int
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    logprobs: list | None
    cum_logprob: float = 0.0


def _sample_indices(out) -> list[int]:
    """Positions in `out.scheduled` of the sequences that sample this step."""
    sched = out.scheduled
    if out.num_samples == len(sched):
        return list(range(len(sched)))
    return [k for k, ss in enumerate(sched) if ss.do_sample]


@dataclass(slots=True)
class _InFlight:
    """A launched step whose tokens are not applied yet (asynchronous scheduling)."""

    out: object  # pagedkv.scheduler.SchedulerOutput
    sample_idx: list[int]
    tokens: torch.Tensor  # argmax per sampled row, on the device
    host: torch.Tensor  # where they are copied (pinned on a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: already there)
    rows: dict[int, int]  # seq_id -> row of `tokens`


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prep: PreparedRequest
    group: object  # pagedkv.scheduler.SequenceGroup
    metrics: RequestMetrics
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    beam: BeamSearch | None = None
    forked: bool = False


class LLMEngine:
    """One model, one KV cache, one scheduler; `step()` runs one iteration."""

    def __init__(self, args: EngineArgs, *, model: torch.nn.Module | None = None) -> None:
        """`model`: an already loaded model of `args.model` to reuse (skips loading)."""
        self.args = args
        if args.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            if args.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("device='cuda' but no CUDA GPU is available; use --device cpu")
            self.device = torch.device(args.device)
        self.model_config = ModelConfig.from_model(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            load_format=args.load_format, device=self.device,
        )
        self.tokenizer = self._load_tokenizer()
        torch.manual_seed(args.seed)
        # tensor_parallel_size 1: a ModelRunner; more: rank 0 of a tensor-parallel group
        self.runner = make_runner(self.model_config, args, self.device, model=model)
        mc = self.model_config
        # Asynchronous scheduling: only with a runner of this process (not tensor-parallel).
        self._async = isinstance(self.runner, ModelRunner) and (
            args.async_scheduling if args.async_scheduling is not None
            else self.device.type == "cuda")
        self.scheduler = (AsyncScheduler if self._async else Scheduler)(SchedulerConfig(
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
        self.sampler = Sampler()
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(args.seed)
        self.eos_token_ids = sorted(mc.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self._primary_eos = tok_eos if tok_eos in mc.eos_token_ids else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        self._requests: dict[str, _RequestState] = {}
        # Live requests that need more than an argmax (sampling, logprobs, beams...): while there
        # are none, a batch takes the argmax path without looking at each of its requests.
        self._num_not_argmax = 0
        self._fatal: TensorParallelError | None = None  # set when a tensor-parallel rank died
        # Streaming callers want every request's cumulative output after each step; offline
        # callers only the finished ones, and building the rest costs a copy of every live
        # sequence's tokens per step.
        self.emit_partial_outputs = True
        self._inflight: _InFlight | None = None
        if self._async:
            pin = self.device.type == "cuda"
            self._token_hosts = [torch.zeros(args.max_num_seqs, dtype=torch.long, pin_memory=pin)
                                 for _ in range(2)]
            self._token_turn = 0
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
        return cls(args)

    def _load_tokenizer(self):
        """The tokenizer, or None when the engine runs on token ids only (`skip_tokenizer_init`,
        or a bundled shape-only config, which has no tokenizer)."""
        if self.args.skip_tokenizer_init or (self.model_config.is_bundled_shape and not self.args.tokenizer):
            logger.info("no tokenizer: prompts must be token ids and outputs carry token ids only")
            return None
        if self.args.tokenizer:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.args.tokenizer)
        return self.model_config.get_tokenizer()

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Release what outlives the engine object: tensor-parallel workers and process groups
        (nothing to do on one device). Also done at garbage collection and interpreter exit."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def prepare_request(self, prompt: str | Sequence[int], params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize; raises `ValueError` naming the problem, changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        mc = self.model_config
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(
                "this engine runs without a tokenizer (--skip-tokenizer-init): give the prompt as "
                "a list of token ids"
            )
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need a tokenizer, and this engine runs without one "
                "(--skip-tokenizer-init): use stop_token_ids"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token")
            ids = list(self.tokenizer(prompt).input_ids)
            text: str | None = prompt
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = list(prompt)
            text = None
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < mc.vocab_size:
                    raise ValueError(
                        f"prompt token id {t!r} is not an int in [0, {mc.vocab_size}) "
                        "(the model's vocabulary)"
                    )
        else:
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty; give at least one character or token")
        if len(ids) + 1 > mc.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; with at least one generated token that is "
                f"longer than max_model_len={mc.max_model_len}; shorten the prompt"
            )
        capacity = self.runner.num_gpu_blocks * self.args.block_size
        if len(ids) + 1 > capacity:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the whole KV cache holds {capacity}; "
                "shorten the prompt or give the KV cache more memory"
            )
        if params.beam_width > self.args.max_num_seqs:
            raise ValueError(
                f"best_of/beam width {params.beam_width} exceeds max_num_seqs={self.args.max_num_seqs}"
            )
        max_tokens = mc.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        internal = params
        if self.tokenizer is None and params.detokenize:
            internal = params.clone()
            internal.detokenize = False
        if params.best_of > params.n and not params.use_beam_search and params.logprobs is None:
            internal = internal.clone() if internal is params else internal
            internal.logprobs = 0  # choosing the best n needs each token's logprob
        argmax_only = (
            internal.sampling_type == SamplingType.GREEDY
            and internal.best_of == 1
            and internal.logprobs is None
            and internal.min_tokens == 0
            and not internal.needs_penalties
        )
        return PreparedRequest(text, ids, params, internal, max_tokens, argmax_only)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.add_prepared_request(
            request_id, self.prepare_request(prompt, params or SamplingParams()), arrival_time
        )

    def add_prepared_request(
        self, request_id: str, prep: PreparedRequest, arrival_time: float | None = None
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        p = prep.params
        eos = self._primary_eos
        stop_ids = list(p.stop_token_ids or ())
        stop_ids += [t for t in self.eos_token_ids if t != eos and not p.ignore_eos]
        rp = RequestParams(
            n=p.beam_width if p.use_beam_search else p.best_of,
            max_tokens=prep.max_tokens,
            min_tokens=min(p.min_tokens, prep.max_tokens),
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            eos_token_id=eos,
            ignore_eos=p.ignore_eos,
        )
        now = time.time()
        group = self.scheduler.add_request(request_id, prep.prompt_token_ids, rp,
                                           arrival_time=None)
        st = _RequestState(request_id, prep, group,
                           RequestMetrics(arrival_time=arrival_time if arrival_time is not None else now))
        first = group.seqs[0] if group.seqs else group.finished_seqs[0]
        st.seqs[first.seq_id] = self._new_seq_state(prep, 0)
        if p.use_beam_search:
            st.beam = BeamSearch.from_params(p, self.eos_token_ids, max_tokens=prep.max_tokens)
        self._requests[request_id] = st
        self._num_not_argmax += not prep.argmax_only

    def _pop_request(self, request_id: str) -> _RequestState | None:
        """Forget a finished request (None when it is not known)."""
        st = self._requests.pop(request_id, None)
        if st is not None:
            self._num_not_argmax -= not st.prep.argmax_only
        return st

    def _new_seq_state(self, prep: PreparedRequest, index: int) -> _SeqState:
        p = prep.internal_params
        gen = make_generator(child_seed(p.seed, index), self.device) if p.seed is not None else None
        detok = None
        # Without text (detokenize=False, or no tokenizer) there is nothing for a detokenizer to
        # do: stop tokens and EOS are the scheduler's, and stop strings need text.
        if not p.use_beam_search and p.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prep.prompt_token_ids, p,
                                           eos_token_ids=self.eos_token_ids)
        return _SeqState(index, detok, gen, [] if p.logprobs is not None else None)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_stats(self) -> EngineStats:
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

    # ---- one iteration ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self._fatal is not None:
            raise self._fatal
        if self._async:
            return self._step_async()
        return self._step_sync()

    def _report_finished(self, out, now: float, results: list[RequestOutput]) -> None:
        for g in out.finished:  # rejected, aborted, or ended for lack of memory
            st = self._pop_request(g.request_id)
            if st is not None:
                st.metrics.finished_time = now
                results.append(self._final_output(st))

    def _step_sync(self, results: list[RequestOutput] | None = None) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.time()
        results = [] if results is None else results
        self._report_finished(out, now, results)
        if out.is_empty:
            return results

        sched = out.scheduled
        sample_idx = _sample_indices(out)
        touched: dict[str, _RequestState] = {}
        try:
            argmax_only = self._argmax_only(sched, sample_idx)
            self.runner.apply_block_ops(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
            logits = self.runner.execute(
                # ss.token_ids, inlined: a property call per sequence costs as much as the slice
                [(ss.all_token_ids[ss.start : ss.start + ss.num_tokens], ss.start, ss.block_table)
                 for ss in sched],
                sample_idx,
            )
            if argmax_only:
                samples, fed = self._sample_argmax(sched, sample_idx, logits)
            else:
                samples, pending, beam_done = self._sample(out, sample_idx, logits, touched)
        except TensorParallelError as exc:
            self._fatal = exc  # a tensor-parallel rank died: the engine cannot go on
            raise
        except Exception:
            self._abort_batch(out)
            return results
        self._note_scheduled(out, now)
        if argmax_only:
            self.scheduler.update(out, samples)
            self._after_argmax_update(fed, time.time(), results)
            return results

        owner = {sched[k].seq_id: touched[sched[k].request_id] for k in sample_idx}
        result = self.scheduler.update(out, samples)
        now = time.time()

        # Forked children start as copies of their parent before its new token.
        fork_count: dict[int, int] = {}
        for parent, child in result.forks:
            st = owner[parent]
            owner[child] = st
            k = fork_count.get(parent, 0) + 1
            fork_count[parent] = k
            pst = st.seqs[parent]
            seq = self._seq(st, child)
            cst = _SeqState(
                seq.index,
                pst.detok.clone() if pst.detok is not None else None,
                make_generator(child_seed(st.prep.internal_params.seed, seq.index), self.device)
                if st.prep.internal_params.seed is not None else None,
                list(pst.logprobs) if pst.logprobs is not None else None,
                pst.cum_logprob,
            )
            st.seqs[child] = cst
            pending[child] = [pending[parent][k]]
            st.forked = True

        for seq_id, entries in pending.items():
            tok, lp, cum = entries[0]
            st = owner[seq_id]
            sst = st.seqs[seq_id]
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.metrics.last_token_time = now
            if cum is not None:
                sst.cum_logprob = cum
            elif lp is not None:
                sst.cum_logprob += lp.logprob
            if sst.logprobs is not None and lp is not None and st.prep.params.logprobs is not None:
                sst.logprobs.append(lp.to_dict())
            if sst.detok is not None:
                self._detokenize(seq_id, sst, tok)
        for rid in beam_done:
            st = self._requests.get(rid)
            if st is not None:
                touched[rid] = st

        for rid, st in touched.items():
            g = st.group
            if g.is_finished:
                st.metrics.finished_time = now
                if st.beam is not None and not st.beam.done:
                    st.beam.finish(self._live_beams(st))
                self._pop_request(rid)
                results.append(self._final_output(st))
            elif st.beam is None and self.emit_partial_outputs:
                results.append(self._output(st, finished=False))
        return results

    def _step_async(self) -> list[RequestOutput]:
        """One step with the host overlapped with the device (see the module docstring):
        launch the next pass, then apply the one in flight."""
        results: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        sched = self.scheduler
        if prev is not None and not self._num_not_argmax and sched.can_schedule_ahead():
            out = sched.schedule_ahead()
        else:
            if prev is not None:
                self._apply_inflight(prev, results)
                prev = None
            if self._num_not_argmax:  # sampling, logprobs, beams...: the plain loop
                return self._step_sync(results)
            out = sched.schedule()
        now = time.time()
        self._report_finished(out, now, results)
        if not out.is_empty:
            try:
                self._inflight = self._launch(out, prev)
            except Exception:
                if prev is not None:
                    self._apply_inflight(prev, results)
                self._abort_batch(out)
                return results
            self._note_scheduled(out, now)
        if prev is not None:
            self._apply_inflight(prev, results)
        if self._inflight is not None and not sched.has_unfinished():
            # Every request ended with the step just applied: the pass in flight only computed
            # rows to be ignored. Apply it now, so that the scheduler is idle between calls.
            last, self._inflight = self._inflight, None
            self._apply_inflight(last, results)
        return results

    def _abort_batch(self, out) -> None:
        """One bad batch must not wedge the engine: its requests end as aborted (their blocks
        freed) and the others go on at the next step. Call from an `except` block."""
        logger.exception("step failed; aborting the %d requests of this batch", len(out.request_ids))
        for rid in out.request_ids:
            self.scheduler.abort(rid)
        self.scheduler.update(out, {})

    def _launch(self, out, prev: _InFlight | None) -> _InFlight:
        """Run `out`'s block operations and forward pass, and start its argmax and the copy
        of the tokens to the host, without waiting for them."""
        sched = out.scheduled
        sample_idx = _sample_indices(out)
        seqs = []
        pending_rows: list[int] = []
        sources: list[int] = []
        row = 0
        for ss in sched:
            toks = ss.all_token_ids[ss.start : ss.start + ss.num_tokens]
            if len(toks) < ss.num_tokens:  # its last token is prev's, still on the device
                pending_rows.append(row + ss.num_tokens - 1)
                sources.append(prev.rows[ss.seq_id])
                toks.append(0)
            seqs.append((toks, ss.start, ss.block_table))
            row += ss.num_tokens
        pending = PendingTokens(pending_rows, sources, prev.tokens) if pending_rows else None
        runner = self.runner
        runner.apply_block_ops(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        logits = runner.execute(seqs, sample_idx, pending)
        tokens = logits.argmax(dim=-1)
        n = len(sample_idx)
        turn = self._token_turn
        self._token_turn = 1 - turn
        host = self._token_hosts[turn][:n]
        ready = None
        if tokens.is_cuda:
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host.copy_(tokens)
        rows = {sched[k].seq_id: r for r, k in enumerate(sample_idx)}
        return _InFlight(out, sample_idx, tokens, host, ready, rows)

    def _apply_inflight(self, f: _InFlight, results: list[RequestOutput]) -> None:
        """Wait for a launched step's tokens and apply them (update, outputs). Requests that
        ended since it was launched (aborted, or stopped by the step before) are skipped."""
        if f.ready is not None:
            f.ready.synchronize()
        samples, fed = self._argmax_samples(f.out.scheduled, f.sample_idx, f.host.tolist())
        self.scheduler.update(f.out, samples)
        self._after_argmax_update(fed, time.time(), results)

    def _note_scheduled(self, out, now: float) -> None:
        """Queue time of the requests scheduled for the first time, preemption counts."""
        requests = self._requests
        for ss in out.scheduled:
            # A request's first chunk computes (part of) its prompt: plain decodes are skipped.
            if ss.is_prefill:
                m = requests[ss.request_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
                    m.time_in_queue = now - m.arrival_time
        for name, _mode in out.preempted:
            st = requests.get(name)
            if st is not None:
                st.metrics.num_preemptions += 1

    def _detokenize(self, seq_id: int, sst: _SeqState, tok: int) -> None:
        """Feed a new token to the sequence's detokenizer; a stop string ends the sequence."""
        sst.detok.add_tokens([tok])
        if isinstance(sst.detok.stop_reason, str):
            seq = self.scheduler.get_sequence(seq_id)  # None once finished
            if seq is not None:
                seq.stop_reason = sst.detok.stop_reason
                self.scheduler.finish_sequence(seq_id, FinishReason.STOP)

    def _after_argmax_update(self, fed, now: float, results: list[RequestOutput]) -> None:
        """What `step` does after `update` for an argmax-only batch, in one pass: token times,
        detokenization and stop strings, outputs. `fed`: (request, sequence id, token) per
        sampled sequence; an argmax-only request has one sequence, which never forks."""
        emit = self.emit_partial_outputs
        for st, seq_id, tok in fed:
            m = st.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            sst = st.seqs[seq_id]
            if sst.detok is not None:
                self._detokenize(seq_id, sst, tok)
            if st.group.is_finished:
                m.finished_time = now
                self._pop_request(st.request_id)
                results.append(self._final_output(st))
            elif emit:
                results.append(self._output(st, finished=False))

    def _seq(self, st: _RequestState, seq_id: int):
        for s in st.group.seqs:
            if s.seq_id == seq_id:
                return s
        for s in st.group.finished_seqs:
            if s.seq_id == seq_id:
                return s
        return None

    def _live_beams(self, st: _RequestState) -> list[Beam]:
        return [Beam(s.seq_id, s.token_ids[s.prompt_len:], st.seqs[s.seq_id].cum_logprob)
                for s in st.group.seqs]

    def _argmax_only(self, sched, sample_idx: list[int]) -> bool:
        """Whether every sampling sequence of the batch is plain greedy (see PreparedRequest)."""
        if self._num_not_argmax == 0:
            return True
        requests = self._requests
        return all(requests[sched[k].request_id].prep.argmax_only for k in sample_idx)

    def _sample_argmax(self, sched, sample_idx, logits):
        """The throughput path: one argmax on the device, one copy of the ids to the host."""
        return self._argmax_samples(sched, sample_idx, logits.argmax(dim=-1).tolist())

    def _argmax_samples(self, sched, sample_idx, tokens: list[int]):
        """(samples for scheduler.update, (request, sequence id, token) per sequence) of an
        argmax-only batch. Requests that ended since the batch was scheduled (aborted, or, with
        asynchronous scheduling, stopped by the step before) are left out."""
        requests = self._requests
        samples: dict[int, list[int]] = {}
        fed = []
        for k, tok in zip(sample_idx, tokens):
            ss = sched[k]
            st = requests.get(ss.request_id)
            if st is not None and not st.group.is_finished:
                samples[ss.seq_id] = [tok]
                fed.append((st, ss.seq_id, tok))
        return samples, fed

    def _sample(self, out, sample_idx, logits, touched):
        """Sample every row; returns (samples for scheduler.update, per-sequence pending
        (token, logprobs, new cumulative logprob or None), requests whose beam search ended)."""
        sched, seqs = out.scheduled, out.seqs
        samples: dict[int, list[int]] = {}
        pending: dict[int, list] = {}
        rows: list[SamplingRow] = []
        for k in sample_idx:
            ss, seq = sched[k], seqs[k]
            st = self._requests[ss.request_id]
            touched[ss.request_id] = st
            sst = st.seqs[ss.seq_id]
            p = st.prep.internal_params
            num = 1
            if (not p.use_beam_search and p.best_of > 1 and not st.forked
                    and seq.num_output_tokens == 0):
                num = p.best_of
            rows.append(SamplingRow(p, st.group.prompt_token_ids,
                                    seq.token_ids[seq.prompt_len:] if p.needs_penalties else (),
                                    sst.generator, num))
        beam_done: list[str] = []
        if not rows:
            return samples, pending, beam_done
        batch = SamplingBatch(rows, vocab_size=logits.shape[1], device=logits.device,
                              eos_token_ids=self.eos_token_ids, generator=self._generator)
        sout = self.sampler(logits, batch)
        beam_rows: dict[str, list[tuple[int, object]]] = {}
        for r, k in enumerate(sample_idx):
            ss = sched[k]
            rs = sout.rows[r]
            st = self._requests[ss.request_id]
            if st.beam is not None:
                beam_rows.setdefault(ss.request_id, []).append((ss.seq_id, rs))
                continue
            samples[ss.seq_id] = rs.token_ids
            lps = rs.logprobs or [None] * len(rs.token_ids)
            pending[ss.seq_id] = [(t, lp, None) for t, lp in zip(rs.token_ids, lps)]
        for rid, items in beam_rows.items():
            st = self._requests[rid]
            live = {s.seq_id: s for s in st.group.seqs}
            beams, cands = [], []
            for seq_id, rs in items:
                s = live[seq_id]
                beams.append(Beam(seq_id, s.token_ids[s.prompt_len:], st.seqs[seq_id].cum_logprob))
                cands.append((rs.beam_token_ids, rs.beam_logprobs))
            res = st.beam.step(beams, cands)
            if res.done:
                for seq_id, _ in items:
                    samples[seq_id] = []
                beam_done.append(rid)
                continue
            plan = res.fork_plan([seq_id for seq_id, _ in items])
            for seq_id, _ in items:
                samples[seq_id] = []
            for c in plan.continues + plan.forks:
                samples[c.parent_seq_id].append(c.token_id)
                pending.setdefault(c.parent_seq_id, []).append((c.token_id, None, c.cum_logprob))
        return samples, pending, beam_done

    # ---- outputs ------------------------------------------------------------------------------
    def _completion(self, st: _RequestState, seq, final: bool) -> CompletionOutput:
        sst = st.seqs.get(seq.seq_id)
        tokens = seq.token_ids[seq.prompt_len:]
        finish = None
        stop_reason = None
        if seq.is_finished:
            finish = _FINISH_TEXT[seq.finish_reason]
            stop_reason = seq.stop_reason
        text = ""
        if sst is not None and sst.detok is not None:
            if seq.is_finished and not sst.detok.finished:
                sst.detok.finish(finish or "abort", stop_reason)
            text = sst.detok.text if (final or seq.is_finished) else sst.detok.visible_text
        want_lp = st.prep.params.logprobs is not None
        return CompletionOutput(
            index=sst.index if sst else seq.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=sst.cum_logprob if sst else None,
            logprobs=list(sst.logprobs) if (want_lp and sst and sst.logprobs is not None) else None,
            finish_reason=finish,
            stop_reason=stop_reason,
        )

    def _output(self, st: _RequestState, finished: bool) -> RequestOutput:
        g = st.group
        comps = [self._completion(st, s, finished) for s in g.all_seqs()]
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                             finished, st.metrics)

    def _final_output(self, st: _RequestState) -> RequestOutput:
        p = st.prep.params
        g = st.group
        if st.beam is not None and st.beam.hypotheses:
            comps = []
            for i, h in enumerate(st.beam.results()[: p.n]):
                text = detokenize(self.tokenizer, st.prep.prompt_token_ids, h.output_token_ids, p,
                                  eos_token_ids=self.eos_token_ids).text if (
                                      p.detokenize and self.tokenizer is not None) else ""
                comps.append(CompletionOutput(i, text, list(h.output_token_ids), h.cum_logprob, None,
                                              h.finish_reason,
                                              h.stop_token_id))
            return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps,
                                 True, st.metrics)
        comps = [self._completion(st, s, True) for s in g.all_seqs()]
        if g.finish_reason is FinishReason.ABORTED or g.finish_reason is FinishReason.REJECTED:
            for c in comps:
                c.finish_reason = "abort"
        if p.best_of > p.n and not p.use_beam_search:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            comps = comps[: p.n]
            for i, c in enumerate(comps):
                c.index = i
        return RequestOutput(st.request_id, st.prep.prompt, st.prep.prompt_token_ids, comps, True,
                             st.metrics)
