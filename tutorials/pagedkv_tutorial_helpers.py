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
    (``allocate_slots`` by the prompt length); at each later step every unfinished sequence appends
    one token to its own token list (which the manager reads) and reserves one more slot, which
    takes a new physical block only when its last block is full.
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
        self._live: dict[int, list[int]] = {}
        self.step = -1
        self._new_blocks: list[int] = []
        self.reset()

    def reset(self) -> None:
        """A fresh block manager; the prompts are prefilled (step 0)."""
        from kvblocks import BlockManager

        self.manager = BlockManager(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks)
        before = set()
        # Each sequence's live token list: ours, the manager keeps a reference to it.
        self._live = {i: self._tokens[i][: s.prompt_len] for i, s in enumerate(self.specs)}
        for i, s in enumerate(self.specs):
            self.manager.allocate(i, self._live[i])
            self.manager.allocate_slots(i, s.prompt_len)
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
                self._live[i].append(self._tokens[i][n])
                self.manager.allocate_slots(i, 1)
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


# --------------------------------------------------------------------------------------------
# 05 scheduler, part 2: the simulator against contiguous-reservation baselines
# --------------------------------------------------------------------------------------------

POLICY_COLORS = {"paged": "#4c72b0", "oracle": "#55a868", "pow2": "#dd8452", "max": "#c44e52"}


def simulate(
    rates: Sequence[float],
    *,
    workload: str = "sharegpt",
    num_requests: int = 200,
    model: str = "opt-13b",
    gpu: str = "a100-40gb",
    kv_gb: float = 12.0,
    seed: int = 0,
) -> dict[float, dict[str, Any]]:
    """Run ``pagedkv.bench.sim`` for every policy at every rate: rate -> policy -> result."""
    from pagedkv.bench import sim
    from pagedkv.bench.cost_model import get_gpu, get_model
    from pagedkv.bench.workloads import make_requests

    setup = sim.SimSetup(model=get_model(model), gpu=get_gpu(gpu), kv_bytes=int(kv_gb * (1 << 30)))
    results: dict[float, dict[str, Any]] = {}
    for rate in rates:
        requests = make_requests(workload, rate, num_requests=num_requests, seed=seed)
        results[rate] = {p: sim.run_policy(p, requests, setup, rate) for p in sim.POLICIES}
    return results


def simulation_table_html(results: dict[str, Any]) -> str:
    """One rate's results: a row per policy."""
    rows = "".join(
        f'<tr data-policy="{p}"><td><b>{p}</b></td><td>{r.avg_batched_requests:.1f}</td>'
        f"<td>{r.kv_utilization:.0%}</td><td>{r.preemptions}</td>"
        f"<td>{r.normalized_latency_s:.3f}</td></tr>"
        for p, r in results.items()
    )
    return (
        '<table class="pagedkv-sim" style="text-align:right"><tr><th>policy</th>'
        "<th>requests in a batch</th><th>KV utilization</th><th>preemptions</th>"
        f"<th>normalized latency (s/token)</th></tr>{rows}</table>"
    )


def plot_simulation(results: dict[float, dict[str, Any]]):
    """Normalized latency against request rate, per policy (the PagedAttention paper's plot)."""
    import matplotlib.pyplot as plt

    rates = sorted(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for policy, color in POLICY_COLORS.items():
        axes[0].plot(
            rates,
            [results[r][policy].normalized_latency_s for r in rates],
            "o-",
            color=color,
            label=policy,
        )
        axes[1].plot(
            rates,
            [results[r][policy].avg_batched_requests for r in rates],
            "o-",
            color=color,
            label=policy,
        )
    axes[0].set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("normalized latency (s/token)")
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("requests in a batch")
    axes[0].legend()
    fig.tight_layout()
    return fig


class SimulationWidget:
    """A request-rate slider: the simulator runs every policy at that rate and fills the table."""

    def __init__(
        self, rates: Sequence[float] = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0), **sim_options: Any
    ) -> None:
        import ipywidgets as w

        self.sim_options = sim_options
        self.rate = w.SelectionSlider(options=list(rates), value=rates[0], description="req/s")
        self.table = w.HTML()
        self.results: dict[str, Any] = {}
        self.rate.observe(self._on_change, names="value")
        self._run()
        self.widget = w.VBox([self.rate, self.table])

    def _on_change(self, change: dict[str, Any]) -> None:
        self._run()

    def _run(self) -> None:
        self.results = simulate([self.rate.value], **self.sim_options)[self.rate.value]
        self.table.value = simulation_table_html(self.results)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


