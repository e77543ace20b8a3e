"""Engine options: one dataclass, and the command-line flags that fill it.

Flag names follow vLLM's so that a vLLM user's command lines carry over. Every option is
validated here, before any memory is touched, so that a typo costs a clear message instead of a
half-started engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from kvblocks import check_block_size

#: Block sizes the attention kernels are built and tested for (kvblocks takes any power of two).
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_PREEMPTION_MODES = (None, "recompute", "swap")
_DEVICES = ("auto", "cuda", "cpu")
#: `--kv-cache-dtype`: "auto" stores K/V in the model dtype; "fp8" in e4m3 with per-layer
#: scales (half the bytes of bf16: twice the blocks in the same memory).
KV_CACHE_DTYPES = ("auto", "fp8")
#: `--quantization`: "fp8" quantizes the linear layers' weights to e4m3 per output channel at
#: load time and each activation row dynamically (``pagedkv.engine.models.quantization``).
QUANTIZATIONS = (None, "fp8")


@dataclass
class EngineArgs:
    """Every option of the engine (model, memory, scheduling).

    `model=None` means the embedded default model (SmolLM2-135M-Instruct).
    """

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float = 1.0
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: str | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    device: str = "auto"
    num_gpu_blocks_override: int | None = None
    num_cpu_blocks_override: int | None = None
    distributed_timeout: float = 300.0
    # Overlap the host with the device for plain greedy batches (None: on with CUDA).
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # With quantization "fp8": the LM head's output matrix in e4m3 too (off, as in vLLM).
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"{field}: {msg}")

        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"{self.load_format!r} is not one of {_LOAD_FORMATS}")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {_DTYPES}")
        try:
            check_block_size(self.block_size)  # kvblocks' rule: a power of two
        except ValueError as exc:
            raise bad("block_size", str(exc)) from None
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise bad("block_size", f"the kernels run block sizes {SUPPORTED_BLOCK_SIZES} "
                      f"(got {self.block_size})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", f"must be positive (got {self.kv_cache_gb})")
        if self.swap_space < 0:
            raise bad("swap_space", f"must be >= 0 GB (got {self.swap_space})")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", f"must be >= 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", f"must be >= 1 (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be >= 2 (got {self.max_model_len})")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise bad("preemption_mode", f"must be 'recompute', 'swap' or unset (got {self.preemption_mode!r})")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", f"must be >= 1 (got {self.tensor_parallel_size})")
        if self.distributed_timeout <= 0:
            raise bad("distributed_timeout", f"must be positive seconds (got {self.distributed_timeout})")
        if self.device not in _DEVICES:
            raise bad("device", f"must be one of {_DEVICES} (got {self.device!r})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES} "
                      f"(got {self.kv_cache_dtype!r})")
        if self.quantization == "none":
            self.quantization = None
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be 'fp8' or 'none' (got {self.quantization!r})")
        if self.quantize_lm_head and self.quantization != "fp8":
            raise bad("quantize_lm_head", "needs quantization 'fp8' (the linear layers first)")
        for name in ("num_gpu_blocks_override", "num_cpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "num_gpu_blocks_override" else 0):
                raise bad(name, f"must be positive (got {value})")

    # ---- command line -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
        """Add every engine option to `parser` under vLLM's flag names."""
        d = EngineArgs.__dataclass_fields__
        g = parser.add_argument_group("engine options")
        if model_positional:
            g.add_argument("model", nargs="?", default=None,
                           help="model: a Hugging Face folder, a .gguf file; default: the embedded SmolLM2-135M-Instruct")
        else:
            g.add_argument("--model", default=None,
                           help="model: a Hugging Face folder, a .gguf file; default: the embedded SmolLM2-135M-Instruct")
        g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
        g.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer: prompts are token ids, outputs carry token ids only "
                            "(automatic for bundled shapes such as meta-llama/Meta-Llama-3-8B)")
        g.add_argument("--load-format", choices=_LOAD_FORMATS, default=d["load_format"].default,
                       help="weights format; 'dummy' = random weights of the real config (benchmarks)")
        g.add_argument("--dtype", choices=_DTYPES, default="auto", help="weights and activations dtype")
        g.add_argument("--seed", type=int, default=0, help="random seed of the engine")
        g.add_argument("--block-size", type=int, choices=SUPPORTED_BLOCK_SIZES, default=16, help="tokens per KV block")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory the engine may use (weights + activations + KV cache)")
        g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size on the CPU, in GB")
        g.add_argument("--swap-space", type=float, default=4.0, help="host memory for swapped KV blocks, in GB")
        g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
        g.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: max(2048, max-model-len))")
        g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
        g.add_argument("--enable-prefix-caching", action="store_true", help="share KV blocks of common prefixes")
        g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                       help="do not split long prompts over several steps")
        g.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None,
                       help="how to free memory under pressure (default: recompute single sequences, swap groups)")
        g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs to split the model over")
        g.add_argument("--distributed-timeout", type=float, default=d["distributed_timeout"].default,
                       help="seconds a tensor-parallel collective may wait for a rank before the engine stops")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch step N+1 before step N's tokens reach the host "
                            "(plain greedy batches; default: on with CUDA)")
        g.add_argument("--device", choices=_DEVICES, default="auto", help="where to run (auto: CUDA if present)")
        g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV cache storage: auto = the model dtype; fp8 = e4m3 with per-layer "
                            "scales (twice the blocks in the same memory)")
        g.add_argument("--quantization", "-q", choices=("none", "fp8"), default="none",
                       help="fp8: linear-layer weights in e4m3 with per-channel scales, "
                            "activations quantized per token (torch._scaled_mm on GPUs of "
                            "compute capability 8.9+, a dequantizing matmul elsewhere)")
        g.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantization fp8: the LM head in e4m3 too, one scale per "
                            "vocabulary row (off by default, as in vLLM: the logits pick the "
                            "tokens; see python -m pagedkv.bench.fp8_accuracy)")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="force the number of KV blocks (tests and experiments)")
        g.add_argument("--num-cpu-blocks-override", type=int, default=None,
                       help="force the number of swap blocks (tests and experiments)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)
