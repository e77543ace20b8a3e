"""Throughput cost of structured output on the GPU: 256 sequences, 10% of them under a JSON
schema, against the same requests with none constrained, in the same run (issue 18: loss <= 5%).

Llama-3-8B's shape with random weights (`--load-format dummy`), greedy decoding, fixed
prompt and output lengths (`ignore_eos`), so both workloads generate exactly the same number of
tokens; the grammar uses the embedded model's tokenizer (SmolLM2, 49,152 tokens; the ids above
it are never allowed). The two workloads alternate `--rounds` times on one engine; each one's
best round is reported. Prints a table and one line of JSON.

The embedded GGUF cannot travel to the GPU machine, so export its tokenizer first (a few MB)
and carry that folder with the wheels the machine lacks (llguidance has no dependencies):

    python scripts/gpu_structured_output.py --export-tokenizer .gpu_tok      # here
    pip download --only-binary=:all: --no-deps --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d .whl llguidance==1.9.1           # here
    source scripts/gpu_env.sh && python3 scripts/gpu_structured_output.py --tokenizer .gpu_tok

`--smoke` runs a tiny random model on the CPU instead (checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from phase_clock import PhaseClock

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "text": {"type": "string"},
                               "ok": {"type": "boolean"}},
                "required": ["id", "text", "ok"],
            },
        },
    },
    "required": ["items"],
}

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128256, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
}


def export_tokenizer(folder: str) -> None:
    from pagedkv.engine.config import ModelConfig

    tok = ModelConfig.from_model(None, device="cpu").get_tokenizer()
    tok.save_pretrained(folder)
    size = sum(p.stat().st_size for p in Path(folder).iterdir())
    print(f"saved the embedded model's tokenizer to {folder} ({size / 1e6:.1f} MB)")


def run_once(engine, prompts, params, times: PhaseClock | None = None
             ) -> tuple[float, int, dict]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{time.monotonic_ns()}-{i}", p, sp)
    ahead0 = getattr(engine.scheduler, "num_scheduled_ahead", 0)
    if times is not None:
        times.take()
    steps = []
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
        steps.append(time.perf_counter() - ts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    detail = {
        "steps": len(steps),
        "scheduled_ahead": getattr(engine.scheduler, "num_scheduled_ahead", 0) - ahead0,
        "median_step_ms": round(1e3 * sorted(steps)[len(steps) // 2], 3) if steps else None,
        "finish_ms_per_step": round(1e3 * (times.take().get("finish", 0.0) if times else 0.0)
                                    / max(len(steps), 1), 3),
    }
    return secs, tokens, detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="folder of the embedded model's tokenizer")
    ap.add_argument("--export-tokenizer", metavar="DIR", help="save it there and exit")
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--fraction", type=float, default=0.1, help="share of constrained requests")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU")
    args = ap.parse_args()
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return

    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams
    from pagedkv.engine.structured import StructuredOutputsParams
    from pagedkv.engine.worker.model_runner import InFlightStep

    tmp = tempfile.TemporaryDirectory()
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = os.path.join(tmp.name, "tok")
        export_tokenizer(tokenizer)
    model = args.model
    opts = dict(load_format="dummy", tokenizer=tokenizer, max_num_seqs=args.num_seqs,
                max_model_len=2048, max_num_batched_tokens=8192, seed=0)
    if args.smoke:
        folder = Path(tmp.name) / "tiny"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(TINY))
        model = str(folder)
        opts.update(device="cpu", num_gpu_blocks_override=4096, swap_space=0.0)
    else:
        opts.update(dtype="bfloat16", gpu_memory_utilization=0.9)
    engine = LLMEngine(EngineArgs(model=model, **opts))
    engine.emit_partial_outputs = False

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.input_len)]
               for _ in range(args.num_seqs)]
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                           detokenize=False)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                 detokenize=False, structured_outputs=so)
    every = max(1, round(1 / args.fraction)) if args.fraction > 0 else 0
    mixed = [constrained if every and i % every == 0 else plain for i in range(args.num_seqs)]
    n_constrained = sum(p is constrained for p in mixed)

    # the masked argmax's host work (mask building and its launches) per step
    times = PhaseClock()
    times.wrap(InFlightStep, "finish", "finish")
    run_once(engine, prompts[:8], [plain] * 4 + [constrained] * 4)  # warm-up (and the grammar)
    best = {"0%": None, "mixed": None}
    rounds = {"0%": [], "mixed": []}
    for _ in range(args.rounds):
        for name, params in (("0%", [plain] * args.num_seqs), ("mixed", mixed)):
            secs, toks, detail = run_once(engine, prompts, params, times)
            rounds[name].append({"seconds": round(secs, 4), "tok_s": round(toks / secs, 1),
                                 **detail})
            print(f"  {name:>5}: {toks / secs:9.0f} tok/s  {detail}", flush=True)
            if best[name] is None or toks / secs > best[name][1] / best[name][0]:
                best[name] = (secs, toks)
    base = best["0%"][1] / best["0%"][0]
    got = best["mixed"][1] / best["mixed"][0]
    loss = 100.0 * (1.0 - got / base)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    print(f"{'workload':>22} {'seconds':>8} {'tokens':>7} {'tok/s':>9}")
    print(f"{'0% constrained':>22} {best['0%'][0]:>8.2f} {best['0%'][1]:>7} {base:>9.0f}")
    print(f"{f'{n_constrained} of {args.num_seqs} constrained':>22} {best['mixed'][0]:>8.2f} "
          f"{best['mixed'][1]:>7} {got:>9.0f}")
    print(f"throughput loss: {loss:.1f}% (issue 18 asks <= 5%)")
    print(json.dumps({
        "benchmark": "structured_output", "model": args.model if not args.smoke else "tiny",
        "device": device, "num_seqs": args.num_seqs, "constrained": n_constrained,
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "tok_s_unconstrained": round(base, 1), "tok_s_mixed": round(got, 1),
        "loss_pct": round(loss, 2), "backend": "llguidance", "runs": rounds,
        "torch": torch.__version__, "commit": os.environ.get("PAGEDKV_COMMIT"),
    }))


if __name__ == "__main__":
    main()
