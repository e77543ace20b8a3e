"""Test harness for the scheduler: a fake model over a shadow KV cache, and an independent
reference of what every request must generate.

The fake model executes a ``SchedulerOutput`` the way a real runner does: swap out, swap in,
copy-on-write copies, then writes the token of every computed position into the slot its block
table names, then for every sequence to sample reads its whole context back *from the cache* and
picks the next token as a deterministic function of what it read. A wrong block table, a missing
copy or swap, a block reused while still in use, or a position computed twice/never shows up as
a context that differs from the sequence's real tokens (recorded in ``corruptions``) and as
different generated tokens.

``reference_outputs`` generates each request on its own, with no scheduler at all: it applies the
same sampling decisions and the stop rules as documented. Scheduling, chunking, preemption and
swapping must never change what a request generates.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.scheduler import (
    FinishReason,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceGroup,
    SequenceStatus,
)

VOCAB = 13
EOS = 0


def next_token(ctx: list[int]) -> int:
    """The 'model': a deterministic function of the whole context."""
    h = len(ctx)
    for t in ctx:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


def choose(ctx: list[int], prompt_len: int, n: int, live: int, beam: bool) -> list[int]:
    """Sampled tokens for one sequence: one token, several (fork) or none (drop).

    Parallel sampling: the first sample after the prompt forks into ``n`` sequences. Beam-like:
    afterwards a sequence may branch in two (when the group has room) or be pruned (when it is
    not the last one), depending on the token.
    """
    v = next_token(ctx)
    out_len = len(ctx) - prompt_len
    if n > 1 and out_len == 0:
        return [(v + k) % VOCAB for k in range(n)]
    if beam and out_len > 0:
        if v % 5 == 1 and live < n:
            return [v, (v + 3) % VOCAB]
        if v % 7 == 2 and live > 1:
            return []
    return [v]


def is_beam(request_id: str) -> bool:
    return request_id.startswith("beam")


@dataclass
class RefSeq:
    index: int
    tokens: list[int]
    reason: FinishReason | None = None


def stop_check(
    tokens: list[int], prompt_len: int, params: RequestParams, max_len: int
) -> FinishReason | None:
    n_out = len(tokens) - prompt_len
    tok = tokens[-1]
    if n_out >= params.min_tokens:
        if params.eos_token_id is not None and tok == params.eos_token_id and not params.ignore_eos:
            return FinishReason.STOP
        if tok in params.stop_token_ids:
            return FinishReason.STOP
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len
    if n_out >= max_tokens or len(tokens) >= max_len:
        return FinishReason.LENGTH
    return None


def reference_outputs(
    request_id: str, prompt: list[int], params: RequestParams, max_len: int
) -> list[tuple[int, list[int], FinishReason]]:
    """What the request must produce: [(index, output tokens, finish reason)] by index."""
    plen = len(prompt)
    live = [RefSeq(0, list(prompt))]
    done: list[RefSeq] = []
    next_index = 1
    beam = is_beam(request_id)
    while live:
        count = len(live)
        new_live: list[RefSeq] = []
        children: list[tuple[RefSeq, int]] = []
        for s in live:
            toks = choose(s.tokens, plen, params.n, count, beam)
            count += len(toks) - 1
            if not toks:
                s.reason = FinishReason.ABORTED
                done.append(s)
                continue
            for tok in toks[1:]:
                c = RefSeq(next_index, list(s.tokens))
                next_index += 1
                children.append((c, tok))
            s.tokens.append(toks[0])
            s.reason = stop_check(s.tokens, plen, params, max_len)
            (done if s.reason else new_live).append(s)
        for c, tok in children:
            c.tokens.append(tok)
            c.reason = stop_check(c.tokens, plen, params, max_len)
            (done if c.reason else new_live).append(c)
        live = sorted(new_live, key=lambda s: s.index)
    return sorted(((s.index, s.tokens[plen:], s.reason) for s in done), key=lambda x: x[0])


def actual_outputs(g: SequenceGroup) -> list[tuple[int, list[int], FinishReason | None]]:
    return [(s.index, s.output_token_ids, s.finish_reason) for s in g.all_seqs()]


class FakeModel:
    """Runs outputs on a shadow KV cache (see the module docstring)."""

    def __init__(self, sched: Scheduler) -> None:
        cfg = sched.config
        self.sched = sched
        self.bs = cfg.block_size
        self.gpu: list[list[tuple[int, int] | None]] = [
            [None] * self.bs for _ in range(cfg.num_gpu_blocks)
        ]
        self.cpu: list[list[tuple[int, int] | None]] = [
            [None] * self.bs for _ in range(cfg.num_cpu_blocks)
        ]
        self.corruptions: list[str] = []

    def run(
        self, out: SchedulerOutput, pending: dict[int, int] | None = None
    ) -> dict[int, list[int]]:
        """`pending`: the token of each sequence scheduled ahead (`schedule_ahead`) at the
        position that its token list does not hold yet."""
        bs = self.bs
        pending = pending or {}
        for src, dst in out.blocks_to_swap_out:
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in out.blocks_to_swap_in:
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        for ss in out.scheduled:
            table = ss.block_table
            if len(table) * bs < ss.start + ss.num_tokens:
                self.corruptions.append(f"seq {ss.seq_id}: block table too short")
                continue
            toks = ss.token_ids
            if len(toks) < ss.num_tokens:
                toks.append(pending[ss.seq_id])
            for p, tok in zip(range(ss.start, ss.start + ss.num_tokens), toks):
                self.gpu[table[p // bs]][p % bs] = (p, tok)
        samples: dict[int, list[int]] = {}
        live: dict[str, int] = {}
        for ss, seq in zip(out.scheduled, out.seqs):
            if not ss.do_sample or seq.status is not SequenceStatus.RUNNING:
                continue
            table = ss.block_table
            end = ss.start + ss.num_tokens
            cells = [self.gpu[table[p // bs]][p % bs] for p in range(end)]
            ctx = []
            for p, c in enumerate(cells):
                if c is None or c[0] != p:
                    self.corruptions.append(f"seq {ss.seq_id}: position {p} holds {c}")
                    ctx.append(-1)
                else:
                    ctx.append(c[1])
            known = seq.token_ids[:end]
            if len(known) < end:
                known.append(pending[ss.seq_id])
            if ctx != known:
                self.corruptions.append(f"seq {ss.seq_id}: read {ctx} != {known}")
            g = seq.group
            count = live.setdefault(g.request_id, len(g.seqs))
            toks = choose(ctx, seq.prompt_len, g.params.n, count, is_beam(g.request_id))
            live[g.request_id] = count + len(toks) - 1
            samples[ss.seq_id] = toks
        return samples


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one output and of the scheduler state right after schedule()."""
    cfg = sched.config
    assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert sum(len(g.seqs) for g in sched.running) <= cfg.max_num_seqs
    assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
    by_group: dict[str, list] = {}
    for ss, seq in zip(out.scheduled, out.seqs):
        assert ss.num_tokens >= 1
        assert seq.group.state is SequenceStatus.RUNNING
        assert ss.start + ss.num_tokens <= seq.num_tokens
        assert ss.do_sample == (ss.start + ss.num_tokens == seq.num_tokens)
        by_group.setdefault(ss.request_id, []).append((ss, seq))
    for entries in by_group.values():
        g = entries[0][1].group
        sampled = {seq.seq_id for ss, seq in entries if ss.do_sample}
        # lockstep: a group samples with all of its sequences or with none
        assert not sampled or sampled == {s.seq_id for s in g.seqs}
    check_states(sched)