# --------------------------------------------------------------------------------------------
# 02-04: the real engine on the embedded model, traced step by step
# --------------------------------------------------------------------------------------------


class EngineKit:
    """Builds engines that share the model (and tokenizer) of one ``pagedkv.engine.LLM``.

    Each tutorial compares engine settings (block size, KV budget, preemption mode, prefix
    caching); loading SmolLM2 once keeps the notebooks fast. Every engine is a real
    ``pagedkv.engine.LLMEngine`` with its own KV cache and scheduler.
    """

    def __init__(self, llm) -> None:
        from pagedkv.engine import LLMEngine

        self.llm = llm
        self.base = llm.engine
        self.device = self.base.device
        self.options = {k: v for k, v in vars(self.base.args).items() if k not in ("device",)}
        self.model = self.base.runner.model
        self.tokenizer = self.base.get_tokenizer()
        tokenizer = self.tokenizer

        class _SharedTokenizerEngine(LLMEngine):
            def _load_tokenizer(self):  # the one already loaded
                return tokenizer

        self._engine_cls = _SharedTokenizerEngine

    def engine(self, **options: Any):
        """A new engine with the base options overridden by ``options``, on the shared model."""
        from pagedkv.engine import EngineArgs

        args = EngineArgs(**{**self.options, **options, "device": self.device.type})
        return self._engine_cls(args, model=self.model)

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])


@dataclass(slots=True)
class StepRecord:
    """What one engine step did, read from the scheduler and its block manager."""

    step: int
    num_batched_tokens: int
    copies: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    preempted: list[tuple[str, str]]
    # request id -> seq id -> (block table, location "gpu"|"cpu", num tokens)
    tables: dict[str, dict[int, tuple[list[int], str, int]]]
    ref_counts: dict[int, int]  # GPU block -> ref count, for blocks in use
    gpu_used: int
    gpu_total: int
    cpu_used: int
    blocks_without_sharing: int
    finished: list[str]
    running: list[str]
    swapped: list[str]
    waiting: list[str]
    elapsed_s: float

    @property
    def blocks_saved(self) -> int:
        return self.blocks_without_sharing - self.gpu_used - self.cpu_used


