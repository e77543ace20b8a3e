"""Why does paged decode on an fp8 cache run at 46% of the copy bandwidth? A diagnosis (issue 20).

On an H200 the 16-bit decode kernel reads K/V at 96-100% of the copy bandwidth, the fp8 one at
33-48% whatever the tiles (``docs/performance/kernels.json``, ``sweep_decode_fp8``): half the
bytes take longer than the 16-bit kernel's. The shipped kernel converts each e4m3 tile to the
query's dtype in registers before ``tl.dot``. This script times minimal decode kernels (one
program per sequence and KV head, batch 64 x 4k context, 32/8 heads of 128) that differ in that
one step:

  bf16        16-bit cache, no conversion (the bandwidth the fp8 ones should double)
  cvt         e4m3 tiles converted to bf16 in registers (what the shipped kernel does)
  bits_f16    e4m3 bytes widened to float16 with integer shifts (exact: the value times 2^-8,
              folded into the scales), the query in float16
  fp8_mma     no conversion: the query (per row) and the probabilities quantized to e4m3 and
              multiplied on fp8 tensor cores, as FlashAttention-3 does for fp8 caches (costs
              accuracy: ``rel_err`` against the bf16 kernel)
  shipped     ``pagedattn_kernels.paged_decode_attention`` on the fp8 cache

    python scripts/decode_fp8_variants.py --output-json OUT.json       # on a GPU
    TRITON_INTERPRET=1 python scripts/decode_fp8_variants.py --check   # CPU: outputs only
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import triton
import triton.language as tl
from variant_cli import add_common_args, check_or_gpu, write_result

log = logging.getLogger("decode_fp8_variants")

BF16, CVT, BITS_F16, FP8_MMA = range(4)
MODES = {"bf16": BF16, "cvt": CVT, "bits_f16": BITS_F16, "fp8_mma": FP8_MMA}


@triton.jit
def _widen(t, MODE: tl.constexpr):
    """A K or V tile as loaded, in the dtype the products take."""
    if MODE == 1:
        t = t.to(tl.bfloat16)
    elif MODE == 2:  # e4m3 byte -> float16 bits: sign to bit 15, exponent+mantissa shifted by 7
        b = t.to(tl.uint8, bitcast=True).to(tl.uint16)
        t = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return t


@triton.jit
def decode_variant_kernel(
    out_ptr, q_ptr, k_cache, v_cache, block_tables, seq_len, scale_log2, v_scale,
    stride_q_seq, stride_q_head, stride_blk, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid (sequences, KV heads): the G query heads of one KV head over the whole context
    (every sequence ``seq_len`` tokens, a multiple of TILE_N). UPCAST: the interpreter, whose
    dot multiplies neither bfloat16 nor fp8 (numpy has neither): the operands go to float32
    first, which holds their values exactly."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * G + g
    q_off = seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None], other=0.0)
    if MODE == 2:
        q = q.to(tl.float16)
    if MODE == 3:  # per-row e4m3 scale of the query; scores come back times q_scale
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1) / 448.0, 1e-12)
        q = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    bt = block_tables + seq * stride_bt
    for start in range(0, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        blk = tl.load(bt + pos // BLOCK_SIZE)
        off = blk * stride_blk + (pos % BLOCK_SIZE) * stride_tok + kv_head * stride_head
        k = _widen(tl.load(k_cache + off[:, None] + d[None, :]), MODE)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MODE == 3:
            s = s * q_scale[:, None]
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _widen(tl.load(v_cache + off[:, None] + d[None, :]), MODE)
        if MODE == 3:
            p = p.to(tl.float8e4nv)  # p in [0, 1]: e4m3 keeps 3 mantissa bits
        else:
            p = p.to(v.dtype)
        if UPCAST:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None],
                         input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    out = acc * v_scale / l_i[:, None]
    o_off = seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


class Problem:
    """Batch x context of random K/V in shuffled blocks of 16, bf16 and its e4m3 copy (unit
    scales); the bf16 copy holds the e4m3 values, so every variant attends the same numbers."""

    def __init__(self, batch: int, context: int, device: str, heads: int = 32,
                 kv_heads: int = 8, head_dim: int = 128, block: int = 16, seed: int = 0):  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context, self.block = batch, context, block
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        per_seq = -(-context // block)
        shape = (batch * per_seq, block, kv_heads, head_dim)
        k = torch.randn(shape, generator=gen, device=device)
        v = torch.randn(shape, generator=gen, device=device)
        self.k8, self.v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        self.k16, self.v16 = self.k8.to(torch.bfloat16), self.v8.to(torch.bfloat16)
        perm = torch.randperm(batch * per_seq, generator=gen, device=device)
        self.tables = perm.view(batch, per_seq).to(torch.int32)
        self.q = torch.randn(batch, heads, head_dim, generator=gen, device=device)
        self.q = self.q.to(torch.bfloat16)
        self.scale = head_dim**-0.5

    def kv_bytes(self, itemsize: int) -> int:
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * itemsize


def run(p: Problem, mode: str, tile_n: int, warps: int, stages: int, out: torch.Tensor):
    m = MODES[mode]
    k, v = (p.k16, p.v16) if m == BF16 else (p.k8, p.v8)
    unit = 256.0 if m == BITS_F16 else 1.0  # bits_f16 tiles hold the value times 2^-8
    g = p.heads // p.kv_heads

    def call():
        decode_variant_kernel[(p.batch, p.kv_heads)](
            out, p.q, k, v, p.tables, p.context, p.scale * 1.4426950408889634 * unit, unit,
            p.q.stride(0), p.q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            p.tables.stride(0),
            G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), HEAD_DIM=p.head_dim,
            BLOCK_SIZE=p.block, TILE_N=tile_n, MODE=m, UPCAST=p.q.device.type == "cpu",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return call


def shipped(p: Problem, out: torch.Tensor):
    import pagedattn_kernels as pk

    lens = torch.full((p.batch,), p.context, dtype=torch.int32, device=p.q.device)

    def call():
        return pk.paged_decode_attention(p.q, p.k8, p.v8, p.tables, lens,
                                         max_seq_len=p.context, out=out)  # fmt: skip

    return call


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


CONFIGS = [  # (mode, tile_n, warps, stages)
    ("bf16", 128, 4, 2), ("bf16", 64, 2, 3),
    ("cvt", 128, 4, 2), ("cvt", 128, 4, 3), ("cvt", 64, 4, 4),
    ("bits_f16", 128, 4, 2), ("bits_f16", 128, 4, 3), ("bits_f16", 64, 4, 4),
    ("fp8_mma", 128, 4, 2), ("fp8_mma", 128, 4, 3), ("fp8_mma", 256, 4, 3),
]


def check() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = Problem(2, 64, dev, heads=4, kv_heads=2, head_dim=32)
    ref = torch.empty_like(p.q)
    run(p, "bf16", 32, 4, 1, ref)()
    # float64 reference of the same numbers
    k = p.k16.double()[p.tables.long()].flatten(1, 2)[:, : p.context]  # [B, T, kv, D]
    v = p.v16.double()[p.tables.long()].flatten(1, 2)[:, : p.context]
    g = p.heads // p.kv_heads
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    w = torch.softmax(torch.einsum("bhd,bthd->bht", p.q.double(), k) * p.scale, -1)
    want = torch.einsum("bht,bthd->bhd", w, v)
    bad = 0
    for mode in ("bf16", "cvt", "bits_f16", "fp8_mma"):
        out = torch.empty_like(p.q)
        try:
            run(p, mode, 32, 4, 1, out)()
        except Exception as exc:  # the interpreter may lack an fp8 dot
            log.warning("%s: %s", mode, repr(exc)[:160])
            continue
        err = rel_err(out, want)
        limit = 0.25 if mode == "fp8_mma" else 0.02  # fp8_mma: e4m3 query and probabilities
        bad += err > limit
        log.info("%-9s rel err vs float64 %.1e %s", mode, err, "ok" if err <= limit else "WRONG")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    add_common_args(ap, budget_s=120.0)
    args = ap.parse_args()
    if (code := check_or_gpu(args, check)) is not None:
        return code
    deadline = time.monotonic() + args.budget_s
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / copy_ms / 1e9  # TB/s, read + write
    p = Problem(args.batch, args.context, "cuda")
    ref = torch.empty_like(p.q)
    run(p, "bf16", 128, 4, 2, ref)()
    rows = []
    cases = [(c, None) for c in CONFIGS] + [(("shipped", 0, 0, 0), None)]
    for (mode, tile_n, warps, stages), _ in cases:
        if time.monotonic() > deadline:
            break
        out = torch.empty_like(p.q)
        try:
            fn = shipped(p, out) if mode == "shipped" else run(p, mode, tile_n, warps, stages, out)
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as exc:
            rows.append({"variant": mode, "tile_n": tile_n, "error": repr(exc)[:300]})
            log.info("%s %s: error %s", mode, tile_n, repr(exc)[:200])
            continue
        nbytes = p.kv_bytes(2 if mode == "bf16" else 1)
        frac = nbytes / ms / 1e9 / copy_bw
        row = {"variant": mode, "tile_n": tile_n, "num_warps": warps, "num_stages": stages,
               "us": ms * 1e3, "bw_frac": frac, "rel_err_vs_bf16": rel_err(out, ref)}  # fmt: skip
        rows.append(row)
        log.info("%-9s tile %3d w=%d s=%d: %8.1f us  %5.1f%% of copy  err %.1e", mode, tile_n,
                 warps, stages, ms * 1e3, 100 * frac, row["rel_err_vs_bf16"])
    write_result(args, "decode_fp8_variants", "decode_fp8_variants.py", batch=args.batch,
                 context=args.context, copy_bw_TBps=copy_bw, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
