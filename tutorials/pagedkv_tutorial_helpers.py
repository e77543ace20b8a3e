"""Visualization helpers of the pagedkv tutorials (the notebooks in this folder import it).

The notebooks are thin: the paging, sharing, swapping and scheduling all happen in the real
packages (``kvblocks``, ``pagedattn_kernels``, ``pagedkv.scheduler``, ``pagedkv.engine``,
``pagedkv.server``). This module only drives them step by step and draws what they did: HTML
tables of block tables and physical blocks, matplotlib timelines, and ipywidgets controls whose
callbacks redraw the view. Each widget class keeps its state in plain attributes
(``.step``, ``.html.value``, ``.figure``), so the test suite can set a control's value and check
what the notebook would show.
"""

from __future__ import annotations

import html
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

PALETTE = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
)
EMPTY = "#eeeeee"


def color_of(seq_id: int) -> str:
    """A stable color per sequence id."""
    return PALETTE[seq_id % len(PALETTE)]


# --------------------------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------------------------


def pick_device():
    """The GPU when there is one, else the CPU (``torch.device``)."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe_device(device) -> str:
    """A line that says where the notebook runs, e.g. ``cuda (NVIDIA H200)`` or ``cpu (2 threads)``."""
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def synchronize(device) -> None:
    """Wait for queued GPU work so that wall-clock timings mean something."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# 01 paging: several sequences generate token by token over a kvblocks.BlockManager
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SeqSpec:
    """One sequence of the paging demo: its prompt length and how many tokens it generates."""

    prompt_len: int
    output_len: int


@dataclass(slots=True)
class PagingSnapshot:
    """What the paging demo shows after a given step."""

    step: int
    block_tables: dict[int, list[int]]
    num_tokens: dict[int, int]
    finished: dict[int, bool]
    block_owner: list[list[int]]  # physical block id -> sequence ids using it
    block_fill: list[int]  # physical block id -> token slots written
    used_slots: int
    paged_reserved_slots: int
    contiguous_reserved_slots: int
    new_blocks: list[int] = field(default_factory=list)  # blocks allocated in this step

    @property
    def paged_waste(self) -> int:
        """Slots reserved in blocks but not holding a token (at most one partly filled block each)."""
        return self.paged_reserved_slots - self.used_slots

    @property
    def contiguous_waste(self) -> int:
        """Slots a contiguous allocator reserved up front but that hold no token (yet, or ever)."""
        return self.contiguous_reserved_slots - self.used_slots