class EngineTrace:
    """Runs an engine to completion one ``step()`` at a time and records every step.

    The scheduler's output of each step (copy-on-write pairs, swaps, preemptions) is captured by
    wrapping ``engine.scheduler.schedule`` for the duration of the run; the block tables and ref
    counts come from ``engine.scheduler.block_manager`` after the step.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self.outputs: dict[str, Any] = {}

    def run(self, requests: Sequence[tuple[str, Any, Any]], max_steps: int = 2000) -> EngineTrace:
        """``requests``: (request id, prompt text or token ids, SamplingParams)."""
        eng = self.engine
        sched = eng.scheduler
        for rid, prompt, params in requests:
            eng.add_request(rid, prompt, params)
        original = sched.schedule
        captured: list[Any] = []

        def schedule():
            out = original()
            captured.append(out)
            return out

        sched.schedule = schedule
        try:
            while eng.has_unfinished_requests():
                if len(self.records) >= max_steps:
                    raise RuntimeError(f"the engine did not finish within {max_steps} steps")
                captured.clear()
                t0 = time.perf_counter()
                outs = eng.step()
                elapsed = time.perf_counter() - t0
                for o in outs:
                    self.outputs[o.request_id] = o
                out = captured[-1] if captured else None
                self.records.append(self._record(len(self.records), out, outs, elapsed))
        finally:
            del sched.schedule  # back to the class's method
        return self

    def _record(self, step: int, out, outs, elapsed: float) -> StepRecord:
        sched = self.engine.scheduler
        bm = sched.block_manager
        tables: dict[str, dict[int, tuple[list[int], str, int]]] = {}
        refs: dict[int, int] = {}
        without = 0
        for group in (*sched.running, *sched.swapped):
            for seq in group.seqs:
                if seq.is_finished or not bm.has_seq(seq.seq_id):
                    continue
                table = bm.block_table(seq.seq_id)
                where = bm.location(seq.seq_id)
                tables.setdefault(group.request_id, {})[seq.seq_id] = (
                    table,
                    where,
                    bm.num_slots(seq.seq_id),
                )
                without += len(table)
                if where == "gpu":
                    for b in table:
                        refs[b] = bm.gpu_pool.ref_count(b)
        kv = bm.stats()
        return StepRecord(
            step=step,
            num_batched_tokens=out.num_batched_tokens if out is not None else 0,
            copies=list(out.blocks_to_copy) if out is not None else [],
            swap_out=list(out.blocks_to_swap_out) if out is not None else [],
            swap_in=list(out.blocks_to_swap_in) if out is not None else [],
            preempted=[(r, str(m)) for r, m in out.preempted] if out is not None else [],
            tables=tables,
            ref_counts=refs,
            gpu_used=kv.gpu_used,
            gpu_total=kv.gpu_total,
            cpu_used=kv.cpu_used,
            blocks_without_sharing=without,
            finished=[o.request_id for o in outs if o.finished],
            running=[g.request_id for g in sched.running],
            swapped=[g.request_id for g in sched.swapped],
            waiting=[g.request_id for g in sched.waiting],
            elapsed_s=elapsed,
        )

    # -- summaries ---------------------------------------------------------------------------

    @property
    def total_s(self) -> float:
        return sum(r.elapsed_s for r in self.records)

    @property
    def num_preemptions(self) -> int:
        return sum(len(r.preempted) for r in self.records)

    def copy_steps(self) -> list[int]:
        """Steps in which the scheduler asked for a copy-on-write."""
        return [r.step for r in self.records if r.copies]

    def swap_steps(self) -> list[int]:
        return [r.step for r in self.records if r.swap_out or r.swap_in]


def step_html(rec: StepRecord, block_size: int) -> str:
    """One step: events, then each sequence's block table with the ref count of every block."""
    events = []
    if rec.preempted:
        events.append("preempted: " + ", ".join(f"{r} ({m})" for r, m in rec.preempted))
    if rec.swap_out:
        events.append(f"swapped out {len(rec.swap_out)} blocks (GPU → CPU)")
    if rec.swap_in:
        events.append(f"swapped in {len(rec.swap_in)} blocks (CPU → GPU)")
    if rec.copies:
        events.append("copy-on-write: " + ", ".join(f"block {s} → {d}" for s, d in rec.copies))
    if rec.finished:
        events.append("finished: " + ", ".join(rec.finished))
    event_html = (
        "".join(f'<li class="pagedkv-event">{html.escape(e)}</li>' for e in events)
        or "<li>decode</li>"
    )
    copied_to = {d for _, d in rec.copies}
    rows = []
    for rid, seqs in rec.tables.items():
        for seq_id, (table, where, ntok) in seqs.items():
            cells = []
            for b in table:
                ref = rec.ref_counts.get(b, 1) if where == "gpu" else 1
                shared = ref > 1
                color = "#dd8452" if shared else ("#8172b3" if where == "cpu" else "#4c72b0")
                outline = "outline:2px solid #c44e52;" if b in copied_to and where == "gpu" else ""
                cells.append(
                    f'<td style="background:{color};color:#fff;padding:2px 5px;{outline}" '
                    f'title="block {b} ({where}), ref count {ref}">{b}<sup>×{ref}</sup></td>'
                )
            rows.append(
                f'<tr data-seq="{seq_id}"><th style="text-align:left;padding-right:6px">{html.escape(rid)} '
                f"seq {seq_id}</th><td>{where}</td><td>{ntok} tok</td>{''.join(cells)}</tr>"
            )
    return (
        f'<div class="pagedkv-step" data-step="{rec.step}"><b>step {rec.step}</b>: '
        f"{rec.num_batched_tokens} tokens in the batch, GPU blocks used {rec.gpu_used}/{rec.gpu_total}"
        f"{f', CPU blocks {rec.cpu_used}' if rec.cpu_used else ''}, "
        f"{rec.blocks_without_sharing} without sharing (saved {rec.blocks_saved})"
        f'<ul style="margin:2px 0">{event_html}</ul>'
        '<table class="pagedkv-engine-tables" style="border-collapse:separate;border-spacing:2px">'
        f"{''.join(rows)}</table>"
        "<small>orange: shared block (ref count > 1), blue: private, purple: on the CPU, "
        "red outline: the copy made by copy-on-write</small></div>"
    )


