"""HTML views: block tables, the physical block pool, one engine step, plain result tables.

Inputs are plain data the notebooks computed (block tables as lists of ints, the engine's
``StepRecord``); the ref count shown on a block is the number of table entries naming it, which
is what kvblocks keeps (its README's first invariant).
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PALETTE = (
    "#4c72b0",
    "#55a868",
    "#8172b3",
    "#937860",
    "#64b5cd",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
)
SHARED = "#dd8452"  # a block with ref count > 1
ON_CPU = "#6a3d9a"
EMPTY = "#eeeeee"


def color_of(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def ref_counts(tables: Iterable[Sequence[int]]) -> Counter:
    """Block id -> number of table entries naming it."""
    return Counter(b for table in tables for b in table)


def _cell(block: int, color: str, title: str, sub: str = "", sup: str = "", outline: str = "") -> str:
    style = f"background:{color};color:#fff;padding:2px 6px;"
    if outline:
        style += f"outline:2px solid {outline};outline-offset:-2px;"
    return (
        f'<td style="{style}" title="{html.escape(title)}">{block}'
        + (f"<sub>{sub}</sub>" if sub else "")
        + (f"<sup>×{sup}</sup>" if sup else "")
        + "</td>"
    )


def block_tables_html(
    tables: Mapping[Any, tuple[Sequence[int], int]],
    block_size: int,
    *,
    caption: str = "",
    new_blocks: Iterable[int] = (),
    copied_to: Iterable[int] = (),
    on_cpu: Iterable[Any] = (),
    css_class: str = "pagedkv-block-tables",
) -> str:
    """One row per sequence: ``label -> (block table, slots filled)``.

    A cell is a physical block id with its filled slots (``5/8``) and, when shared, its ref
    count (``×3``, orange). Outlines: black for ``new_blocks`` (allocated in this step), red for
    ``copied_to`` (the destination of a copy-on-write). Rows in ``on_cpu`` are swapped out.
    """
    new, copied, cpu = set(new_blocks), set(copied_to), set(on_cpu)
    refs = ref_counts(t for label, (t, _) in tables.items() if label not in cpu)
    rows = []
    for i, (label, (table, filled)) in enumerate(tables.items()):
        cells = []
        for logical, b in enumerate(table):
            n = max(0, min(block_size, filled - logical * block_size))
            if label in cpu:
                color, ref = ON_CPU, 1
            else:
                ref = refs[b]
                color = SHARED if ref > 1 else color_of(i)
            outline = "#c44e52" if b in copied else ("#000" if b in new else "")
            where = "CPU" if label in cpu else "GPU"
            cells.append(
                _cell(
                    b, color, f"logical {logical} -> physical {b} ({where}), {n}/{block_size} "
                    f"slots, ref count {ref}", f"{n}/{block_size}", str(ref) if ref > 1 else "",
                    outline,
                )
            )  # fmt: skip
        rows.append(
            f'<tr data-seq="{html.escape(str(label))}"><th style="text-align:left;'
            f'padding-right:8px">{html.escape(str(label))}</th><td style="padding-right:8px">'
            f"{filled} tok{' (CPU)' if label in cpu else ''}</td>{''.join(cells)}</tr>"
        )
    cap = f"<caption style='text-align:left;white-space:nowrap'>{html.escape(caption)}</caption>" if caption else ""
    return (
        f'<table class="{css_class}" style="border-collapse:separate;border-spacing:2px">'
        f"{cap}{''.join(rows)}</table>"
    )


def pool_html(num_blocks: int, tables: Mapping[Any, tuple[Sequence[int], int]], block_size: int,
              *, per_row: int = 16) -> str:  # fmt: skip
    """The physical blocks: owner(s) by color and how full each is (its height)."""
    owners: dict[int, list[int]] = {}
    fill: dict[int, int] = {}
    for i, (_label, (table, filled)) in enumerate(tables.items()):
        for logical, b in enumerate(table):
            owners.setdefault(b, []).append(i)
            n = max(0, min(block_size, filled - logical * block_size))
            fill[b] = max(fill.get(b, 0), n)
    labels = list(tables)
    cells = []
    for b in range(num_blocks):
        if b in owners:
            pct = 100 * fill[b] // block_size
            color = SHARED if len(owners[b]) > 1 else color_of(owners[b][0])
            style = f"background:linear-gradient(to top,{color} {pct}%,#cfd8e3 {pct}%)"
            who = ",".join(str(labels[i]) for i in owners[b])
            title = f"block {b}: {who}, {fill[b]}/{block_size} slots"
        else:
            style, title = f"background:{EMPTY};color:#999", f"block {b}: free"
        cells.append(
            f'<div class="pagedkv-block" data-block="{b}" title="{html.escape(title)}" '
            f'style="{style};width:30px;height:30px;display:inline-block;margin:1px;'
            f'font-size:10px;text-align:center;vertical-align:top;border:1px solid #999">{b}</div>'
        )
        if (b + 1) % per_row == 0:
            cells.append("<br>")
    return f'<div class="pagedkv-pool">{"".join(cells)}</div>'


def table_html(rows: Sequence[Mapping[str, Any]], *, css_class: str = "pagedkv-table",
               caption: str = "") -> str:  # fmt: skip
    """A plain table: one row per mapping, the first row's keys as the header."""
    if not rows:
        return f'<table class="{css_class}"><tr><td>(nothing)</td></tr></table>'
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(k, '')))}</td>" for k in keys) + "</tr>"
        for r in rows
    )
    cap = f"<caption style='text-align:left;white-space:nowrap'>{html.escape(caption)}</caption>" if caption else ""
    return (
        f'<table class="{css_class}" style="text-align:right">{cap}<tr>{head}</tr>{body}</table>'
    )


