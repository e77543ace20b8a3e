"""Build a model for a :class:`ModelConfig` and fill its weights.

The module tree is first built on the ``meta`` device (no memory, no random initialization),
then materialized directly on the target device in the target dtype, then filled from the
checkpoint one tensor at a time. Loading a model therefore costs one copy of its weights on the
device plus one checkpoint tensor on the host at a time.

With tensor parallelism (``tp``) the tree holds one rank's shards, and each parallel layer copies
only its slice of every checkpoint tensor: safetensors are read slice by slice, a GGUF tensor is
dequantized then narrowed, dummy weights are drawn whole (exactly the tensor a single-device
model draws) then narrowed, one tensor at a time.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedkv.engine.config import LOAD_FORMATS, ModelConfig, parse_dtype
from pagedkv.engine.distributed.communication import TPInfo
from pagedkv.engine.models.registry import load_model_class

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_load_format(config: ModelConfig, load_format: str = "auto") -> str:
    """The concrete format: ``safetensors``, ``gguf`` or ``dummy``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    if load_format == "auto":
        load_format = config.load_format
    if load_format == "auto":
        return "gguf" if config.gguf_file else "safetensors"
    if load_format == "gguf" and not config.gguf_file:
        raise ValueError(f"load_format='gguf' but {config.name} is not a GGUF model")
    if load_format == "safetensors" and config.gguf_file:
        raise ValueError(f"load_format='safetensors' but {config.name} is a GGUF file")
    return load_format


def build_model(config: ModelConfig, dtype: torch.dtype, tp: TPInfo | None = None) -> nn.Module:
    """The model's module tree on the meta device (shapes only); with ``tp`` one rank's share.
    The class is the one the registry names for the config's ``model_type``."""
    cls = load_model_class(config.model_type)
    with torch.device("meta"):
        model = (
            cls(config.hf_config) if tp is None or tp.size == 1 else cls(config.hf_config, tp=tp)
        )
    return model.to(dtype)


def load_model(
    config: ModelConfig,
    *,
    load_format: str = "auto",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    tp: TPInfo | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> nn.Module:
    """The model in eval mode with its weights, on ``device`` (default: CUDA if available) in
    ``dtype`` (default: ``config.dtype``). ``device="meta"`` returns the shapes only (nothing is
    read or allocated). ``seed`` seeds dummy weights. ``tp``: build and load one tensor-parallel
    rank's shard only. ``quantization="fp8"``: the linear layers' weights quantized to e4m3 per
    output channel once loaded (``pagedkv.engine.models.quantization``); ``quantize_lm_head``:
    the LM head too (``quantization.quantize_lm_head``)."""
    fmt = resolve_load_format(config, load_format)
    dtype = config.dtype if dtype is None else parse_dtype(dtype)
    device = default_device() if device is None else torch.device(device)
    start = time.perf_counter()
    model = build_model(config, dtype, tp)
    sharded = tp is not None and tp.size > 1
    if device.type != "meta":
        model = model.to_empty(device=device)
        for module in model.modules():
            init_buffers = getattr(module, "init_buffers", None)
            if callable(init_buffers):
                init_buffers()
        if fmt == "dummy":
            from pagedkv.engine.weights.dummy import init_dummy_weights

            init_dummy_weights(model, seed=seed)
        elif fmt == "gguf":
            from pagedkv.engine.weights.gguf import iter_gguf_weights, read_gguf_header

            model.load_weights(iter_gguf_weights(read_gguf_header(config.model_file)))
        else:
            from pagedkv.engine.weights.hf import iter_safetensors_weights

            model.load_weights(iter_safetensors_weights(config.path, lazy=sharded))
    if quantization is not None:  # on "meta": the quantized shapes and dtypes
        from pagedkv.engine.models.quantization import quantize_model

        quantize_model(model, quantization, lm_head=quantize_lm_head)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the 16-bit weights just freed
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        from pagedkv.engine.models.cpu_matmul import pack_model

        pack_model(model)
    logger.info(
        "loaded %s (%s, %s weights, %s%s on %s%s) in %.2f s",
        config.name,
        config.architecture,
        fmt,
        dtype,
        f", {quantization} linear layers{' and LM head' if quantize_lm_head else ''}"
        if quantization else "",
        device,
        f", tensor-parallel rank {tp.rank} of {tp.size}" if sharded else "",
        time.perf_counter() - start,
    )
    return model
