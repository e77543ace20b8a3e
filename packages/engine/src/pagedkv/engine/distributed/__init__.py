"""Tensor parallelism over `torch.distributed`: one model split over several devices.

Megatron-LM style, as in the PagedAttention paper: every rank holds the weights and the KV cache
of its share of the attention heads (and its slice of the MLP and of the vocabulary); one
scheduler, on rank 0 (the *driver*), drives all ranks with the same block tables.

* `parallel_state`: process groups (NCCL on CUDA, gloo on the CPU, plus a gloo group for the
  small per-step messages), timeouts, and the start-time checks of a configuration (the sizes a
  family splits come from its entry in `models/registry.py`).
* `communication`: what the model layers use: `TPInfo` (a layer's rank, size and group) and
  the collectives (identity when the size is 1). The model code imports nothing else from here.
* `executor`: what `LLMEngine` drives: the plain `ModelRunner` at size 1, else a
  `TensorParallelRunner` that starts the workers, sends each step and watches the workers.
* `step_message`: a step as one int64 tensor, block tables as changes (`StepEncoder` on the
  driver, `StepDecoder` on every worker).
* `step_timing`: per-rank step timings with ``PAGEDKV_TP_DIAG=1`` (does a rank lag?).
* `worker`: the loop of ranks > 0 (spawned by the driver, or started by `torchrun`).
* `heartbeat`: how rank 0 tells which `torchrun`-started rank is gone.

Nothing here is imported by the engine at size 1 beyond `executor.make_runner`.
"""