class PagingDemo:
    """Several sequences prefill their prompts, then decode one token per step.

    The memory is a real ``kvblocks.BlockManager``: at step 0 every prompt's slots are reserved
    (``grow`` by the prompt length); at each later step every unfinished sequence appends one token
    and grows by one slot, which takes a new physical block only when its last block is full.
    ``contiguous_len`` is what a contiguous allocator must reserve per sequence up front (the
    maximum sequence length it could reach), the baseline of the waste comparison.
    """

    def __init__(
        self,
        specs: Sequence[SeqSpec],
        *,
        block_size: int = 4,
        num_gpu_blocks: int = 32,
        contiguous_len: int | None = None,
        seed: int = 0,
    ) -> None:
        if not specs:
            raise ValueError("give at least one SeqSpec(prompt_len, output_len)")
        for s in specs:
            if s.prompt_len < 1 or s.output_len < 0:
                raise ValueError(f"prompt_len must be >= 1 and output_len >= 0, got {s}")
        self.specs = list(specs)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        longest = max(s.prompt_len + s.output_len for s in self.specs)
        self.contiguous_len = contiguous_len if contiguous_len is not None else longest
        if self.contiguous_len < longest:
            raise ValueError(f"contiguous_len must cover the longest sequence ({longest} tokens)")
        self.num_steps = max(s.output_len for s in self.specs)
        rng = random.Random(seed)
        self._tokens = {
            i: [rng.randrange(1, 32000) for _ in range(s.prompt_len + s.output_len)]
            for i, s in enumerate(self.specs)
        }
        self.manager: Any = None
        self.step = -1
        self._new_blocks: list[int] = []
        self.reset()

    def reset(self) -> None:
        """A fresh block manager; the prompts are prefilled (step 0)."""
        from kvblocks import BlockManager

        self.manager = BlockManager(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks)
        before = set()
        for i, s in enumerate(self.specs):
            self.manager.allocate(i, self._tokens[i][: s.prompt_len])
            self.manager.grow(i, s.prompt_len)
        self._new_blocks = sorted(self._used_blocks() - before)
        self.step = 0

    def _used_blocks(self) -> set[int]:
        return {b for i in range(len(self.specs)) for b in self.manager.block_table(i)}

    def advance(self) -> None:
        """One decode step: every unfinished sequence appends a token and grows by one slot."""
        if self.step >= self.num_steps:
            return
        before = self._used_blocks()
        for i, s in enumerate(self.specs):
            n = self.manager.num_tokens(i)
            if n < s.prompt_len + s.output_len:
                self.manager.append_token_ids(i, [self._tokens[i][n]])
                self.manager.grow(i, 1)
        self.step += 1
        self._new_blocks = sorted(self._used_blocks() - before)

    def goto(self, step: int) -> PagingSnapshot:
        """Move to ``step`` (replaying from the start when going back) and describe it."""
        step = max(0, min(int(step), self.num_steps))
        if step < self.step:
            self.reset()
        while self.step < step:
            self.advance()
        return self.snapshot()

    def snapshot(self) -> PagingSnapshot:
        m = self.manager
        owner: list[list[int]] = [[] for _ in range(self.num_gpu_blocks)]
        fill = [0] * self.num_gpu_blocks
        tables, ntok, done = {}, {}, {}
        used = 0
        for i, s in enumerate(self.specs):
            table = m.block_table(i)
            n = m.num_slots(i)
            tables[i], ntok[i] = table, n
            done[i] = n >= s.prompt_len + s.output_len
            used += n
            for logical, b in enumerate(table):
                owner[b].append(i)
                fill[b] = max(fill[b], min(self.block_size, n - logical * self.block_size))
        reserved = sum(len(t) for t in tables.values()) * self.block_size
        return PagingSnapshot(
            step=self.step,
            block_tables=tables,
            num_tokens=ntok,
            finished=done,
            block_owner=owner,
            block_fill=fill,
            used_slots=used,
            paged_reserved_slots=reserved,
            contiguous_reserved_slots=self.contiguous_len * len(self.specs),
            new_blocks=list(self._new_blocks),
        )


def block_tables_html(snap: PagingSnapshot, block_size: int) -> str:
    """Each sequence's block table: logical block i -> physical block id, filled slots shown."""
    rows = []
    for i, table in snap.block_tables.items():
        cells = []
        for logical, b in enumerate(table):
            filled = min(block_size, snap.num_tokens[i] - logical * block_size)
            new = " outline:2px solid #000;" if b in snap.new_blocks else ""
            cells.append(
                f'<td style="background:{color_of(i)};color:#fff;padding:2px 6px;{new}" '
                f'title="logical {logical} -> physical {b}, {filled}/{block_size} slots">'
                f"{b}<sub>{filled}/{block_size}</sub></td>"
            )
        state = "done" if snap.finished[i] else "generating"
        rows.append(
            f'<tr data-seq="{i}"><th style="text-align:left;padding-right:8px">seq {i}</th>'
            f'<td style="padding-right:8px">{snap.num_tokens[i]} tokens, {state}</td>'
            f"{''.join(cells)}</tr>"
        )
    return (
        '<table class="pagedkv-block-tables" style="border-collapse:separate;border-spacing:2px">'
        f"<caption style='text-align:left'>block tables after step {snap.step} "
        "(cell: physical block id, filled/size; outlined: allocated in this step)</caption>"
        f"{''.join(rows)}</table>"
    )


