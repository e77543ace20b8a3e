"""What the API process and the engine core say to each other (msgspec structs over ZMQ).

Requests are rare and outputs are the hot path, so the two directions are built differently:

* **in** (API process -> core), one message per event: `EngineCoreRequest` carries the prompt's
  token ids and the `SamplingParams` *pickled*, so a field added to `SamplingParams` travels
  without touching this module; aborts are a list of request ids.
* **out** (core -> API process), **one message per step**: `EngineCoreOutputs` holds the step's
  new tokens as flat parallel lists (request id, sequence index, token id: one entry per token,
  never an object per token), the sequences that finished (sparse), log-probabilities only for
  requests that asked for them (sparse), the requests that ended, the queue lengths whenever
  they changed, and now and then the engine's counters.

Every frame is `[kind, payload]`: `kind` is one byte (`KIND_*`), `payload` msgpack. Structs
are `array_like` (no field names on the wire) and `gc=False` (they hold no cycles).
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

# ---- frame kinds ------------------------------------------------------------------------------
#: API process -> core
KIND_ADD = b"A"
KIND_ABORT = b"X"
KIND_SHUTDOWN = b"S"
#: core -> API process
KIND_READY = b"R"
KIND_OUTPUTS = b"O"
KIND_FATAL = b"F"


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One request, checked and tokenized by the API process.

    `params` is the pickled `SamplingParams` the core samples with (stop strings removed and
    detokenization off: the API process does those); pickling keeps every present and future
    field without a schema here. `arrival_time` is the API process's `time.time()`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: bytes
    arrival_time: float

    @classmethod
    def of(cls, request_id: str, prompt_token_ids: list[int], params: Any,
           arrival_time: float) -> EngineCoreRequest:
        return cls(request_id, prompt_token_ids, pickle.dumps(params, protocol=5), arrival_time)

    def sampling_params(self) -> Any:
        return pickle.loads(self.params)


class SeqFinish(msgspec.Struct, array_like=True, gc=False):
    """Entry `entry` of the step was its sequence's last token."""

    entry: int
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id, when one ended it


class EntryLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities of the token of entry `entry` (raw model distribution)."""

    entry: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class FinishedRequest(msgspec.Struct, array_like=True, gc=False):
    """A request the core is done with (every sequence finished, or aborted or rejected).

    `aborted`: it ended without finishing (client abort, lack of KV memory): sequences not yet
    finished end with "abort". `seq_finishes`: (index, finish_reason, stop_reason) of each
    returned completion, as the core saw them (a fallback for sequences whose finish came with
    no token). Times are the core's `time.time()`: when it queued the request, first scheduled
    it and sampled its first token (None when it never got there). `final` is the pickled
    `RequestOutput` for requests whose result is not the sum of their tokens (beam search);
    None otherwise.
    """

    request_id: str
    aborted: bool
    seq_finishes: list[tuple[int, str | None, int | str | None]]
    queued_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    final: bytes | None = None


class CoreStats(msgspec.Struct, gc=False):
    """The engine's counters (`LLMEngine.get_stats()`), for /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    gpu_kv_usage: float = 0.0
    cpu_kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0

    @classmethod
    def of(cls, stats: Any) -> CoreStats:
        """From an `EngineStats` (same field names)."""
        return cls(**{name: getattr(stats, name) for name in cls.__struct_fields__})


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs (see the module docstring); entry `i` is token `token_ids[i]` of
    sequence `seq_indices[i]` of request `request_ids[i]`."""

    request_ids: list[str] = []
    seq_indices: list[int] = []
    token_ids: list[int] = []
    seq_finishes: list[SeqFinish] = []
    logprobs: list[EntryLogprobs] = []
    finished: list[FinishedRequest] = []
    rejected: list[tuple[str, str]] = []  # (request id, why): requests the core refused
    #: (request id, pickled prompt logprobs), once per request that asked for them, in the
    #: message of the step that computed the last of them (with its first token)
    prompt_logprobs: list[tuple[str, bytes]] = []
    #: (running, waiting, swapped) requests after the step, when they changed: the /metrics
    #: gauges of the batch size follow every step, the costlier `stats` only every so often
    queues: tuple[int, int, int] | None = None
    stats: CoreStats | None = None
    timestamp: float = 0.0  # the core's time.time() when it sent the message

    @property
    def is_empty(self) -> bool:
        return not (self.token_ids or self.finished or self.rejected or self.stats
                    or self.prompt_logprobs or self.queues)


class EngineCoreReady(msgspec.Struct, gc=False):
    """The core's first message: what the API process must know to check requests exactly
    as the core would (`InputProcessor`) and to describe the model (`model_config`)."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_capacity: int  # token slots of the whole KV cache
    max_num_seqs: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    device: str
    pid: int


class CoreFatal(msgspec.Struct, gc=False):
    """The core's last message when it stops on an error (at start or in the loop).
    `kind` is the exception's class name (`ValueError`: a bad option, told to the user)."""

    kind: str
    message: str
    traceback: str = ""


class Encoder:
    """One reusable msgpack encoder per socket end."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self._enc.encode(obj)


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