class TraceWidget:
    """A step slider over a recorded :class:`EngineTrace` (with Play), showing :func:`step_html`."""

    def __init__(self, trace: EngineTrace, *, start: int = 0, interval_ms: int = 500) -> None:
        import ipywidgets as w

        self.trace = trace
        last = len(trace.records) - 1
        self.play = w.Play(value=start, min=0, max=last, interval=interval_ms)
        self.slider = w.IntSlider(value=start, min=0, max=last, description="step")
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.view = w.HTML()
        self.slider.observe(self._on_step, names="value")
        self._show(start)
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.view])

    def _on_step(self, change: dict[str, Any]) -> None:
        self._show(change["new"])

    def _show(self, step: int) -> None:
        self.record = self.trace.records[step]
        self.view.value = step_html(self.record, self.trace.engine.args.block_size)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def plot_sharing(trace: EngineTrace, title: str = ""):
    """KV blocks in use per step, against what the same sequences would use without sharing."""
    import matplotlib.pyplot as plt

    steps = [r.step for r in trace.records]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(
        steps,
        [r.blocks_without_sharing for r in trace.records],
        label="without sharing",
        color="#c44e52",
    )
    ax.plot(
        steps,
        [r.gpu_used + r.cpu_used for r in trace.records],
        label="with sharing (in use)",
        color="#4c72b0",
    )
    for s in trace.copy_steps():
        ax.axvline(s, color="#dd8452", lw=0.8, ls=":")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.set_title(title or "dotted: a step with copy-on-write")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_states(trace: EngineTrace, request_ids: Sequence[str], title: str = ""):
    """Per request and step: running, swapped out, waiting (incl. recompute), and preemptions."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"running": "#4c72b0", "swapped": "#8172b3", "waiting": "#dddddd"}
    rows = {rid: k for k, rid in enumerate(request_ids)}
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.4 * len(rows)))
    for rec in trace.records:
        for state in ("running", "swapped", "waiting"):
            for rid in getattr(rec, state):
                if rid in rows:
                    ax.broken_barh([(rec.step, 1)], (rows[rid] - 0.4, 0.8), color=colors[state])
        for rid, _mode in rec.preempted:
            if rid in rows:
                ax.plot(rec.step + 0.5, rows[rid], "x", color="#c44e52", mew=2)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.set_title(title)
    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    handles.append(plt.Line2D([], [], marker="x", color="#c44e52", ls="", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# 03 swapping: the cost of one preemption, swap against recompute, by block size
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PreemptionCost:
    block_size: int
    num_tokens: int
    swap_out_s: float
    swap_in_s: float
    recompute_s: float

    @property
    def swap_s(self) -> float:
        """Out and back in: what a swapped group costs."""
        return self.swap_out_s + self.swap_in_s


def measure_preemption_cost(
    kit: EngineKit, block_size: int, num_tokens: int = 256, repeats: int = 3
) -> PreemptionCost:
    """Time the two ways to give back (and get back) the KV cache of ``num_tokens`` tokens.

    Swap: ``pagedattn_kernels.swap_blocks`` moves the blocks of every layer's K and V cache (the
    model's real shape) from the device cache to a host cache and back (pinned memory on a GPU).
    Recompute: one prefill forward pass of the same tokens through the real engine
    (a request with ``max_tokens=1``). Medians over ``repeats``, after one untimed warm-up of
    each (first calls compile kernels).
    """
    import statistics

    import torch

    from pagedattn_kernels import swap_blocks
    from pagedkv.engine import SamplingParams

    mc = kit.base.model_config
    dev = kit.device
    nblocks = -(-num_tokens // block_size)
    dtype = mc.dtype
    shape = (mc.num_layers, 2, nblocks * 2, block_size, mc.num_kv_heads, mc.head_dim)
    gpu_cache = torch.randn(shape, dtype=dtype, device=dev)
    cpu_cache = torch.zeros(shape, dtype=dtype, pin_memory=dev.type == "cuda")
    perm = torch.randperm(nblocks * 2)[:nblocks]  # scattered blocks, as after real allocation
    out_map = torch.stack([perm, torch.arange(nblocks)], dim=1)
    in_map = torch.stack([torch.arange(nblocks), perm], dim=1)
    outs, ins = [], []
    swap_blocks(gpu_cache, cpu_cache, out_map)  # warm-up: first-call costs are not the swap's
    swap_blocks(cpu_cache, gpu_cache, in_map)
    synchronize(dev)
    for _ in range(repeats):
        _, t = timed(lambda: swap_blocks(gpu_cache, cpu_cache, out_map), dev)
        outs.append(t)
        _, t = timed(lambda: swap_blocks(cpu_cache, gpu_cache, in_map), dev)
        ins.append(t)
    engine = kit.engine(block_size=block_size)
    prompt = [
        int(x)
        for x in torch.randint(
            100, 20000, (num_tokens,), generator=torch.Generator().manual_seed(0)
        )
    ]
    recs = []
    for i in range(-1, repeats):  # i = -1 warms up (kernel compilation, CUDA graphs)
        engine.add_request(f"recompute-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        synchronize(dev)
        if i >= 0:
            recs.append(time.perf_counter() - t0)
    return PreemptionCost(
        block_size,
        num_tokens,
        statistics.median(outs),
        statistics.median(ins),
        statistics.median(recs),
    )


def preemption_cost_html(costs: Sequence[PreemptionCost]) -> str:
    rows = "".join(
        f'<tr data-block-size="{c.block_size}"><td>{c.block_size}</td><td>{c.swap_out_s * 1e3:.2f}</td>'
        f"<td>{c.swap_in_s * 1e3:.2f}</td><td>{c.swap_s * 1e3:.2f}</td><td>{c.recompute_s * 1e3:.1f}</td>"
        f"<td><b>{'swap' if c.swap_s < c.recompute_s else 'recompute'}</b></td></tr>"
        for c in costs
    )
    return (
        '<table class="pagedkv-preemption-cost" style="text-align:right"><tr><th>block size</th>'
        "<th>swap out (ms)</th><th>swap in (ms)</th><th>swap total (ms)</th>"
        f"<th>recompute (ms)</th><th>cheaper</th></tr>{rows}</table>"
    )


# --------------------------------------------------------------------------------------------
# 04 prefix sharing: how many blocks k requests with one system prompt need
# --------------------------------------------------------------------------------------------


def prefix_sharing_blocks(
    prompts: Sequence[Sequence[int]], *, block_size: int, enable_prefix_caching: bool
) -> dict[str, int]:
    """Allocate every prompt in a real ``kvblocks.BlockManager`` (as the scheduler does, one
    after the other) and count the GPU blocks in use and the tokens found in the cache."""
    from kvblocks import BlockManager

    need = sum(-(-len(p) // block_size) for p in prompts)
    bm = BlockManager(
        block_size=block_size, num_gpu_blocks=need + 1, enable_prefix_caching=enable_prefix_caching
    )
    cached = 0
    for i, p in enumerate(prompts):
        hit = bm.allocate(i, list(p))
        cached += hit
        bm.allocate_slots(i, len(p) - hit)
    st = bm.stats()
    return {
        "blocks": st.gpu_used,
        "cached_tokens": cached,
        "prompt_tokens": sum(len(p) for p in prompts),
        "saved_by_sharing": st.blocks_saved_by_sharing,
    }


class PrefixSharingWidget:
    """A slider for how many requests share the system prompt; blocks with and without caching."""

    def __init__(self, prompts: Sequence[Sequence[int]], *, block_size: int = 16) -> None:
        import ipywidgets as w

        if not prompts:
            raise ValueError("give at least one tokenized prompt")
        self.prompts = [list(p) for p in prompts]
        self.block_size = block_size
        self.count = w.IntSlider(value=1, min=1, max=len(self.prompts), description="requests")
        self.view = w.HTML()
        self.count.observe(self._on_change, names="value")
        self._run()
        self.widget = w.VBox([self.count, self.view])

    def _on_change(self, change: dict[str, Any]) -> None:
        self._run()

    def _run(self) -> None:
        k = self.count.value
        chosen = self.prompts[:k]
        self.with_cache = prefix_sharing_blocks(
            chosen, block_size=self.block_size, enable_prefix_caching=True
        )
        self.without = prefix_sharing_blocks(
            chosen, block_size=self.block_size, enable_prefix_caching=False
        )
        w_, wo = self.with_cache, self.without

        def bar(n: int, color: str) -> str:
            return f'<span style="display:inline-block;background:{color};height:12px;width:{4 * n}px"></span>'

        self.view.value = (
            f'<table class="pagedkv-prefix"><tr><th></th><th>KV blocks</th><th></th>'
            f"<th>prompt tokens taken from the cache</th></tr>"
            f'<tr data-mode="without"><td>without prefix caching</td><td>{wo["blocks"]}</td>'
            f"<td>{bar(wo['blocks'], '#c44e52')}</td><td>0 of {wo['prompt_tokens']}</td></tr>"
            f'<tr data-mode="with"><td>with prefix caching</td><td>{w_["blocks"]}</td>'
            f"<td>{bar(w_['blocks'], '#4c72b0')}</td><td>{w_['cached_tokens']} of {w_['prompt_tokens']}</td></tr>"
            "</table>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


# --------------------------------------------------------------------------------------------
# 06 serving: `pagedkv serve` in a subprocess
# --------------------------------------------------------------------------------------------


class ServerProcess:
    """``pagedkv serve`` on 127.0.0.1 in a subprocess: start, wait until healthy, stop.

    The command is the ``pagedkv`` script of the running interpreter's environment, so the
    notebook talks to the server of the packages it imports.
    """

    def __init__(self, *args: str, port: int | None = None, log_path: str | None = None) -> None:
        import socket
        import sys
        from pathlib import Path

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        exe = Path(sys.executable).parent / "pagedkv"
        self.command = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        self.log_path = log_path
        self.proc = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600) -> ServerProcess:
        import subprocess
        import tempfile
        import urllib.request

        if self.log_path:
            self._log = open(self.log_path, "w+")  # noqa: SIM115 (closed by stop())
        else:
            self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pagedkv serve exited with {self.proc.returncode}:\n{self.logs()[-3000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"pagedkv serve was not healthy within {timeout_s} s:\n{self.logs()[-3000:]}"
                )
            time.sleep(0.5)

    def logs(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it does not exit in time."""
        import subprocess

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_metrics(text: str, prefixes: Sequence[str] = ("vllm:", "pagedkv")) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value} for the metrics with these prefixes."""
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(tuple(prefixes)):
            continue
        name, _, value = line.rpartition(" ")
        try:
            metrics[name] = float(value)
        except ValueError:
            continue
    return metrics
