"""What the greedy token costs after the LM head: the argmax of float32 logits (the cast, then
the reduction: the engine until 2d09a7d) against torch's argmax of the model-dtype logits and
``pagedattn_kernels.argmax_rows`` (the Triton kernels, each row split over many programs: what
``ModelRunner.greedy_tokens`` takes on a GPU now), at decode batch sizes over Llama-3's
128,256-token vocabulary, replayed from CUDA graphs; with the LM head's own product for scale.

    python scripts/greedy_argmax_bench.py [--rows 1 16 64 ...] [--chunks 2048 8192 ...]
        [--output-json OUT.json]   # GPU

``--chunks``: also time ``argmax_rows`` with each of these chunk widths forced (columns a
program takes; the default is ``sampling.triton_launch.pick_chunk``'s), as ``argmax_rows@N``.

All give the same ids (checked here on every shape, also on logits with ties and a NaN); the
figures are per call, the median of ``triton.testing.do_bench_cudagraph``, the variants
interleaved over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics

import torch
import torch.nn.functional as F
import triton

import pagedattn_kernels as pk
from pagedattn_kernels.sampling import triton_launch as argmax_launch

log = logging.getLogger("greedy_argmax_bench")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, nargs="*", default=[])
    ap.add_argument("--output-json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        log.error("needs a GPU")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn(args.vocab, args.hidden, generator=gen, device="cuda",
                       dtype=torch.bfloat16) * args.hidden**-0.5  # fmt: skip
    rows_out = []
    for m in args.rows:
        hidden = torch.randn(m, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        logits = F.linear(hidden, head)
        assert torch.equal(logits.argmax(-1), logits.float().argmax(-1))
        assert torch.equal(pk.argmax_rows(logits), logits.argmax(-1)), f"argmax_rows, {m} rows"
        tricky = logits.clone()
        tricky[:, ::1000] = tricky.max()  # ties in every chunk
        tricky[::2, -3] = float("nan")  # a NaN after the ties
        assert torch.equal(pk.argmax_rows(tricky), tricky.argmax(-1)), f"ties/NaN, {m} rows"
        variants = {
            "cast_argmax": lambda x=logits: x.float().argmax(-1),
            "argmax": lambda x=logits: x.argmax(-1),
            "argmax_rows": lambda x=logits: pk.argmax_rows(x),
            "lm_head": lambda h=hidden: F.linear(h, head),
        }
        for chunk in args.chunks:
            out = torch.empty(m, dtype=torch.int64, device="cuda")
            forced = argmax_launch.argmax_rows(tricky, out, chunk=chunk).clone()
            assert torch.equal(forced, tricky.argmax(-1)), f"chunk {chunk}, {m} rows"
            variants[f"argmax_rows@{chunk}"] = (
                lambda x=logits, o=out, c=chunk: argmax_launch.argmax_rows(x, o, chunk=c))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(1e3 * triton.testing.do_bench_cudagraph(fn, rep=40))
        row = {"rows": m, **{k: round(statistics.median(v), 2) for k, v in times.items()},
               "spread": {k: [round(min(v), 2), round(max(v), 2)] for k, v in times.items()}}
        row["saved_us"] = round(row["cast_argmax"] - row["argmax"], 2)
        row["argmax_rows_saved_us"] = round(row["argmax"] - row["argmax_rows"], 2)
        rows_out.append(row)
        log.info("rows %5d: cast+argmax %7.2f us, argmax %7.2f us (saves %6.2f), argmax_rows "
                 "%7.2f us (saves %6.2f more), lm_head %8.2f us", m, row["cast_argmax"],
                 row["argmax"], row["saved_us"], row["argmax_rows"], row["argmax_rows_saved_us"],
                 row["lm_head"])
        if args.chunks:
            log.info("            argmax_rows with forced chunks: %s", ", ".join(
                f"{c}: {row[f'argmax_rows@{c}']:.2f} us" for c in args.chunks))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "greedy_argmax", "vocab": args.vocab,
                       "device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
