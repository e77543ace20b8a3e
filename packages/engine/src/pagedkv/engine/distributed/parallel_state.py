"""Process groups of tensor parallelism, and the checks that a configuration can be split.

Two groups span the same ranks:

* the *device group* (the default process group): NCCL on CUDA, gloo on the CPU. The model's
  all-reduces and the logits gather run on it, with `distributed_timeout` seconds per collective,
  so a rank that stops answering brings the others down instead of hanging them.
* the *CPU group* (gloo): the driver broadcasts each step's message over it (a flat int64
  tensor, `step_message`). Its timeout is long, because a worker waits on it for the next step however long the engine idles;
  a dead peer still shows at once (gloo sees the closed connection).

The state lives in one explicit :class:`ParallelContext` object (torch.distributed itself keeps
the default group); the model layers get the small, immutable :class:`TPInfo` (defined in
:mod:`~pagedkv.engine.distributed.communication`, re-exported here).

Which sizes a model splits comes from its family's entry in the model registry; this module
reads only the numbers of a :class:`~pagedkv.engine.config.ModelConfig` (it does not import
``config``), and the model code does not import this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pagedkv.engine.distributed.communication import TPInfo
from pagedkv.engine.models.registry import get_spec, tensor_parallel_architectures

if TYPE_CHECKING:
    from pagedkv.engine.config import ModelConfig

logger = logging.getLogger(__name__)

# Settings the multi-GPU machines need in every process (NVLink multicast / symmetric memory
# stay off); set when absent, never overridden.
NCCL_ENV = MappingProxyType(
    {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
)
# How long a worker may wait for the driver's next step message: the engine may idle for hours.
CPU_GROUP_TIMEOUT = timedelta(days=365)


def apply_nccl_env() -> None:
    """Set :data:`NCCL_ENV` in this process's environment where absent (before NCCL starts;
    spawned workers inherit it)."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """The environment `torchrun` gives each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a `torchrun` launch of more than one process, else None."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    if world <= 1:
        return None
    return TorchrunEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its machine (one GPU per rank)."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


@dataclass(slots=True)
class ParallelContext:
    """One rank's membership of the tensor-parallel group (all ranks of the launch)."""

    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    cpu_group: Any
    _left: bool = False  # destroy() was called

    @property
    def tp(self) -> TPInfo:
        return TPInfo(self.rank, self.world_size, None)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        device: torch.device,
        *,
        timeout_s: float,
        store: Any = None,
        init_method: str | None = None,
    ) -> ParallelContext:
        """Join the default process group (rendezvous through ``store``, or ``init_method``
        such as ``env://``) and create the CPU group. Every rank calls this, in any order."""
        apply_nccl_env()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {
            "backend": backend,
            "rank": rank,
            "world_size": world_size,
            "timeout": timedelta(seconds=timeout_s),
        }
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = init_method or "env://"
        dist.init_process_group(**kwargs)
        cpu_group = dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT)
        logger.info("rank %d of %d joined (%s on %s)", rank, world_size, backend, device)
        return cls(rank, world_size, device, timeout_s, cpu_group)

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Rank 0: every rank's ``obj``, by rank (pickled, over the CPU group); others: None.
        For rare messages (statistics), never per step."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over all ranks (over the CPU group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(t.item())

    def destroy(self, timeout_s: float = 10.0) -> None:
        """Leave the groups (this process may then start another tensor-parallel engine).
        Idempotent.

        Every rank should call this at about the same time: NCCL's teardown waits for its
        peers. It runs in a daemon thread waited for `timeout_s` at most, so a stuck teardown
        (a peer already gone) never keeps the process alive; the communicators are then
        aborted instead, which does not wait for anyone."""
        if self._left or not dist.is_initialized():
            return
        self._left = True
        if _bounded(dist.destroy_process_group, timeout_s):
            return
        logger.warning("leaving the process groups did not finish in %.0f s; aborting them",
                       timeout_s)
        from torch.distributed.distributed_c10d import _abort_process_group

        if not _bounded(_abort_process_group, 5.0):
            logger.warning("aborting the process groups did not finish in 5 s; going on")


def _bounded(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run ``fn`` in a daemon thread; True when it returned (or raised) within ``timeout_s``."""

    def call() -> None:
        try:
            fn()
        except Exception as exc:  # a peer may be gone already
            logger.debug("%s: %s", getattr(fn, "__name__", fn), exc)

    thread = threading.Thread(target=call, name="pagedkv-tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def rank_model_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The model as one rank sees it: its share of the query and KV heads (what its KV cache
    holds); every other field as in ``config``."""
    if tp_size == 1:
        return config
    return dataclasses.replace(
        config, num_heads=config.num_heads // tp_size, num_kv_heads=config.num_kv_heads // tp_size
    )


def _split_sizes(config: ModelConfig) -> dict[str, int] | None:
    """The sizes tensor parallelism splits, by their config names (from the family's registry
    entry and the whole model's Hugging Face config); None if the family cannot be split."""
    return get_spec(config.hf_config.model_type).tp_split_sizes(config.hf_config)


def valid_tp_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` that split ``config`` evenly."""
    sizes = _split_sizes(config)
    if sizes is None:
        return [1]
    return [n for n in range(1, limit + 1) if all(s % n == 0 for s in sizes.values())]


def check_tensor_parallel(config: ModelConfig, tp_size: int, device: torch.device) -> None:
    """Raise ``ValueError`` saying what to do when ``config`` cannot run split ``tp_size`` ways
    on ``device``. Nothing is started before this passes."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1 (got {tp_size})")
    if tp_size == 1:
        return
    sizes = _split_sizes(config)
    if sizes is None:
        families = " and ".join(tensor_parallel_architectures())
        raise ValueError(
            f"tensor parallelism supports the {families} families; {config.name} is "
            f"{config.architecture}: run it with --tensor-parallel-size 1"
        )
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if bad:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide {', '.join(bad)} of {config.name}; "
            f"use one of {valid_tp_sizes(config)}"
        )
    launch = torchrun_env()
    if launch is not None and launch.world_size != tp_size:
        raise ValueError(
            f"torchrun started {launch.world_size} processes but --tensor-parallel-size is "
            f"{tp_size}: they must be equal (one process per rank)"
        )
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        per_machine = launch.local_world_size if launch is not None else tp_size
        if per_machine > visible:
            raise ValueError(
                f"--tensor-parallel-size {tp_size} needs {per_machine} CUDA devices on this "
                f"machine but {visible} are visible; lower it, make more GPUs visible "
                "(CUDA_VISIBLE_DEVICES), or spread the ranks over machines with torchrun"
            )
    if launch is None and dist.is_initialized():
        raise ValueError(
            "torch.distributed is already initialized in this process (another tensor-parallel "
            "engine?); shut that engine down first (LLMEngine.shutdown())"
        )
