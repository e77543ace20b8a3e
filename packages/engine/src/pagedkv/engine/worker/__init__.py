"""The device side of the engine: everything that holds tensors.

`ModelRunner` owns the model and the KV cache and executes one `SchedulerOutput` per step:
block swaps and copies, the batch's input tensors (`inputs`), the forward pass (a CUDA graph
replay for decode batches, `cuda_graphs`), and sampling (`sampling`, `sampler`,
`logits_processors`), returning plain token ids (`pagedkv.engine.outputs.RunnerOutput`).
`staging` keeps the host-to-device copies of a step small.
"""
