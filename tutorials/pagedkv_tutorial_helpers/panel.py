"""The device panel: what the hardware holds while a notebook runs the engine or a kernel.

Device name, the KV cache tensor (shape, dtype, bytes, bytes per token), blocks used and free,
the memory the process has allocated (``torch.cuda.memory_allocated`` on a GPU, the resident
set on the CPU) and kernel times measured by the notebook (:mod:`.timing`).
"""

from __future__ import annotations

import html
from collections.abc import Mapping

from pagedkv_tutorial_helpers.env import describe_device
from pagedkv_tutorial_helpers.timing import Timing

MiB = 1 << 20


def _bytes(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def device_panel(
    device,
    *,
    kv_cache=None,
    num_blocks: int | None = None,
    block_size: int | None = None,
    num_free_blocks: int | None = None,
    swap_cache=None,
    kernel_times: Mapping[str, Timing] | None = None,
    extra: Mapping[str, str] | None = None,
    title: str = "device panel",
):
    """An HTML panel (``IPython.display.HTML``) of the device and what it holds.

    ``kv_cache``: the KV cache tensor; with ``num_blocks`` and ``block_size`` the panel also
    shows bytes per block and per token (the tensor's bytes divided by its slots).
    """
    import torch
    from IPython.display import HTML

    rows: list[tuple[str, str]] = [("device", describe_device(device))]
    if kv_cache is not None:
        rows.append(
            (
                "KV cache tensor",
                f"{tuple(kv_cache.shape)} {str(kv_cache.dtype).replace('torch.', '')}, "
                f"{_bytes(kv_cache.numel() * kv_cache.element_size())}",
            )
        )
        if num_blocks and block_size:
            total = kv_cache.numel() * kv_cache.element_size()
            rows.append(("bytes per block", _bytes(total / num_blocks)))
            rows.append(("bytes per token", f"{total // (num_blocks * block_size):,} B"))
    if num_blocks is not None and num_free_blocks is not None:
        used = num_blocks - num_free_blocks
        rows.append(
            (
                "blocks",
                f"{used} used, {num_free_blocks} free of {num_blocks} "
                f"({100 * used / num_blocks:.0f}% used)",
            )
        )
    if swap_cache is not None:
        rows.append(
            (
                "swap space (host)",
                f"{tuple(swap_cache.shape)}, "
                f"{_bytes(swap_cache.numel() * swap_cache.element_size())}"
                + (", pinned" if swap_cache.is_pinned() else ""),
            )
        )
    if device.type == "cuda":
        rows.append(
            (
                "memory allocated (torch)",
                f"{_bytes(torch.cuda.memory_allocated(device))} "
                f"(peak {_bytes(torch.cuda.max_memory_allocated(device))}) of "
                f"{_bytes(torch.cuda.get_device_properties(device).total_memory)}",
            )
        )
    else:
        rss = _resident_bytes()
        if rss is not None:
            rows.append(("process resident memory", _bytes(rss)))
    for name, timing in (kernel_times or {}).items():
        rows.append((name, f"{timing.ms()} [{timing.clock}]"))
    for name, value in (extra or {}).items():
        rows.append((name, value))
    body = "".join(
        f'<tr><th style="text-align:left;padding-right:12px">{html.escape(k)}</th>'
        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    return HTML(
        '<div class="pagedkv-device-panel" style="border:1px solid #999;padding:4px 8px;'
        f'display:inline-block"><b>{html.escape(title)}</b><table>{body}</table></div>'
    )


def engine_panel(engine, *, record=None, kernel_times: Mapping[str, Timing] | None = None,
                 **extra: str):  # fmt: skip
    """The device panel of a ``pagedkv.engine.LLMEngine``: its runner's KV cache and swap
    space, its block counts and ``kernel_times``. The counts are those after the step of
    ``record`` (a ``StepRecord``: pass the step a view shows, or the fullest one), else the
    engine's now (``engine.get_stats()``), which after a finished run are all free."""
    if record is not None:
        total, free = record.num_gpu_blocks, record.num_free_blocks
        title = f"device panel: {engine.model_config.name}, after step {record.step}"
    else:
        stats = engine.get_stats()
        total = stats.num_gpu_blocks
        free = total - round(stats.gpu_kv_usage * total)
        title = f"device panel: {engine.model_config.name}"
    return device_panel(
        engine.device,
        kv_cache=engine.runner.kv_cache,
        num_blocks=total,
        block_size=engine.args.block_size,
        num_free_blocks=free,
        swap_cache=engine.runner.swap_cache,
        kernel_times=kernel_times,
        extra=extra,
        title=title,
    )
