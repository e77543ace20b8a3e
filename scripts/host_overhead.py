"""Host (CPU) time of one engine step in the steady decode state of a throughput run.

On a GPU the decode step of a large batch replays a CUDA graph; everything the host does
around it (schedule, fill the staging buffers, sample, update, engine bookkeeping) is time the
GPU waits. This script measures that host work alone, on the CPU: a tiny random Llama whose
forward pass is replaced by a no-op (a static hidden-state tensor), so what remains is the
engine's own Python and torch-on-host work.

By default the decode batches go through the CUDA-graph input path (`DecodeGraphs.replay`:
pinned staging rows, staged block tables, static buffers) with a stand-in "graph" whose replay
does nothing; `--eager` uses `build_inputs` instead (the path of `--enforce-eager` and of
mixed batches). `--async` steps as asynchronous scheduling does on a GPU (schedule ahead,
launch, then apply the step before).

    python scripts/host_overhead.py                      # 512 and 256 sequences, graph path
    python scripts/host_overhead.py --num-seqs 512 --profile   # plus cProfile of the steps

Prints, per batch size, the median milliseconds per step and their split:
schedule / execute (block operations and input preparation, `ModelRunner.run`) / sample /
update / engine (the rest of `LLMEngine.step`: the batch's lists, outputs, bookkeeping). The machine's noise only
adds time, so of several rounds the one with the lowest median is reported; compare two
versions of the code by running them alternately, more than once.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from phase_clock import PhaseClock

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.worker.cuda_graphs import DecodeGraphs
from pagedkv.engine.worker.model_runner import InFlightStep

# One layer, small hidden size and vocabulary: the model itself is never run in the timed
# steps, but building the engine and the logits stay cheap. max_model_len 2048 as the GPU
# throughput benchmark runs Llama-3-8B (block tables up to 128 blocks wide).
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}
PARTS = ("schedule", "execute", "sample", "update")


class _NoForward(torch.nn.Module):
    """Stands in for the model: a forward pass returns rows of a static random hidden state and
    the logits are rows of a static random tensor, so no transformer work is timed but the
    sampled tokens still vary from row to row."""

    def __init__(self, hidden_size: int, vocab_size: int, rows: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(rows, hidden_size, generator=gen)
        self.logits = torch.randn(rows, vocab_size, generator=gen)

    def forward(self, input_ids, positions, kv_caches, meta):
        n = input_ids.shape[0]
        if n > self.hidden.shape[0]:
            self.hidden = torch.randn(n, self.hidden.shape[1])
        return self.hidden[:n]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


class _NoReplay:
    """A captured graph whose replay does nothing (its output buffer is static)."""

    def replay(self) -> None:
        pass


def build_engine(folder: Path, max_num_seqs: int, eager: bool, overlap: bool) -> LLMEngine:
    args = EngineArgs(
        model=str(folder), load_format="dummy", device="cpu", skip_tokenizer_init=True,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, block_size=16,
        num_gpu_blocks_override=32768, async_scheduling=overlap,
        num_cpu_blocks_override=0, swap_space=0.0, seed=0,
    )
    engine = LLMEngine(args)
    engine.emit_partial_outputs = False  # as pagedkv.bench.throughput runs it
    runner = engine.runner
    stub = _NoForward(engine.model_config.hidden_size, engine.model_config.vocab_size,
                      max(max_num_seqs, runner.max_num_batched_tokens))
    runner.model = stub
    if not eager:
        graphs = DecodeGraphs(stub, runner.kv_caches, block_size=runner.block_size,
                              max_model_len=runner.max_model_len,
                              max_blocks_per_seq=runner.max_blocks_per_seq,
                              max_num_seqs=max_num_seqs, device=runner.device)
        static_hidden = stub.hidden[: graphs.sizes[-1]].clone()
        for b in graphs.sizes:
            graphs.graphs[b] = (_NoReplay(), static_hidden[:b])
        runner.graphs = graphs
    return engine


def _timers(engine: LLMEngine) -> PhaseClock:
    """The engine's per-step calls timed into `PARTS` (instance attributes, so the engine's own
    code calls the wrappers)."""
    timers = PhaseClock(PARTS)
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "schedule_ahead", "schedule")  # an AsyncScheduler
    timers.wrap(engine.runner, "run", "execute")
    timers.wrap(engine.runner, "sample", "sample")
    timers.wrap(InFlightStep, "result", "sample")
    timers.wrap(engine.scheduler, "update", "update")
    return timers


def measure(num_seqs: int, context: int, steps: int, rounds: int, eager: bool, overlap: bool,
            profile: bool, folder: Path) -> dict:
    """Median step time and split of `rounds` rounds of `steps` decode steps each; the round
    with the lowest median is reported (the machine's noise only ever adds time)."""
    engine = build_engine(folder, num_seqs, eager, overlap)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    total = steps * rounds
    # None finishes while timed: the batch stays the same 512 (or 256) sequences.
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True, detokenize=False)
    # Prompts of varied lengths (so that sequences cross block boundaries on different steps,
    # as in a real run), centred so that the timed steps see contexts of about `context`.
    first = max(context - total // 2, 41)
    for i in range(num_seqs):
        n = rng.randrange(first - 40, first + 1)
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(n)], params)
    sched = engine.scheduler
    while sched.num_waiting or any(
        s.num_computed_tokens < len(s.token_ids) - 1 for g in sched.running for s in g.seqs
    ):
        engine.step()  # prefills
    for _ in range(5):
        engine.step()  # warm-up decodes

    timers = _timers(engine)
    prof = cProfile.Profile() if profile else None
    clock = time.perf_counter
    best = None
    for _ in range(rounds):
        per_step: list[float] = []
        parts: list[dict[str, float]] = []
        for _ in range(steps):
            if prof is not None:
                prof.enable()
            t0 = clock()
            engine.step()
            elapsed = clock() - t0
            if prof is not None:
                prof.disable()
            split = timers.take()
            split["engine"] = elapsed - sum(split.values())
            per_step.append(elapsed)
            parts.append(split)
        med = statistics.median(per_step)
        if best is None or med < best[0]:
            best = (med, per_step, parts)
    assert sched.num_running == num_seqs and not sched.num_waiting, "not a steady decode state"
    med, per_step, parts = best

    # The sampling fast path's argmax runs on the device on a GPU (the host only launches it);
    # here it is CPU work, timed alone so that it can be told apart from the host work.
    logits = engine.runner.model.logits[:num_seqs]
    argmax = []
    for _ in range(steps):
        t0 = clock()
        logits.argmax(dim=-1)
        argmax.append(clock() - t0)

    split_ms = {k: 1e3 * statistics.median(p[k] for p in parts) for k in (*PARTS, "engine")}
    result = {"num_seqs": num_seqs,
              "path": ("eager" if eager else "graph") + ("+async" if overlap else ""),
              "median_step_ms": 1e3 * med, "min_step_ms": 1e3 * min(per_step),
              "argmax_ms": 1e3 * statistics.median(argmax),
              "split_median_ms": split_ms}
    result["host_step_ms"] = result["median_step_ms"] - result["argmax_ms"]
    if prof is not None:
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[512, 256])
    ap.add_argument("--context", type=int, default=300, help="tokens per sequence at the start")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds of --steps; the one with the lowest median is reported")
    ap.add_argument("--eager", action="store_true",
                    help="decode through _build_inputs, not the CUDA-graph staging path")
    ap.add_argument("--async", dest="overlap", action="store_true",
                    help="asynchronous scheduling, as on one GPU")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: the host work of one engine loop)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(TINY))
        for n in args.num_seqs:
            results.append(measure(n, args.context, args.steps, args.rounds, args.eager,
                                   args.overlap, args.profile, folder))
    head = f"{'seqs':>5} {'path':>12} {'median':>8} {'min':>7} {'argmax':>7} {'host':>7} | " + " ".join(
        f"{k:>9}" for k in (*PARTS, "engine"))
    print(head)
    for r in results:
        s = r["split_median_ms"]
        print(f"{r['num_seqs']:>5} {r['path']:>12} {r['median_step_ms']:>8.3f} "
              f"{r['min_step_ms']:>7.3f} {r['argmax_ms']:>7.3f} {r['host_step_ms']:>7.3f} | "
              + " ".join(f"{s[k]:>9.3f}" for k in (*PARTS, "engine")))
    print("milliseconds per step. host = median - argmax (the argmax is device work on a GPU, "
          "CPU work here; it is inside 'sample'). The split is the median of each part, so it "
          "need not add up exactly.")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
