"""matplotlib figures of what the notebooks measured (each takes plain lists and dicts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

STATE_COLORS = {
    "prefill": "#dd8452",
    "decode": "#4c72b0",
    "running": "#4c72b0",
    "waiting": "#dddddd",
    "swapped": "#8172b3",
}
PREEMPT = "#c44e52"
POLICY_COLORS = {"paged": "#4c72b0", "oracle": "#55a868", "pow2": "#dd8452", "max": "#c44e52"}


def figure_html(fig, dpi: int = 90) -> str:
    """A figure as an ``<img>`` tag (PNG inline), and closed so that it is not drawn twice."""
    import base64
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img class="pagedkv-figure" src="data:image/png;base64,{data}"/>'


def plot_waste(steps: Sequence[int], used: Sequence[int], paged: Sequence[int],
               contiguous: Sequence[int]):  # fmt: skip
    """KV slots over the steps of a run, the first the prompts' prefill: reserved by paging and
    by contiguous reservation, and used."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    ax.plot(steps, contiguous, label="reserved: contiguous", color="#c44e52")
    ax.plot(steps, paged, label="reserved: paged", color="#4c72b0")
    ax.plot(steps, used, "--", label="holding a token", color="#333")
    ax.set_xlabel("step (0: the prompts' prefill, then one decode step each)")
    ax.set_ylabel("KV slots")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_states(states: Mapping[str, Sequence[str | None]],
                preemptions: Sequence[tuple[int, str]] = (), title: str = "",
                extra: Mapping[str, Sequence[float]] | None = None):  # fmt: skip
    """One row per request, one column per step, colored by its state in that step
    (``running``/``prefill``/``decode``/``waiting``/``swapped``, None: not there); red crosses
    for ``preemptions`` (step, request id). ``extra``: curves drawn below (e.g. blocks in use)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = {rid: k for k, rid in enumerate(states)}
    n_steps = max((len(v) for v in states.values()), default=0)
    nplots = 2 if extra else 1
    fig, axes = plt.subplots(
        nplots, 1, figsize=(9, 0.8 + 0.35 * len(rows) + (1.8 if extra else 0)), sharex=True,
        squeeze=False, gridspec_kw={"height_ratios": [max(2, len(rows))] + ([2] if extra else [])},
    )  # fmt: skip
    ax = axes[0][0]
    seen = set()
    for rid, per_step in states.items():
        for step, state in enumerate(per_step):
            if state is None:
                continue
            seen.add(state)
            ax.broken_barh([(step, 1)], (rows[rid] - 0.4, 0.8), color=STATE_COLORS[state])
    for step, rid in preemptions:
        if rid in rows:
            ax.plot(step + 0.5, rows[rid], "x", color=PREEMPT, mew=2, markersize=8)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=c, label=k) for k, c in STATE_COLORS.items() if k in seen]
    if preemptions:
        handles.append(plt.Line2D([], [], marker="x", color=PREEMPT, ls="", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if extra:
        ax2 = axes[1][0]
        for label, ys in extra.items():
            ax2.step(range(len(ys)), ys, where="post", label=label)
        ax2.set_ylim(bottom=0)
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax2.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    ax.set_xlim(0, max(n_steps, 1))
    fig.tight_layout()
    return fig


def plot_timeline(scheduled: Sequence[Mapping[str, tuple[str, int]]],
                  queued: Sequence[Mapping[str, str]], preempted: Sequence[Sequence[str]],
                  budget: int, request_ids: Sequence[str], title: str = ""):  # fmt: skip
    """The scheduler's decisions: per step, each request's prefill chunk (its token count
    written on it) or decode, or its waiting / swapped state, preemptions, and below the tokens
    of each batch against the token budget."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = {rid: k for k, rid in enumerate(request_ids)}
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(9, 2.8 + 0.35 * len(rows)), sharex=True,
        gridspec_kw={"height_ratios": [max(2, len(rows)), 2]},
    )  # fmt: skip
    for step, row in enumerate(scheduled):
        for rid, (kind, tokens) in row.items():
            ax.broken_barh([(step, 1)], (rows[rid] - 0.4, 0.8), color=STATE_COLORS[kind])
            if kind == "prefill":
                ax.text(step + 0.5, rows[rid], str(tokens), ha="center", va="center", fontsize=6)
        for rid, state in queued[step].items():
            ax.broken_barh([(step, 1)], (rows[rid] - 0.4, 0.8), color=STATE_COLORS[state])
        for rid in preempted[step]:
            ax.plot(step + 0.5, rows[rid], "x", color=PREEMPT, markersize=8, mew=2)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_title(title or "one row per request, one column per step (numbers: prefill tokens)",
                 fontsize=10)  # fmt: skip
    handles = [Patch(color=STATE_COLORS[k], label=k)
               for k in ("prefill", "decode", "waiting", "swapped")]  # fmt: skip
    handles.append(plt.Line2D([], [], marker="x", color=PREEMPT, ls="", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    tokens = [sum(t for _, t in row.values()) for row in scheduled]
    ax2.bar(range(len(tokens)), tokens, width=1.0, align="edge", color="#55a868")
    ax2.axhline(budget, color=PREEMPT, ls="--", lw=1, label=f"token budget {budget}")
    ax2.set_ylabel("tokens in batch")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_metrics(series: Mapping[str, Sequence[float]], title: str = "",
                 preemptions_label: str = "preemptions (total)"):  # fmt: skip
    """The server's /metrics over time: ``series["t"]`` (seconds) against the request queue
    lengths, KV cache usage and preemptions (the server's running total, unless the caller
    counted them from some start and says so in ``preemptions_label``)."""
    import matplotlib.pyplot as plt

    t = series.get("t", [])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.0))
    for key, color in (("running", "#4c72b0"), ("waiting", "#aaaaaa"), ("swapped", "#8172b3")):
        if key in series:
            ax.step(t, series[key], where="post", label=f"requests {key}", color=color)
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    if "kv_usage" in series:
        ax2.plot(t, [100 * u for u in series["kv_usage"]], color="#dd8452", label="KV cache used %")
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("KV cache used (%)")
    if "preemptions" in series:
        ax3 = ax2.twinx()
        ax3.step(t, series["preemptions"], where="post", color=PREEMPT, label="preemptions")
        ax3.set_ylabel(preemptions_label)
        ax3.set_ylim(bottom=0)
        ax3.legend(fontsize=8, loc="lower right")
    ax2.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_simulation(results: Mapping[float, Mapping[str, Any]]):
    """Normalized latency and batch size against request rate, per policy (the PagedAttention
    paper's figure), from ``{rate: {policy: result}}`` of ``pagedkv.bench.sim``."""
    import matplotlib.pyplot as plt

    rates = sorted(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for policy, color in POLICY_COLORS.items():
        if not all(policy in results[r] for r in rates):
            continue
        axes[0].plot(rates, [results[r][policy].normalized_latency_s for r in rates], "o-",
                     color=color, label=policy)  # fmt: skip
        axes[1].plot(rates, [results[r][policy].avg_batched_requests for r in rates], "o-",
                     color=color, label=policy)  # fmt: skip
    axes[0].set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("normalized latency (s/token)")
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("requests in a batch")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
