"""How close a run gets to the GPU's limits: a lower bound on each forward pass's time.

A forward pass must at least read every weight it multiplies by (all but the embedding table,
of which it gathers a few rows), read the K/V of every context token it attends to and write the
new tokens' K/V: ``bytes / bandwidth``. It must also do its matmuls and attention products:
``flops / matmul rate``. Its time cannot be below the larger of the two. Summed over a run's
passes and divided by the run's wall-clock time, that is the *roofline fraction*: 1.0 would
mean no host overhead, no idle GPU and kernels at the hardware's peak.

Both rates are measured in the same run (a large device-to-device copy and a large bf16
matmul), not taken from a datasheet. With fp8 weights (``--quantization fp8``) the weights are
counted at their stored size (one byte for the quantized linear layers) and their matmuls at
the rate of an fp8 ``torch._scaled_mm`` measured the same way; with an fp8 KV cache the KV
bytes per token are the cache's (half those of bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

import torch


@dataclass(slots=True)
class Hardware:
    bandwidth: float  # bytes/s, counting bytes read and written
    matmul_flops: float  # FLOP/s of a large matmul in the model's dtype
    fp8_matmul_flops: float | None = None  # FLOP/s of a large fp8 scaled matmul (fp8 weights)

    def best(self, other: Hardware) -> Hardware:
        """The higher of each rate in two measurements of the same GPU: the tighter bound.
        One copy test can read low (a throttled or shared moment); a bound from it would
        flatter the run."""
        fp8 = [f for f in (self.fp8_matmul_flops, other.fp8_matmul_flops) if f is not None]
        return Hardware(max(self.bandwidth, other.bandwidth),
                        max(self.matmul_flops, other.matmul_flops), max(fp8, default=None))

    def as_dict(self) -> dict[str, float]:
        out = {"hbm_gb_s": self.bandwidth / 1e9, "matmul_tflop_s": self.matmul_flops / 1e12}
        if self.fp8_matmul_flops is not None:
            out["fp8_matmul_tflop_s"] = self.fp8_matmul_flops / 1e12
        return out


def _time_cuda(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@torch.inference_mode()
def measure_hardware(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> Hardware:
    """Copy bandwidth (2 GiB buffer) and matmul rate (8192^3) on `device`, about a second;
    with `fp8`, also the rate of ``torch._scaled_mm`` on e4m3 operands with row-wise scales
    (the engine's fp8 matmul)."""
    n = 1 << 30
    bufs = [torch.empty(n, dtype=torch.int16, device=device) for _ in range(2)]
    secs = _time_cuda(lambda: bufs[1].copy_(bufs[0]), 10)
    bandwidth = 2 * n * 2 / secs
    k = 8192
    mats = [torch.randn(k, k, dtype=dtype, device=device) for _ in range(2)]
    flops = 2 * k**3 / _time_cuda(lambda: torch.mm(mats[0], mats[1]), 10)
    fp8_flops = None
    if fp8:
        a, b = (m.to(torch.float8_e4m3fn) for m in mats)
        sa = torch.ones(k, 1, dtype=torch.float32, device=device)
        sb = torch.ones(1, k, dtype=torch.float32, device=device)
        fp8_flops = 2 * k**3 / _time_cuda(
            lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
            10,
        )
        del a, b
    bufs.clear()
    mats.clear()
    torch.cuda.empty_cache()
    return Hardware(bandwidth=bandwidth, matmul_flops=flops, fp8_matmul_flops=fp8_flops)


@dataclass(slots=True)
class ModelCost:
    """Per-pass costs of one model: what a pass reads and computes, per token and per pair."""

    weight_bytes: float  # every weight but the embedding table, at its stored size
    matmul_params: int  # weights multiplied once per token (the LM head is counted per sample)
    lm_head_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # QK^T and PV for one (query, key) pair, all layers and heads
    fp8_params: int = 0  # of matmul_params, those stored in fp8 (multiplied at the fp8 rate)

    @classmethod
    def of(cls, model: torch.nn.Module, model_config: Any, kv_bytes_per_token: int,
           tensor_parallel_size: int = 1) -> ModelCost:
        """Costs for one GPU: `model` is that GPU's shard (its own parameters), and with tensor
        parallelism each GPU holds and attends over 1/N of the heads. `kv_bytes_per_token`:
        the whole model's, in the KV cache's dtype."""
        embed = lm_head = total = fp8 = 0
        weight_bytes = 0
        embed_itemsize = 2
        for name, p in model.named_parameters():
            total += p.numel()
            if "embed_tokens" in name or name.endswith("wte.weight"):
                embed += p.numel()
                embed_itemsize = p.element_size()
                continue
            weight_bytes += p.numel() * p.element_size()
            if "lm_head" in name:
                lm_head += p.numel()
            elif p.dtype == torch.float8_e4m3fn:
                fp8 += p.numel()
        tied = lm_head == 0
        lm_head = lm_head or model_config.hidden_size * model_config.vocab_size // tensor_parallel_size
        if tied:  # a tied LM head reads the embedding table once per pass as its output matrix
            # ... or its e4m3 copy (--quantize-lm-head), one byte an element
            fp8_copy = getattr(getattr(model, "embed_tokens", None), "fp8_head", None)
            weight_bytes += lm_head * (1 if fp8_copy is not None else embed_itemsize)
        c = model_config
        return cls(
            weight_bytes=weight_bytes,
            matmul_params=total - embed - (0 if tied else lm_head),
            lm_head_params=lm_head,
            kv_bytes_per_token=kv_bytes_per_token // tensor_parallel_size,
            attn_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim // tensor_parallel_size,
            fp8_params=fp8,
        )

    def parts(self, hw: Hardware, tokens: int, seqs: int, kv_tokens: int,
              pairs: int) -> tuple[float, float, float, float]:  # fmt: skip
        """(weight read, matmul time, KV read and write, attention products) of one pass in
        seconds, each at the hardware's rate: the terms the bounds below combine."""
        matmul = (2 * (self.matmul_params - self.fp8_params) * tokens
                  + 2 * self.lm_head_params * seqs) / hw.matmul_flops
        if self.fp8_params:
            matmul += 2 * self.fp8_params * tokens / (hw.fp8_matmul_flops or hw.matmul_flops)
        return (self.weight_bytes / hw.bandwidth, matmul,
                (kv_tokens + tokens) * self.kv_bytes_per_token / hw.bandwidth,
                self.attn_flops_per_pair * pairs / hw.matmul_flops)

    def pass_bound(self, hw: Hardware, tokens: int, seqs: int, kv_tokens: int,
                   pairs: int) -> float:
        """Lower bound in seconds for one pass of `tokens` new tokens over `seqs` sequences
        that attend to `kv_tokens` cached tokens in all (`pairs` query-key pairs): all bytes
        over the bandwidth or all products over the matmul rate, whichever is longer. It
        assumes the memory-bound work and the compute-bound work overlap perfectly."""
        weights, matmul, kv, attention = self.parts(hw, tokens, seqs, kv_tokens, pairs)
        return max(weights + kv, matmul + attention)

    def pass_serial_bound(self, hw: Hardware, tokens: int, seqs: int, kv_tokens: int,
                          pairs: int) -> float:
        """The same pass's bound when its matmuls and its attention run one after the other,
        as they do in an engine that does not split a batch to overlap them (NanoFlow does):
        each at its own limit, the larger of bytes and products, then summed. At large decode
        batches the matmuls are compute-bound and attention memory-bound, and this bound is up
        to twice ``pass_bound``: the part of the gap to ``pass_bound`` that faster kernels
        alone cannot close."""
        weights, matmul, kv, attention = self.parts(hw, tokens, seqs, kv_tokens, pairs)
        return max(weights, matmul) + max(kv, attention)


def roofline_report(cost: ModelCost, hw: Hardware, passes: list[tuple[int, int, int, int]],
                    step_seconds: list[float], wall_seconds: float,
                    gpu_seconds: list[float] | None = None,
                    between_seconds: list[float] | None = None) -> dict[str, Any]:
    """`passes[i]` = (tokens, seqs, kv_tokens, pairs) of step i and `step_seconds[i]` its
    measured time (host work included); `gpu_seconds[i]`, when given, its device time, and
    `between_seconds[i]` the device time from the end of pass i-1 to its start (the device
    waiting for the host to launch it). Returns the run's roofline fraction and the typical
    decode pass: its bound and its measured time, and how much of that time the GPU was busy.

    A step's wall time less its pass's device time (`*_host_gap_*`) is exact over a run; pass
    by pass it is not under asynchronous scheduling, where a step waits for the pass before
    the one it launched. `*_device_wait_seconds` (from `between_seconds`) is the device's own
    account of the time it waited before each kind of pass."""
    bounds = [cost.pass_bound(hw, *p) for p in passes]
    serial = [cost.pass_serial_bound(hw, *p) for p in passes]
    gpu = gpu_seconds if gpu_seconds and len(gpu_seconds) == len(passes) else None
    between = (between_seconds if gpu is not None and between_seconds
               and len(between_seconds) == len(passes) else None)  # fmt: skip
    out: dict[str, Any] = {
        "roofline_frac": sum(bounds) / wall_seconds if wall_seconds > 0 else 0.0,
        "roofline_bound_s": sum(bounds),
        # what the run reaches of the bound its matmuls and attention have one after the other
        "roofline_serial_frac": sum(serial) / wall_seconds if wall_seconds > 0 else 0.0,
        "roofline_serial_bound_s": sum(serial),
        "forward_passes": len(passes),
        **hw.as_dict(),
    }
    # Decode-only passes (CUDA graphs) and passes holding prompt tokens (eager), apart: where
    # the time goes between the two says what to speed up next.
    for kind, is_kind in (("decode", lambda p: p[0] == p[1]), ("mixed", lambda p: p[0] != p[1])):
        idx = [i for i, p in enumerate(passes) if is_kind(p)]
        if not idx:
            continue
        times = [step_seconds[i] for i in idx]
        out[f"{kind}_passes"] = len(idx)
        out[f"{kind}_seconds"] = sum(times)
        out[f"{kind}_step_bound_ms"] = median(bounds[i] for i in idx) * 1e3
        out[f"{kind}_step_ms"] = median(times) * 1e3
        out[f"{kind}_roofline_frac"] = sum(bounds[i] for i in idx) / sum(times)
        out[f"{kind}_max_step_ms"] = max(times) * 1e3
        if gpu is not None:
            out[f"{kind}_gpu_ms"] = median(gpu[i] for i in idx) * 1e3
            out[f"{kind}_host_gap_ms"] = median(step_seconds[i] - gpu[i] for i in idx) * 1e3
            out[f"{kind}_gpu_seconds"] = sum(gpu[i] for i in idx)
            out[f"{kind}_host_gap_seconds"] = sum(step_seconds[i] - gpu[i] for i in idx)
        if between is not None:
            out[f"{kind}_device_wait_seconds"] = sum(between[i] for i in idx)
    if gpu is not None:
        out["decode_host_gap_by_batch"] = _host_gap_by_batch(passes, step_seconds, gpu, bounds,
                                                             serial)
        out["mixed_pass_trace"] = _mixed_pass_trace(passes, step_seconds, gpu, between)
    return out


def _mixed_pass_trace(passes, step_seconds, gpu, between) -> list[dict[str, float]]:
    """Each pass with prompt tokens, and the pass after it: (index, tokens, sequences, the
    step's wall time, the pass's device time and, when measured, the device's wait before it,
    in ms). A run has few of them (all prompts of an offline run are admitted in its first
    passes), and their host gaps vary from run to run: the trace says which passes wait.
    Under asynchronous scheduling a step's wall time covers the wait for the pass before the
    one it launched, so read `step_ms` over neighbours; `wait_before_ms` is the pass's own."""
    rows = sorted({j for i, p in enumerate(passes) if p[0] != p[1]
                   for j in (i, i + 1) if j < len(passes)})
    trace = []
    for i in rows:
        row = {"i": i, "tokens": passes[i][0], "seqs": passes[i][1],
               "step_ms": round(step_seconds[i] * 1e3, 3), "gpu_ms": round(gpu[i] * 1e3, 3)}
        if between is not None:
            row["wait_before_ms"] = round(between[i] * 1e3, 3)
        trace.append(row)
    return trace


# Decode batch sizes are grouped by these upper bounds for the host-gap table.
_BATCH_BUCKETS = (64, 256, 512, 1024, 1 << 30)


def _host_gap_by_batch(passes, step_seconds, gpu, bounds,
                       serial) -> dict[str, dict[str, float]]:  # fmt: skip
    """Host wait of decode passes per batch-size bucket: where the host's per-sequence work
    shows (it grows with the batch) against the fixed cost of a step; and each bucket's bound
    and roofline fraction (`bounds[i]`: pass i's), which say which batch sizes to speed up,
    and its fraction of the serial bound (`serial[i]`), which says how much of that a faster
    kernel could win without overlapping matmuls and attention."""
    table: dict[str, dict[str, float]] = {}
    low = 1
    for high in _BATCH_BUCKETS:
        idx = [i for i, p in enumerate(passes) if p[0] == p[1] and low <= p[1] <= high]
        if idx:
            gap = sum(step_seconds[i] - gpu[i] for i in idx)
            label = f"{low}-{high}" if high < 1 << 30 else f"{low}+"
            table[label] = {"passes": len(idx), "host_gap_s": gap,
                            "host_gap_ms_mean": gap / len(idx) * 1e3,
                            "host_gap_ms_median": median(step_seconds[i] - gpu[i]
                                                         for i in idx) * 1e3,
                            "gpu_ms_mean": sum(gpu[i] for i in idx) / len(idx) * 1e3,
                            "gpu_ms_median": median(gpu[i] for i in idx) * 1e3,
                            "seconds": sum(step_seconds[i] for i in idx),
                            "bound_ms_mean": sum(bounds[i] for i in idx) / len(idx) * 1e3,
                            "roofline_frac": sum(bounds[i] for i in idx)
                            / max(sum(step_seconds[i] for i in idx), 1e-12),
                            "serial_frac": sum(serial[i] for i in idx)
                            / max(sum(step_seconds[i] for i in idx), 1e-12)}
        low = high + 1
    return table