def physical_blocks_html(snap: PagingSnapshot, block_size: int, per_row: int = 16) -> str:
    """The physical block pool: which sequence owns each block and how full it is."""
    cells = []
    for b, owners in enumerate(snap.block_owner):
        if owners:
            pct = 100 * snap.block_fill[b] // block_size
            color = color_of(owners[0])
            style = f"background:linear-gradient(to top,{color} {pct}%,#cfd8e3 {pct}%);color:#000"
            label = ",".join(map(str, owners))
            title = f"block {b}: seq {label}, {snap.block_fill[b]}/{block_size} slots"
        else:
            style, label, title = f"background:{EMPTY};color:#999", "", f"block {b}: free"
        cells.append(
            f'<div class="pagedkv-block" data-block="{b}" title="{title}" style="{style};'
            "width:34px;height:34px;display:inline-block;margin:1px;font-size:10px;"
            f'text-align:center;vertical-align:top;border:1px solid #999">{b}<br>{label}</div>'
        )
        if (b + 1) % per_row == 0:
            cells.append("<br>")
    return f'<div class="pagedkv-pool">{"".join(cells)}</div>'


def waste_html(snap: PagingSnapshot) -> str:
    used = snap.used_slots

    def pct(x: int, of: int) -> str:
        return f"{100 * x / of:.0f}%" if of else "0%"

    return (
        '<table class="pagedkv-waste" style="border-collapse:collapse;text-align:right">'
        "<tr><th></th><th>reserved slots</th><th>holding a token</th><th>wasted</th></tr>"
        f"<tr><td>paged (blocks on demand)</td><td>{snap.paged_reserved_slots}</td><td>{used}</td>"
        f"<td>{snap.paged_waste} ({pct(snap.paged_waste, snap.paged_reserved_slots)})</td></tr>"
        f"<tr><td>contiguous reservation</td><td>{snap.contiguous_reserved_slots}</td><td>{used}</td>"
        f"<td>{snap.contiguous_waste} ({pct(snap.contiguous_waste, snap.contiguous_reserved_slots)})</td></tr>"
        "</table>"
    )


class PagingWidget:
    """A Play control and a step slider over a :class:`PagingDemo`, with live HTML views.

    ``self.slider.value = k`` (what the Play control does on every tick) moves the demo to
    step ``k`` and redraws ``self.tables``, ``self.pool`` and ``self.waste``.
    """

    def __init__(self, demo: PagingDemo, *, interval_ms: int = 400) -> None:
        import ipywidgets as w

        self.demo = demo
        self.play = w.Play(value=0, min=0, max=demo.num_steps, step=1, interval=interval_ms)
        self.slider = w.IntSlider(value=0, min=0, max=demo.num_steps, description="step")
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.tables = w.HTML()
        self.pool = w.HTML()
        self.waste = w.HTML()
        self.slider.observe(self._on_step, names="value")
        self.snapshot = demo.goto(0)
        self._render()
        self.widget = w.VBox(
            [
                w.HBox([self.play, self.slider]),
                self.tables,
                w.HTML("<b>physical blocks</b> (color: owner, height: filled slots)"),
                self.pool,
                self.waste,
            ]
        )

    def _on_step(self, change: dict[str, Any]) -> None:
        self.snapshot = self.demo.goto(change["new"])
        self._render()

    def _render(self) -> None:
        bs = self.demo.block_size
        self.tables.value = block_tables_html(self.snapshot, bs)
        self.pool.value = physical_blocks_html(self.snapshot, bs)
        self.waste.value = waste_html(self.snapshot)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def waste_curve(demo: PagingDemo) -> dict[str, list[int]]:
    """Reserved and used slots at every step, for paging and for contiguous reservation."""
    series: dict[str, list[int]] = {"step": [], "used": [], "paged": [], "contiguous": []}
    for step in range(demo.num_steps + 1):
        snap = demo.goto(step)
        series["step"].append(step)
        series["used"].append(snap.used_slots)
        series["paged"].append(snap.paged_reserved_slots)
        series["contiguous"].append(snap.contiguous_reserved_slots)
    demo.goto(0)
    return series


