"""Benchmark of the block manager's hot paths: ``python -m pagedkv.bench.kvblocks``.

Why: the scheduler runs the block bookkeeping of every running sequence on every decode step,
on the CPU, between GPU forward passes; if it is slow, the GPU waits. This measures

* one whole decode step: for each of N running sequences (default 256, about 2,048 tokens each,
  block size 16) append one token to the sequence's own token list (which the manager reads by
  reference) and ``allocate_slots(seq, 1)``; the lengths are staggered
  so that 1/block_size of the sequences need a new block each step; and every ``--fork-every``
  steps one sequence is freed and another forked in its place (beam-search-like; the child
  copies its partly filled last block on its next write);
* a prefix-cache lookup (``peek_prefix``) of a 2,048-token prompt whose blocks are all cached.

Baseline, measured in the same run: the same decode loop against a minimal stand-in object whose
two methods only extend a list and add an int (the floor of making 2 x N Python method calls; the
step of kvblocks 0.1.0 made two calls per sequence, today's makes one call and a list append, and
the baseline is kept as it was so that figures compare across versions).

Times are wall clock (``time.perf_counter_ns``); the process CPU time of a step is shown too,
because on a busy machine the wall clock also counts time the process spent descheduled.

Prints the setup and a table, and ends with one JSON line (medians in microseconds):
``{"decode_step_us": ..., "prefix_lookup_us": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

from kvblocks import BlockManager, __version__
from pagedkv.bench.env import environment

__all__ = ["main", "run"]


class _Floor:
    """The cheapest possible object with the decode-step API: the baseline."""

    __slots__ = ("_slots", "_tokens")

    def __init__(self, n: int) -> None:
        self._tokens: dict[int, list[int]] = {i: [] for i in range(n)}
        self._slots: dict[int, int] = dict.fromkeys(range(n), 0)

    def append_token_ids(self, seq_id: int, token_ids: list[int]) -> None:
        self._tokens[seq_id] += token_ids

    def grow(self, seq_id: int, n: int) -> tuple[tuple[int, int], ...]:
        self._slots[seq_id] += n
        return ()


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _decode_bench(
    num_seqs: int, seq_len: int, block_size: int, steps: int, warmup: int, fork_every: int
) -> dict[str, Any]:
    blocks_per_seq = (seq_len + steps + warmup) // block_size + 2
    m = BlockManager(block_size=block_size, num_gpu_blocks=(num_seqs + 2) * blocks_per_seq)
    # (sequence id, its token list): the caller owns the lists, the manager reads them.
    running: list[tuple[int, list[int]]] = []
    for s in range(num_seqs):
        n = max(1, seq_len - s % block_size)
        tokens = [s % 1000] * n
        m.allocate(s, tokens)
        m.allocate_slots(s, n)
        running.append((s, tokens))
    next_id = num_seqs
    times: list[float] = []
    cpu_times: list[float] = []
    copies = new_blocks = forks = 0
    allocate_slots = m.allocate_slots
    perf = time.perf_counter_ns
    cpu = time.process_time_ns
    for step in range(warmup + steps):
        free_before = m.num_free_blocks
        c0 = cpu()
        t0 = perf()
        ncopy = 0
        for s, tokens in running:
            tokens.append(7)
            if allocate_slots(s, 1):
                ncopy += 1
        if fork_every and step % fork_every == 0:
            j = step % num_seqs
            m.free(running[j][0])
            parent, parent_tokens = running[(j + 1) % num_seqs]
            child_tokens = parent_tokens.copy()
            m.fork(parent, next_id, child_tokens)
            running[j] = (next_id, child_tokens)
            next_id += 1
        t1 = perf()
        c1 = cpu()
        if step >= warmup:
            times.append((t1 - t0) / 1000)
            cpu_times.append((c1 - c0) / 1000)
            copies += ncopy
            new_blocks += max(0, free_before - m.num_free_blocks)
            forks += bool(fork_every and step % fork_every == 0)
    floor = _Floor(num_seqs)
    ftimes: list[float] = []
    fids = list(range(num_seqs))
    one = [7]
    for step in range(warmup + steps):
        t0 = perf()
        for s in fids:
            floor.append_token_ids(s, one)
            floor.grow(s, 1)
        t1 = perf()
        if step >= warmup:
            ftimes.append((t1 - t0) / 1000)
    return {
        "median": statistics.median(times),
        "cpu_median": statistics.median(cpu_times),
        "p90": _percentile(times, 0.9),
        "min": min(times),
        "floor": statistics.median(ftimes),
        "copies_per_step": copies / steps,
        "forks_per_step": forks / steps,
        "util": m.stats().kv_utilization,
    }


def _prefix_bench(prompt_tokens: int, block_size: int, repeats: int) -> dict[str, float]:
    nblocks = prompt_tokens // block_size + 4
    m = BlockManager(block_size=block_size, num_gpu_blocks=2 * nblocks, enable_prefix_caching=True)
    prompt = [(i * 7919) % 50000 for i in range(prompt_tokens)]
    m.allocate(0, prompt)
    m.allocate_slots(0, prompt_tokens)
    expected = (prompt_tokens - 1) // block_size * block_size
    perf = time.perf_counter_ns
    peek: list[float] = []
    alloc: list[float] = []
    for i in range(repeats):
        t0 = perf()
        hit = m.peek_prefix(prompt)
        t1 = perf()
        peek.append((t1 - t0) / 1000)
        if hit != expected:
            raise RuntimeError(f"prefix lookup found {hit} cached tokens, expected {expected}")
        t0 = perf()
        m.allocate(1 + i, prompt.copy())  # each sequence owns its list
        m.free(1 + i)
        t1 = perf()
        alloc.append((t1 - t0) / 1000)
    return {
        "peek": statistics.median(peek),
        "alloc_free": statistics.median(alloc),
        "blocks": expected // block_size,
    }


def _loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


def run(
    *,
    num_seqs: int = 256,
    seq_len: int = 2048,
    block_size: int = 16,
    steps: int = 300,
    warmup: int = 30,
    fork_every: int = 1,
    prefix_tokens: int = 2048,
    prefix_repeats: int = 300,
) -> dict[str, Any]:
    """Run both benchmarks; return the figures (what the JSON line holds)."""
    d = _decode_bench(num_seqs, seq_len, block_size, steps, warmup, fork_every)
    p = _prefix_bench(prefix_tokens, block_size, prefix_repeats)
    return {
        "decode_step_us": round(d["median"], 2),
        "prefix_lookup_us": round(p["peek"], 2),
        "decode_step_p90_us": round(d["p90"], 2),
        "decode_step_cpu_us": round(d["cpu_median"], 2),
        "decode_step_min_us": round(d["min"], 2),
        "decode_per_seq_us": round(d["median"] / num_seqs, 4),
        "baseline_floor_step_us": round(d["floor"], 2),
        "prefix_allocate_free_us": round(p["alloc_free"], 2),
        "copies_per_step": round(d["copies_per_step"], 3),
        "forks_per_step": round(d["forks_per_step"], 3),
        "num_seqs": num_seqs,
        "seq_len": seq_len,
        "block_size": block_size,
        "steps": steps,
        "prefix_tokens": prefix_tokens,
        "prefix_blocks": p["blocks"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="python -m pagedkv.bench.kvblocks", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--fork-every", type=int, default=1, help="0: no fork/free")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--prefix-repeats", type=int, default=300)
    a = ap.parse_args(argv)
    if a.num_seqs < 1 or a.seq_len < 1 or a.steps < 1 or a.prefix_tokens < 2:
        ap.error("--num-seqs, --seq-len and --steps must be >= 1, --prefix-tokens >= 2")
    r = run(
        num_seqs=a.num_seqs,
        seq_len=a.seq_len,
        block_size=a.block_size,
        steps=a.steps,
        warmup=a.warmup,
        fork_every=a.fork_every,
        prefix_tokens=a.prefix_tokens,
        prefix_repeats=a.prefix_repeats,
    )
    env = environment(argv=argv, prog="python -m pagedkv.bench.kvblocks")
    print(f"kvblocks {__version__} bench (commit {env['commit']})")
    print(
        f"python {env['python']} ({platform.python_implementation()}), "
        f"{env['machine']} {platform.processor() or env['platform']}"
    )
    print(f"command: {env['command']}")
    print(
        f"workload: {a.num_seqs} running sequences of ~{a.seq_len} tokens, block size "
        f"{a.block_size}, {a.steps} steps (+{a.warmup} warm-up), one fork+free every "
        f"{a.fork_every or 'never'} step(s); prefix lookup of {a.prefix_tokens} tokens"
    )
    rows = [
        ("decode step (append + allocate_slots(1) x N, forks)", "median", r["decode_step_us"]),
        ("decode step", "p90", r["decode_step_p90_us"]),
        ("decode step, process CPU time", "median", r["decode_step_cpu_us"]),
        ("decode step, per sequence", "median", r["decode_per_seq_us"]),
        ("baseline: 2 x N bare method calls", "median", r["baseline_floor_step_us"]),
        (f"prefix lookup, {r['prefix_blocks']} cached blocks", "median", r["prefix_lookup_us"]),
        ("allocate (prefix hit) + free", "median", r["prefix_allocate_free_us"]),
    ]
    print(f"{'measurement':<48} {'stat':>7} {'us':>10}")
    print("-" * 67)
    for name, stat, us in rows:
        print(f"{name:<48} {stat:>7} {us:>10.2f}")
    print(
        f"copy-on-write pairs per step: {r['copies_per_step']}, forks per step: "
        f"{r['forks_per_step']}; load average {_loadavg()}; goal: decode step < 200 us"
    )
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
