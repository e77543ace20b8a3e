"""Decode attention on an fp8 cache with the values stored key-major
(``pagedattn_kernels.key_major_values``) against the usual layout, on one GPU.

Why: on sm_90 an e4m3 value tile stored head-dim-contiguous is read back from shared memory
one byte per instruction for P.V (no transposing ldmatrix for bytes); key-major, it is read
as the key tile is. This times both layouts at the shapes of the kernel benchmark's headline
(64 x 4k) and at those a ShareGPT run decodes (hundreds of sequences of a few hundred tokens,
``docs/performance/gpu_runs``), the default tile and a few others, events and CUDA graphs.

    python scripts/decode_key_major.py [--output-json PATH] [--quick]

``--quick`` runs tiny shapes on the CPU through Triton's interpreter (a smoke run). Prints one
line per row and the JSON of all rows at the end.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

import pagedattn_kernels as pk
from pagedattn_kernels.attention import triton_launch as tl_
from pagedkv.bench import kernels as kb

FP8 = torch.float8_e4m3fn
SHAPES = [(64, 4096), (256, 512), (256, 2048), (48, 900), (16, 900), (16, 8192), (1, 32768)]
QUICK_SHAPES = [(2, 64), (3, 40)]

log = logging.getLogger("decode_key_major")


def configs(head_dim: int, dtype: torch.dtype, quick: bool) -> list[tl_.DecodeConfig]:
    default = tl_.decode_config(head_dim, dtype, interpreted=quick, kv_dtype=FP8)
    if quick:
        return [default]
    return [default, tl_.DecodeConfig(128, 4, 3, early_v=True), tl_.DecodeConfig(128, 4, 2),
            tl_.DecodeConfig(64, 4, 4), tl_.DecodeConfig(64, 2, 3), tl_.DecodeConfig(256, 4, 2),
            tl_.DecodeConfig(128, 8, 3)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run, tiny shapes")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        setup = kb.Setup(torch.device("cpu"), torch.float32, 4, 2, 64, 16, [], [], [], True)
        shapes = QUICK_SHAPES
    else:
        setup = kb.Setup(torch.device("cuda"), torch.bfloat16, kb.HEADS, kb.KV_HEADS,
                         kb.HEAD_DIM, kb.BLOCK, [], [], [], False)  # fmt: skip
        shapes = SHAPES
    copy_bw = kb.copy_bandwidth(setup.device, setup.quick)
    gen = torch.Generator(setup.device).manual_seed(0)
    scale = torch.ones(1, dtype=torch.float32, device=setup.device)
    backend = "triton"
    rows = []
    for batch, context in shapes:
        kc, vc, tables = kb._paged(setup, batch, context, gen)
        kc, vc = kc.to(FP8), vc.to(FP8)
        vkm = pk.key_major_values(*vc.shape, dtype=FP8, device=vc.device)
        vkm.copy_(vc)
        lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
        q = torch.randn(batch, setup.heads, setup.head_dim, generator=gen, device=setup.device)
        q = q.to(setup.dtype)
        kv_bytes = 2 * batch * context * setup.kv_heads * setup.head_dim
        ref = pk.paged_decode_attention(q, kc, vc, tables, lens, k_scale=scale, v_scale=scale,
                                        backend=backend)  # fmt: skip
        for cfg in configs(setup.head_dim, setup.dtype, setup.quick):
            for layout, values in (("head_dim", vc), ("key_major", vkm)):
                out = torch.empty_like(q)

                def run(values=values, cfg=cfg, out=out, context=context, q=q, kc=kc,
                        tables=tables, lens=lens) -> torch.Tensor:  # fmt: skip
                    return tl_.paged_decode_attention(q, kc, values, tables, lens,
                                                      setup.head_dim**-0.5, context, out,
                                                      config=cfg, k_scale=scale, v_scale=scale)

                row = {"batch": batch, "context": context, "values": layout,
                       "config": {"tile_n": cfg.tile_n, "num_warps": cfg.num_warps,
                                  "num_stages": cfg.num_stages, "early_v": cfg.early_v}}
                rows.append(row)
                if not kb.time_tile(run, setup.device, row, kv_bytes, copy_bw):
                    log.info("B=%d ctx=%d %s %s: %s", batch, context, layout, row["config"],
                             row["error"])
                    continue
                row["rel_err"] = kb.rel_error(out, ref.double())
                graph = f" | graph {100 * row['graph_bw_frac']:5.1f}%" if "graph_us" in row else ""
                log.info("B=%-4d ctx=%-6d %-9s %s: %8.1f us %5.1f%% of copy%s err %.1e", batch,
                         context, layout, row["config"], row["us"], 100 * row["bw_frac"], graph,
                         row["rel_err"])
    result = {"copy_bw": copy_bw, "rows": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