def check_states(sched: Scheduler) -> None:
    """A group is never partly running: every unfinished sequence is in its group's state."""
    queues = {
        SequenceStatus.RUNNING: sched.running,
        SequenceStatus.WAITING: sched.waiting,
        SequenceStatus.SWAPPED: sched.swapped,
    }
    bm = sched.block_manager
    seen = 0
    for state, groups in queues.items():
        for g in groups:
            seen += 1
            assert g.state is state
            assert g.seqs, "an unfinished group has no sequence"
            for s in g.seqs:
                assert s.status is state
                if state is SequenceStatus.WAITING:
                    assert not bm.has_seq(s.seq_id)
                else:
                    assert bm.location(s.seq_id) == (
                        "gpu" if state is SequenceStatus.RUNNING else "cpu"
                    )
                    assert bm.num_slots(s.seq_id) == s.num_computed_tokens
    assert seen == sched.num_unfinished
    assert [g.arrival_index for g in sched.running] == sorted(
        g.arrival_index for g in sched.running
    )
    bm.check_invariants()


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_seqs == 0
    st = bm.stats()
    assert bm.num_free_blocks == st.gpu_free == st.gpu_total
    assert st.cpu_free == st.cpu_total
    bm.check_invariants()


def drive(
    sched: Scheduler,
    model: FakeModel | None = None,
    max_steps: int = 10_000,
    check: bool = True,
) -> list[SchedulerOutput]:
    """Run until nothing is unfinished; return every output."""
    model = model or FakeModel(sched)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        out = sched.schedule()
        if check:
            check_step(sched, out)
        outs.append(out)
        sched.update(out, model.run(out))
    raise AssertionError(f"not finished after {max_steps} steps")


def drive_ahead(sched, model: FakeModel, max_steps: int = 10_000) -> int:
    """Run an ``AsyncScheduler`` as the asynchronous engine does (schedule ahead whenever
    ``can_schedule_ahead()``, else apply the step in flight and schedule plainly) until nothing
    is unfinished; return how many steps were scheduled ahead."""
    inflight = None
    ahead = 0
    for _ in range(max_steps):
        if not sched.has_unfinished() and inflight is None:
            return ahead
        if inflight is not None and sched.can_schedule_ahead():
            out = sched.schedule_ahead()
            ahead += 1
            tokens = {sid: toks[0] for sid, toks in inflight[1].items() if len(toks) == 1}
            samples = model.run(out, tokens)
            sched.update(*inflight)
        else:
            if inflight is not None:
                sched.update(*inflight)
            out = sched.schedule()
            check_step(sched, out)
            samples = model.run(out)
        inflight = (out, samples)
        check_states(sched)
        if not sched.has_unfinished():
            sched.update(*inflight)
            inflight = None
    raise AssertionError(f"not finished after {max_steps} steps")


def make(**kw) -> Scheduler:
    kw.setdefault("watermark", 0.0)
    return Scheduler(SchedulerConfig(**kw))
