"""pagedkv.scheduler: torch-free FCFS iteration-level scheduling for PagedAttention.

Why a package of its own: the scheduler turns the block manager's memory efficiency into
throughput (bigger batches), and it must be testable and simulatable without a GPU or torch. It
speaks in ints and lists: token ids, sequence ids, block ids.

Quick use::

    from pagedkv.scheduler import RequestParams, Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_gpu_blocks=1024, num_cpu_blocks=256))
    sched.add_request("r0", prompt_token_ids, RequestParams(max_tokens=64, eos_token_id=2))
    while sched.has_unfinished():
        out = sched.schedule()                       # the batch
        samples = run_model(out)                     # {seq_id: [token]} for do_sample sequences
        sched.update(out, samples)                   # append, stop, fork, free

``AsyncScheduler(config)`` adds ``can_schedule_ahead()`` / ``schedule_ahead()``: build step N+1
while step N still runs (asynchronous scheduling).
"""

from pagedkv.scheduler.__about__ import __version__
from pagedkv.scheduler.async_scheduler import AsyncScheduler
from pagedkv.scheduler.config import PreemptionMode, SchedulerConfig
from pagedkv.scheduler.output import (
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
    UpdateResult,
)
from pagedkv.scheduler.request import (
    FinishReason,
    RequestParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.scheduler.scheduler import Scheduler

__all__ = [
    "AsyncScheduler",
    "FinishReason",
    "PreemptionMode",
    "RequestParams",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "UpdateResult",
    "__version__",
]
