"""GGUF files: metadata, a transformers config built from it, and dequantized weights.

The header is parsed here with ``struct`` rather than with ``gguf.GGUFReader``: the reader builds
a numpy view per element of every metadata array, which for a 49k-token vocabulary takes seconds,
while a plain parse takes a few milliseconds. Tensor data is memory-mapped and dequantized with
``gguf.quants.dequantize`` (any quantization type the ``gguf`` package knows).

Tensor names are mapped to Hugging Face names so that each model has a single ``load_weights``.
Two conversions done by llama.cpp's converter are undone: Llama's Q and K rows are permuted for
llama.cpp's interleaved RoPE layout, and GPT-2's Conv1D weights are stored transposed.

What differs between families (the ``general.architecture`` value, the transformers config
class, the tensor names, which of the two conversions apply) is each family's
:class:`~pagedkv.engine.models.registry.GGUFLayout` in the model registry; this module holds
only the metadata readers those layouts name (:data:`CONFIG_READERS`).
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from pagedkv.engine.models.registry import GGUFLayout, get_gguf_layout

logger = logging.getLogger(__name__)

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}

@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """Metadata key/values and tensor directory of one GGUF file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor directory (no tensor data is read)."""
    path = Path(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            return _parse_header(path, buf)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{path} is not a valid GGUF file: {exc}") from exc
        finally:
            buf.release()


def _parse_header(path: Path, buf: memoryview) -> GGUFHeader:
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        ggml_type = cur.scalar("<I")
        infos.append((name, shape, ggml_type, cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, ggml_type, shape, data_start + offset)
        for name, shape, ggml_type, offset in infos
    }
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


# --------------------------------------------------------------------------- config


def gguf_layout(header: GGUFHeader) -> GGUFLayout:
    """The registry's layout for the file's ``general.architecture``; ``ValueError`` naming it,
    the file and the supported architectures otherwise."""
    try:
        return get_gguf_layout(header.architecture)
    except ValueError as exc:
        raise ValueError(f"{header.path.name}: {exc}") from None


def gguf_to_hf_config(header: GGUFHeader) -> Any:
    """A transformers config equivalent to the GGUF metadata (what transformers' own GGUF
    loader derives, without re-reading the file)."""
    import transformers

    layout = gguf_layout(header)
    a = header.arch_value
    embd = header.tensors.get("token_embd.weight")
    vocab_size = embd.shape[1] if embd is not None else a("vocab_size")
    if vocab_size is None:
        vocab_size = len(header.metadata.get("tokenizer.ggml.tokens", []))
    common = {
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": header.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": header.metadata.get("tokenizer.ggml.padding_token_id"),
    }
    kwargs = CONFIG_READERS[layout.config_reader](header)
    return getattr(transformers, layout.config_class)(**kwargs, **common)


def _gpt2_config(header: GGUFHeader) -> dict[str, Any]:
    a = header.arch_value
    return {
        "n_positions": int(a("context_length")),
        "n_embd": int(a("embedding_length")),
        "n_layer": int(a("block_count")),
        "n_head": int(a("attention.head_count")),
        "n_inner": int(a("feed_forward_length")),
        "layer_norm_epsilon": float(a("attention.layer_norm_epsilon", 1e-5)),
    }


def _decoder_config(header: GGUFHeader) -> dict[str, Any]:
    """Llama-style decoders (llama.cpp's ``llama``, ``qwen2``, ...)."""
    a = header.arch_value
    num_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    kwargs: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(a("attention.head_count_kv", num_heads)),
        "head_dim": int(a("attention.key_length", a("rope.dimension_count", hidden // num_heads))),
        "max_position_embeddings": int(a("context_length", 2048)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
    }
    scaling = a("rope.scaling.type")
    if scaling == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only linear)")
    return kwargs


# GGUFLayout.config_reader -> the function reading a config's keyword arguments from the metadata
CONFIG_READERS: Mapping[str, Callable[[GGUFHeader], dict[str, Any]]] = MappingProxyType(
    {"decoder_config": _decoder_config, "gpt2_config": _gpt2_config}
)


# --------------------------------------------------------------------------- weights

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(layout: GGUFLayout, gguf_name: str) -> tuple[str | None, str]:
    """(Hugging Face name or None if unknown, GGUF tensor kind such as ``attn_q``)."""
    if gguf_name == "rope_freqs.weight":
        return "rope_freqs", "rope_freqs"
    if m := _BLOCK.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in layout.block_names:
            return f"{layout.block_prefix}.{layer}.{layout.block_names[kind]}.{suffix}", kind
        return None, kind
    base, _, suffix = gguf_name.rpartition(".")
    if base in layout.global_names:
        return f"{layout.global_names[base]}.{suffix}", base
    return None, base


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias).

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ...; Hugging Face rotates halves.
    Its converter reorders each head's rows from [first half; second half] to interleaved;
    this restores [first half; second half].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """Float32 array in numpy order (slowest dimension first) for one tensor."""
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_elems = int(np.prod(info.shape))
    np_shape = tuple(reversed(info.shape))
    raw = data[info.offset : info.offset + n_elems * type_size // block_size]
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.array(raw.view(np.float32).reshape(np_shape))
    if qtype == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(np_shape).astype(np.float32)
    byte_shape = gguf.quants.quant_shape_to_byte_shape(np_shape, qtype)
    return np.asarray(gguf.quants.dequantize(raw.reshape(byte_shape), qtype), dtype=np.float32)


def iter_gguf_weights(header: GGUFHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight of a supported GGUF file."""
    layout = gguf_layout(header)
    arch = header.architecture
    num_heads = int(header.arch_value("attention.head_count", 0))
    num_kv_heads = int(header.arch_value("attention.head_count_kv", num_heads))
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    for gguf_name, info in header.tensors.items():
        name, kind = _hf_name(layout, gguf_name)
        if name is None:
            logger.warning("ignoring GGUF tensor %r: not part of a %s model", gguf_name, arch)
            continue
        weight = dequantize_tensor(data, info)
        if layout.rope_permuted and kind == "attn_q":
            weight = unpermute_rope_rows(weight, num_heads)
        elif layout.rope_permuted and kind == "attn_k":
            weight = unpermute_rope_rows(weight, num_kv_heads)
        elif kind in layout.transposed and weight.ndim == 2:
            weight = weight.T  # back to Hugging Face's [in, out] layout (GPT-2's Conv1D)
        yield name, torch.from_numpy(np.ascontiguousarray(weight))
