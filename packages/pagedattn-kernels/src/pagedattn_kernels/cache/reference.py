"""Float64-exact references of the cache ops, written for obviousness rather than speed: one
token or one (src, dst) pair at a time. They write into the tensors they are given (pass clones)
and run on any device. (Copies are exact in every dtype, so "float64" here means: no rounding.)
"""

from __future__ import annotations

import torch

__all__ = ["copy_blocks", "e4m3_values", "nearest_e4m3", "reshape_and_cache", "swap_blocks"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """fp8 caches: each element becomes the e4m3 value nearest to ``x / scale`` (ties to even),
    clamped to +-448, found by search over the 256 codes (no cast involved)."""
    block_size = key_cache.shape[1]
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:
            continue
        k, v = key[i], value[i]
        if fp8:
            k, v = nearest_e4m3(k, k_scale), nearest_e4m3(v, v_scale)
        key_cache[slot // block_size, slot % block_size] = k
        value_cache[slot // block_size, slot % block_size] = v


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value once, ascending, in float64 (from the definition: sign, 4
    exponent bits of bias 7, 3 mantissa bits; exponent field 0 is subnormal; S.1111.111 is
    NaN, so the largest is 1.75 * 2^8 = 448)."""
    values = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            values.update((v, -v))
    return torch.tensor(sorted(values), dtype=torch.float64)


def nearest_e4m3(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x / scale`` (computed in float32, as the kernels divide) rounded to the nearest e4m3
    value, ties to the code whose last mantissa bit is 0, beyond +-448 clamped; returned as
    float8_e4m3fn (the cast of an e4m3 value is exact)."""
    y = x.to(torch.float32).cpu()
    y = (y / scale.cpu() if scale is not None else y).to(torch.float64).flatten().cpu()
    grid = e4m3_values()
    y = y.clamp(float(grid[0]), float(grid[-1]))
    hi = torch.searchsorted(grid, y).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    below, above = y - lo_v, hi_v - y
    pick_hi = (above < below) | ((above == below) & (_last_mantissa_bit(hi_v) == 0))
    out = torch.where(pick_hi, hi_v, lo_v)
    return out.view(x.shape).to(x.device).to(torch.float8_e4m3fn)


def _last_mantissa_bit(values: torch.Tensor) -> torch.Tensor:
    a = values.abs()
    exponent = torch.floor(torch.log2(a.clamp(min=2.0**-6)))
    quantum = torch.where(a < 2.0**-6, torch.full_like(a, 2.0**-9), 2.0 ** (exponent - 3))
    return torch.round(a / quantum).to(torch.int64) & 1


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    for src, dst in block_mapping.tolist():
        kv_cache[..., dst, :, :, :] = kv_cache[..., src, :, :, :].clone()


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    for src, dst in block_mapping.tolist():
        dst_cache[..., dst, :, :, :] = src_cache[..., src, :, :, :].to(dst_cache.device)
