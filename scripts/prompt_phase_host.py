"""The host side of an offline run's first steps, on the CPU: which scheduling path each step
takes and how long the host works on it, with the model's forward pass replaced by a no-op.

Why: in the real-ShareGPT runs on an H200 (1,000 requests admitted at once, 16,384-token
passes) the prompt passes' steps take 5-35 ms more wall time than their passes take on the
device, and now and then a step returns early and the next one waits for two passes
(`mixed_pass_trace`, `docs/performance/gpu_runs/2026-12-03d/`). If a prompt step fell back to
the plain path (apply the pass in flight, then schedule), the device would wait for the whole
of the host's work on it. This script shows, for the same requests and engine limits, whether
each step was scheduled ahead (`schedule_ahead`) or not (`schedule`), and the host time of
scheduling and of preparing and launching the pass (`run`, forward pass excluded).

    python scripts/prompt_phase_host.py --requests .gpu_data/sharegpt_1000.json --steps 24

The requests' token ids are folded into the stand-in model's vocabulary; lengths are kept.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from host_overhead import TINY, _NoForward
from phase_clock import PhaseClock

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", required=True,
                    help="a JSON file of requests (prompt_token_ids, output_len), as "
                         "`bench throughput --dataset` reads")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--num-blocks", type=int, default=117_667,
                    help="KV blocks (117,667: the fp8 cache of Llama-3-8B on an H200)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = ap.parse_args()

    data = json.loads(Path(args.requests).read_text())
    reqs = (data.get("requests", []) if isinstance(data, dict) else data)[: args.num_prompts]
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine(EngineArgs(
        model=str(folder), load_format="dummy", device="cpu", skip_tokenizer_init=True,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=16, max_model_len=2048, num_gpu_blocks_override=args.num_blocks,
        async_scheduling=True, num_cpu_blocks_override=0, swap_space=0.0, seed=0,
    ))  # fmt: skip
    engine.emit_partial_outputs = False
    runner = engine.runner
    runner.model = _NoForward(TINY["hidden_size"], TINY["vocab_size"],
                              max(args.max_num_seqs, args.max_num_batched_tokens))  # fmt: skip
    clock = PhaseClock()
    for name in ("schedule", "schedule_ahead"):
        clock.wrap(engine.scheduler, name, name)
    clock.wrap(runner, "run", "run")
    runner.step_log = []  # the launched pass's (tokens, seqs, kv tokens, pairs)
    vocab = TINY["vocab_size"]
    for i, r in enumerate(reqs):
        ids = [int(t) % vocab for t in r["prompt_token_ids"]]
        engine.add_request(f"r{i}", ids, SamplingParams(
            max_tokens=int(r["output_len"]), temperature=0.0, ignore_eos=True, detokenize=False))
    print("step  wall ms  tokens  phases (ms; schedule: the plain path, schedule_ahead: ahead)")
    for step in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        tokens = sum(p[0] for p in runner.step_log)
        runner.step_log.clear()
        phases = "  ".join(f"{n} {s * 1e3:.1f}" for n, s in clock.take().items() if s)
        print(f"{step:4d}  {wall * 1e3:7.1f}  {tokens:6d}  {phases}")


if __name__ == "__main__":
    main()