def plot_waste_curve(series: dict[str, list[int]]):
    """A matplotlib figure of reserved vs used KV slots over the steps."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(series["step"], series["contiguous"], label="reserved: contiguous", color="#c44e52")
    ax.plot(series["step"], series["paged"], label="reserved: paged", color="#4c72b0")
    ax.plot(series["step"], series["used"], "--", label="holding a token", color="#333")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV slots")
    ax.legend()
    fig.tight_layout()
    return fig


@dataclass(slots=True)
class AttentionCheck:
    """Paged attention over scattered blocks vs SDPA over contiguous K/V, per sequence."""

    device: str
    dtype: str
    seq_lens: list[int]
    max_abs_diff: list[float]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(d <= self.tolerance for d in self.max_abs_diff)


def check_paged_attention(
    demo: PagingDemo,
    device,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype=None,
    seed: int = 0,
) -> AttentionCheck:
    """Store random K/V of every sequence in the demo's physical blocks and compare attention.

    The keys and values go to the slots the block manager gave each token
    (``reshape_and_cache``); every other slot of the cache holds random garbage, so a kernel that
    read outside a sequence's blocks would be caught. ``paged_decode_attention`` then attends from
    one new query per sequence through the block tables; the reference is torch's
    ``scaled_dot_product_attention`` over the same K/V laid out contiguously.
    """
    import torch
    import torch.nn.functional as F

    from pagedattn_kernels import paged_decode_attention, reshape_and_cache

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(seed)
    m, bs = demo.manager, demo.block_size
    shape = (demo.num_gpu_blocks, bs, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)  # garbage everywhere
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    seq_ids = list(range(len(demo.specs)))
    lens = [m.num_slots(i) for i in seq_ids]
    ks, vs = [], []
    for i, n in zip(seq_ids, lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        slots = torch.tensor(m.slots(i, 0, n), dtype=torch.int64, device=device)
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    width = max(len(m.block_table(i)) for i in seq_ids)
    tables = torch.zeros(len(seq_ids), width, dtype=torch.int32)
    for row, i in enumerate(seq_ids):
        t = m.block_table(i)
        tables[row, : len(t)] = torch.tensor(t, dtype=torch.int32)
    query = torch.randn(len(seq_ids), num_heads, head_dim, generator=gen).to(device, dtype)
    out = paged_decode_attention(
        query,
        k_cache,
        v_cache,
        tables.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
    )
    group = num_heads // num_kv_heads
    diffs = []
    for row, (k, v) in enumerate(zip(ks, vs)):
        q = query[row].unsqueeze(1).unsqueeze(0)  # [1, heads, 1, dim]
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        ref = F.scaled_dot_product_attention(q, kk, vv)[0, :, 0, :]
        diffs.append(float((out[row].float() - ref.float()).abs().max()))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return AttentionCheck(str(device), str(dtype).replace("torch.", ""), lens, diffs, tol)


def attention_check_html(check: AttentionCheck) -> str:
    rows = "".join(
        f"<tr><td>seq {i}</td><td>{n}</td><td>{d:.2e}</td></tr>"
        for i, (n, d) in enumerate(zip(check.seq_lens, check.max_abs_diff))
    )
    verdict = "equal within tolerance" if check.ok else "DIFFERENT"
    return (
        f"<p>device <b>{html.escape(check.device)}</b>, {check.dtype}: paged attention and "
        f"contiguous SDPA are <b>{verdict}</b> (tolerance {check.tolerance:g})</p>"
        '<table class="pagedkv-attention-check"><tr><th>sequence</th><th>context tokens</th>'
        f"<th>max |paged - SDPA|</th></tr>{rows}</table>"
    )


# --------------------------------------------------------------------------------------------
# Small shared utilities
# --------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], device=None) -> tuple[Any, float]:
    """Run ``fn`` and return (its result, wall seconds), synchronizing the GPU around it."""
    if device is not None:
        synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device is not None:
        synchronize(device)
    return result, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# 05 scheduler: FCFS, token budget and chunked prefill on a timeline (pagedkv.scheduler)
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class TimelineRequest:
    """A request of the scheduler timeline: it arrives before step ``arrival_step``."""

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    n: int = 1


@dataclass(slots=True)
class Timeline:
    """What the scheduler did at every step: per request, its state and the tokens it computed."""

    request_ids: list[str]
    # per step: request id -> ("prefill" | "decode", tokens) for the scheduled ones
    scheduled: list[dict[str, tuple[str, int]]]
    # per step: request id -> "waiting" | "swapped" for the others that have arrived
    queued: list[dict[str, str]]
    preempted: list[list[tuple[str, str]]]
    batched_tokens: list[int]
    gpu_kv_usage: list[float]
    budget: int
    finish_step: dict[str, int]

    @property
    def num_steps(self) -> int:
        return len(self.scheduled)

    @property
    def num_preemptions(self) -> int:
        return sum(len(p) for p in self.preempted)


def run_timeline(
    requests: Sequence[TimelineRequest],
    *,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    enable_chunked_prefill: bool = True,
    preemption_mode: str | None = None,
    max_steps: int = 5000,
) -> Timeline:
    """Run ``requests`` through a real ``pagedkv.scheduler.Scheduler`` with a stand-in model.

    The stand-in "model" samples token 7 for every sequence that asks for a sample (no EOS), so
    each request generates exactly ``max_tokens`` tokens; everything else (which sequences run,
    how many tokens each, chunking, preemption) is the scheduler's own decision.
    """
    from pagedkv.scheduler import RequestParams, Scheduler, SchedulerConfig

    config = SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode,
    )
    sched = Scheduler(config)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    tl = Timeline([r.request_id for r in requests], [], [], [], [], [], max_num_batched_tokens, {})
    step = 0
    while pending or sched.has_unfinished():
        if step >= max_steps:
            raise RuntimeError(f"the timeline did not finish within {max_steps} steps")
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            params = RequestParams(n=r.n, max_tokens=r.max_tokens)
            sched.add_request(r.request_id, list(range(100, 100 + r.prompt_len)), params)
        out = sched.schedule()
        row: dict[str, tuple[str, int]] = {}
        for ss in out.scheduled:
            kind, tokens = row.get(ss.request_id, ("decode", 0))
            kind = "prefill" if ss.is_prefill else kind
            row[ss.request_id] = (kind, tokens + ss.num_tokens)
        queued = {g.request_id: "waiting" for g in sched.waiting}
        queued.update({g.request_id: "swapped" for g in sched.swapped})
        tl.scheduled.append(row)
        tl.queued.append(queued)
        tl.preempted.append([(rid, str(mode)) for rid, mode in out.preempted])
        tl.batched_tokens.append(out.num_batched_tokens)
        samples = {ss.seq_id: [7] for ss in out.scheduled if ss.do_sample}
        result = sched.update(out, samples)
        tl.gpu_kv_usage.append(sched.stats().gpu_kv_usage)
        for g in result.finished_groups:
            tl.finish_step[g.request_id] = step
        step += 1
    return tl


def plot_timeline(tl: Timeline, title: str = ""):
    """Requests (rows) over steps (columns): prefill chunks, decodes, waiting, swapped, preemptions."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"prefill": "#dd8452", "decode": "#4c72b0", "waiting": "#dddddd", "swapped": "#8172b3"}
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(9, 1.2 + 0.35 * len(tl.request_ids) + 1.6), sharex=True,
        gridspec_kw={"height_ratios": [max(2, len(tl.request_ids)), 2]},
    )  # fmt: skip
    rows = {rid: k for k, rid in enumerate(tl.request_ids)}
    for step in range(tl.num_steps):
        for rid, (kind, tokens) in tl.scheduled[step].items():
            ax.broken_barh([(step, 1)], (rows[rid] - 0.4, 0.8), color=colors[kind])
            if kind == "prefill":
                ax.text(step + 0.5, rows[rid], str(tokens), ha="center", va="center", fontsize=6)
        for rid, state in tl.queued[step].items():
            ax.broken_barh([(step, 1)], (rows[rid] - 0.4, 0.8), color=colors[state])
        for rid, _mode in tl.preempted[step]:
            ax.plot(step + 0.5, rows[rid], "x", color="#c44e52", markersize=8, mew=2)
    ax.set_yticks(range(len(tl.request_ids)), tl.request_ids)
    ax.invert_yaxis()
    ax.set_title(title or "one row per request, one column per step (numbers: prefill tokens)")
    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    handles.append(plt.Line2D([], [], marker="x", color="#c44e52", ls="", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.bar(range(tl.num_steps), tl.batched_tokens, width=1.0, align="edge", color="#55a868")
    ax2.axhline(tl.budget, color="#c44e52", ls="--", lw=1, label=f"token budget {tl.budget}")
    ax2.set_ylabel("tokens in batch")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def figure_png(fig) -> bytes:
    """A figure as PNG bytes (for an ipywidgets.Image), and closed so it is not drawn twice."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


class SchedulerWidget:
    """Token budget, chunked prefill, KV blocks and preemption mode controls over a timeline.

    Changing any control re-runs the real scheduler on the same requests and redraws
    ``self.image`` (the timeline as PNG) and ``self.summary``; ``self.timeline`` holds the data,
    and ``self.error`` the scheduler's message when a setting is refused.
    """

    def __init__(self, requests: Sequence[TimelineRequest], **defaults: Any) -> None:
        import ipywidgets as w

        self.requests = list(requests)
        self.fixed = {
            k: v
            for k, v in defaults.items()
            if k
            not in (
                "max_num_batched_tokens",
                "num_gpu_blocks",
                "enable_chunked_prefill",
                "preemption_mode",
            )
        }
        self.budget = w.IntSlider(
            value=defaults.get("max_num_batched_tokens", 64), min=8, max=256, step=8,
            description="token budget", style={"description_width": "initial"},
        )  # fmt: skip
        self.blocks = w.IntSlider(
            value=defaults.get("num_gpu_blocks", 64), min=8, max=128, step=4,
            description="GPU blocks", style={"description_width": "initial"},
        )  # fmt: skip
        self.chunked = w.Checkbox(
            value=defaults.get("enable_chunked_prefill", True), description="chunked prefill"
        )
        self.mode = w.Dropdown(
            options=[("default", None), ("recompute", "recompute"), ("swap", "swap")],
            value=defaults.get("preemption_mode"), description="preemption",
        )  # fmt: skip
        self.image = w.Image(format="png")
        self.summary = w.HTML()
        self.timeline: Timeline | None = None
        self.error: str | None = None
        for control in (self.budget, self.blocks, self.chunked, self.mode):
            control.observe(self._on_change, names="value")
        self._run()
        self.widget = w.VBox(
            [
                w.HBox([self.budget, self.blocks]),
                w.HBox([self.chunked, self.mode]),
                self.summary,
                self.image,
            ]
        )

    def _on_change(self, change: dict[str, Any]) -> None:
        self._run()

    def _run(self) -> None:
        try:
            self.timeline = run_timeline(
                self.requests,
                max_num_batched_tokens=self.budget.value,
                num_gpu_blocks=self.blocks.value,
                enable_chunked_prefill=self.chunked.value,
                preemption_mode=self.mode.value,
                **self.fixed,
            )
        except ValueError as exc:
            self.error = str(exc)
            self.timeline = None
            self.summary.value = (
                f'<p class="pagedkv-error" style="color:#c44e52">{html.escape(str(exc))}</p>'
            )
            return
        self.error = None
        tl = self.timeline
        self.summary.value = (
            f'<p class="pagedkv-summary">{tl.num_steps} steps, {tl.num_preemptions} preemptions, '
            f"largest batch {max(tl.batched_tokens)} tokens (budget {tl.budget}), "
            f"peak KV usage {max(tl.gpu_kv_usage):.0%}</p>"
        )
        self.image.value = figure_png(plot_timeline(tl))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
