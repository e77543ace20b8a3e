"""The scheduler and kvblocks split the work as documented, on random workloads (Hypothesis):

* tokens are stored once: the block manager reads the scheduler's own token list of every
  sequence, and with prefix caching the hash chain it keeps for a sequence (and the content of
  the cached blocks the sequence points to) is exactly what an independent hash of the
  scheduler's tokens gives;
* the scheduler frees memory (preempts, or ends a group that cannot fit) only right after the
  block manager said that the blocks it asked for are not free, and the block manager's "no"
  (``allocate_slots`` returning None) is truthful: ``blocks_needed > num_free_blocks``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from sched_harness import FakeModel, actual_outputs, assert_all_free, check_step, reference_outputs
from test_properties import scenarios

from kvblocks import BlockManager, default_hash_fn
from pagedkv.scheduler import FinishReason, Scheduler


class SpyBlockManager(BlockManager):
    """The real block manager, logging what the scheduler asks and what it frees."""

    def __init__(self, log: list[tuple], **kw) -> None:
        super().__init__(**kw)
        self.log = log

    def allocate_slots(self, seq_id, num_new_tokens, pending=0):
        need = self.blocks_needed(seq_id, num_new_tokens)
        free = self.num_free_blocks
        out = super().allocate_slots(seq_id, num_new_tokens, pending)
        assert (out is None) == (need > free), (seq_id, need, free, out)
        self.log.append(("ask", out is not None))
        return out

    def group_blocks_needed(self, seq_ids, num_new_tokens):
        need = super().group_blocks_needed(seq_ids, num_new_tokens)
        self.log.append(("ask", need <= self.num_free_blocks))
        return need

    def allocate(self, seq_id, token_ids, *, extra_key=None):
        self.log.append(("allocate", seq_id))
        return super().allocate(seq_id, token_ids, extra_key=extra_key)

    def free(self, seq_id):
        self.log.append(("release", seq_id))
        super().free(seq_id)

    def swap_out(self, seq_ids):
        self.log.append(("release", tuple(seq_ids)))
        return super().swap_out(seq_ids)


def spied_scheduler(cfg) -> tuple[Scheduler, list[tuple]]:
    sched = Scheduler(cfg)
    log: list[tuple] = []
    sched.block_manager = SpyBlockManager(
        log,
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.num_gpu_blocks,
        num_cpu_blocks=cfg.num_cpu_blocks,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    return sched, log


def check_tokens_stored_once(sched: Scheduler) -> None:
    bm = sched.block_manager
    bs = bm.block_size
    snap = bm.debug_snapshot()
    live = {}
    if snap["cache"] is not None:
        live = {e[0]: e for e in snap["cache"][0]}  # serial -> (serial, hash, parent, toks, ...)
    by_id = {entry[0]: entry for entry in snap["seqs"]}
    for g in (*sched.running, *sched.swapped):
        for s in g.seqs:
            # The manager reads this very list: what the scheduler appends, it sees.
            n = bm.num_tokens(s.seq_id)
            assert n == len(s.token_ids) and bm.token_ids(s.seq_id) == s.token_ids
            s.token_ids.append(12345)
            assert bm.num_tokens(s.seq_id) == n + 1, "the manager holds a copy of the tokens"
            s.token_ids.pop()
            _, _, _, _, _, extra_key, hashes, chain = by_id[s.seq_id]
            parent = None
            for k, h in enumerate(hashes):
                block = tuple(s.token_ids[k * bs : (k + 1) * bs])
                parent = default_hash_fn(parent, block, extra_key)
                assert h == parent, f"seq {s.seq_id}: block {k} hashed from other tokens"
                if k < len(chain) and chain[k] in live:
                    entry = live[chain[k]]
                    assert entry[1] == h and entry[3] == block, f"seq {s.seq_id}: block {k}"


@pytest.mark.slow
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_scheduler_tokens_are_the_block_managers_tokens_with_prefix_caching(scenario):
    cfg, reqs = scenario
    cfg = dataclasses.replace(cfg, enable_prefix_caching=True)
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    groups = {}
    pending = sorted(reqs, key=lambda r: r.arrive)
    step = 0
    while pending or sched.has_unfinished():
        assert step < 3000
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            groups[r.rid] = sched.add_request(r.rid, r.prompt, r.params, arrival_time=float(step))
        out = sched.schedule()
        check_step(sched, out)
        check_tokens_stored_once(sched)
        sched.update(out, model.run(out))
        check_tokens_stored_once(sched)
        step += 1
    assert not model.corruptions, model.corruptions[:5]
    assert_all_free(sched)
    if sched.stats().kv.prefix_cache_hits:
        event("prefix cache hits")
    max_len = min(cfg.max_model_len, cfg.num_gpu_blocks * cfg.block_size)
    for r in reqs:
        g = groups[r.rid]
        if g.finish_reason is FinishReason.REJECTED or g.reason_text:
            continue
        assert actual_outputs(g) == reference_outputs(r.rid, r.prompt, r.params, max_len)


@pytest.mark.slow
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_scheduler_frees_memory_only_when_the_block_manager_says_no(scenario):
    cfg, reqs = scenario
    sched, log = spied_scheduler(cfg)
    model = FakeModel(sched)
    pending = sorted(reqs, key=lambda r: r.arrive)
    step = 0
    preemptions = 0
    while pending or sched.has_unfinished():
        assert step < 3000
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            sched.add_request(r.rid, r.prompt, r.params, arrival_time=float(step))
        log.clear()
        out = sched.schedule()
        # Inside schedule(), blocks are only released to make room: each release follows a
        # "no" from the block manager, with no "yes" in between. (Admission registers a waiting
        # request's sequences and frees them again when its first chunk does not fit: that
        # undoes an allocation of this very call, it preempts nothing.)
        last_answer = None
        admitted = set()
        for ev in log:
            if ev[0] == "ask":
                last_answer = ev[1]
            elif ev[0] == "allocate":
                admitted.add(ev[1])
            elif ev[1] not in admitted:
                assert last_answer is False, f"released {ev[1]} although blocks were free: {log}"
        preemptions += len(out.preempted)
        sched.update(out, model.run(out))
        step += 1
    assert not model.corruptions, model.corruptions[:5]
    assert_all_free(sched)
    if preemptions:
        event("preempted")