def _after_tables(rec) -> dict[str, tuple[tuple[int, ...], int]]:
    return {f"{s.request_id} seq {s.seq_id}": (s.block_table, s.num_slots) for s in rec.block_tables}


def engine_step_html(prev, rec, block_size: int) -> str:
    """One engine step in three parts, so that every block it names is visible:

    1. the blocks at the start of the step (the previous record's ``block_tables``);
    2. the forward pass: swaps, copy-on-write pairs (red outline: the copy) and the block
       tables the kernels read;
    3. after the step: forks (a child shares all of its parent's blocks), dropped sequences
       (pruned beams), finished requests, and the block tables then.
    """
    before = _after_tables(prev) if prev is not None else {}
    cpu_before = {f"{s.request_id} seq {s.seq_id}" for s in (prev.block_tables if prev else ())
                  if s.location == "cpu"}  # fmt: skip
    used = {f"{s.request_id} seq {s.seq_id}": (s.block_table, s.start + s.num_tokens)
            for s in rec.scheduled}  # fmt: skip
    copies = [d for _, d in rec.blocks_to_copy]
    events = []
    for rid, mode in rec.preempted:
        events.append(f"preempted {rid} ({mode})")
    if rec.blocks_to_swap_out:
        pairs = ", ".join(f"{g}→{c}" for g, c in rec.blocks_to_swap_out)
        events.append(f"swap out GPU→CPU blocks {pairs}")
    if rec.blocks_to_swap_in:
        pairs = ", ".join(f"{c}→{g}" for c, g in rec.blocks_to_swap_in)
        events.append(f"swap in CPU→GPU blocks {pairs}")
    if rec.blocks_to_copy:
        pairs = ", ".join(f"{s}→{d}" for s, d in rec.blocks_to_copy)
        events.append(f"copy-on-write: block {pairs}")
    after_events = [f"fork: seq {p} → new seq {c} (shares all of seq {p}'s blocks)"
                    for p, c in rec.forks]  # fmt: skip
    dropped = [sid for sid, toks in rec.sampled.items() if not toks]
    if dropped:
        after_events.append("dropped (pruned beams, blocks released): seq "
                            + ", ".join(map(str, dropped)))  # fmt: skip
    if rec.finished:
        after_events.append("finished: " + ", ".join(rec.finished))

    def ul(items: list[str]) -> str:
        if not items:
            return ""
        return "<ul style='margin:2px 0'>" + "".join(
            f'<li class="pagedkv-event">{html.escape(e)}</li>' for e in items
        ) + "</ul>"  # fmt: skip

    cpu_after = {f"{s.request_id} seq {s.seq_id}" for s in rec.block_tables if s.location == "cpu"}
    parts = [
        f"<b>1. start of step {rec.step}</b>",
        block_tables_html(before, block_size, on_cpu=cpu_before) if before else "<p>(no blocks)</p>",
        f"<b>2. forward pass</b>: {rec.num_prefill_tokens} prefill + {rec.num_decode_tokens} "
        "decode tokens" + ul(events),
        block_tables_html(used, block_size, copied_to=copies),
        "<b>3. after sampling</b>" + ul(after_events),
        block_tables_html(_after_tables(rec), block_size, on_cpu=cpu_after)
        if rec.block_tables else "<p>(no blocks)</p>",
        f"<small>GPU blocks free after the step: {rec.num_free_blocks} of {rec.num_gpu_blocks}; "
        "orange: shared (×ref count), purple: on the CPU, red outline: the copy made by "
        "copy-on-write</small>",
    ]
    return f'<div class="pagedkv-step" data-step="{rec.step}">{"".join(parts)}</div>'
