"""What would fusing away the fp8 decode step's small kernels buy? An upper bound, by ablation.

A decode step of the fp8 model (fp8 weights and cache) runs, per layer, besides the matmuls and
attention, a few kernels that move little data: the decode plan's merge of split rows
(``decode_merge_kernel``), the per-token quantization of attention's output for the output
projection (``quantize_fp8_per_token_kernel``) and the quantization of SiLU's products for the
down projection (``quantize_fp8_tiles_kernel``). Fusing any of them into a neighbour saves at
most what the step loses by not running it at all. This script measures that: it runs
``python -m pagedkv.bench.decode_step`` (CUDA graphs, PDL as the engine runs) with the chosen
kernels left out of the captured graphs, so the step times say what each costs in place. The
outputs are wrong while a kernel is left out (stale buffers): timing only, never a correctness
figure.

    python scripts/ablate_small_kernels.py --skip merge,quant_o,quant_down -- \\
        --batch-sizes 8,32,160 --context 900 --model meta-llama/Meta-Llama-3-8B \\
        --load-format dummy --dtype bfloat16 --kv-cache-dtype fp8 --quantization fp8

``--skip`` (comma-separated, empty: none, the baseline):
  merge       the plan's merge launch (split rows keep their partial outputs)
  quant_o     the runtime per-token quantization in ``fp8_linear`` (the output projection's
              input): stale e4m3 rows and unit scales instead
  quant_down  the second kernel of the tiled SiLU-to-fp8 pair (``quantize_fp8_from_maxima``)
The weights are quantized before the skips take effect (they are armed once ``quantize_model``
returns, before the graphs are captured).
"""

from __future__ import annotations

import argparse
import sys

import torch

SKIPS = ("merge", "quant_o", "quant_down")


def arm(skips: set[str]) -> None:
    """Patch the launchers so that the kernels named in ``skips`` are never launched once the
    model's weights are quantized."""
    import pagedattn_kernels
    from pagedattn_kernels.attention import triton_launch as attention_launch
    from pagedattn_kernels.attention.plan import DecodePlan
    from pagedattn_kernels.quant import triton_launch as quant_launch
    from pagedkv.engine.models import quantization

    armed = {"on": False}
    quantize_model = quantization.quantize_model

    def quantize_then_arm(*args, **kwargs):
        n = quantize_model(*args, **kwargs)
        armed["on"] = True
        return n

    quantization.quantize_model = quantize_then_arm

    if "merge" in skips:
        planned = attention_launch._planned_decode

        def no_merge(kernels, cfg, plan, *args, **kwargs):
            plan = DecodePlan(plan.work, plan.merges[:0], plan.tile_n)
            return planned(kernels, cfg, plan, *args, **kwargs)

        attention_launch._planned_decode = no_merge

    if "quant_o" in skips:
        per_token = pagedattn_kernels.quantize_fp8_per_token
        stale: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

        def stale_rows(x, *args, **kwargs):
            if not armed["on"] or not x.is_cuda:
                return per_token(x, *args, **kwargs)
            rows, cols = x.shape
            have = stale.get(x.device)
            if have is None or have[0].shape[0] < rows or have[0].shape[1] < cols:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("ablate: stale rows must exist before graph capture")
                have = (torch.zeros(max(rows, 1024), max(cols, 16384), dtype=torch.float8_e4m3fn,
                                    device=x.device),
                        torch.ones(max(rows, 1024), 1, device=x.device))  # fmt: skip
                stale[x.device] = have
            return have[0][:rows, :cols], have[1][:rows]

        pagedattn_kernels.quantize_fp8_per_token = stale_rows

    if "quant_down" in skips:
        from_maxima = quant_launch.quantize_fp8_from_maxima

        def no_quantize(y, partial, q, scale, *args, **kwargs):
            if not armed["on"]:
                return from_maxima(y, partial, q, scale, *args, **kwargs)
            return q, scale

        quant_launch.quantize_fp8_from_maxima = no_quantize


def main() -> int:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help=f"comma-separated, from {', '.join(SKIPS)}")
    args = ap.parse_args(own)
    skips = {s for s in args.skip.split(",") if s}
    if skips - set(SKIPS):
        ap.error(f"--skip: unknown {sorted(skips - set(SKIPS))}; choose from {', '.join(SKIPS)}")
    arm(skips)
    from pagedkv.bench import decode_step

    print(f"ablate: skipping {sorted(skips) or 'nothing (baseline)'}", flush=True)
    return decode_step.main(rest)


if __name__ == "__main__":
    sys.exit(main())
