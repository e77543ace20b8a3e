"""Hugging Face checkpoint folders: ``config.json`` plus ``*.safetensors`` (one file or shards).

Only safetensors are read (never pickled ``*.bin``). With a shard index
(``model.safetensors.index.json``) exactly the files it names are read, so stray files next to
them (Mistral repositories ship a ``consolidated.safetensors`` with other tensor names) are
left alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights; ``ValueError`` if there are none."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shards named in {INDEX_FILE} are missing: {missing}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no *.safetensors weights (pickled *.bin checkpoints are not read); "
            "convert them to safetensors, or use load_format='dummy' for random weights"
        )
    return files


def iter_safetensors_weights(
    folder: str | Path, *, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | SafetensorsSlice]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one shard at a time.

    ``lazy=True`` yields :class:`SafetensorsSlice` handles instead, valid until the next item:
    a tensor-parallel rank reads only its slice of each tensor."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, (SafetensorsSlice(f, name) if lazy else f.get_tensor(name))


class SafetensorsSlice:
    """A checkpoint tensor not read yet: ``shape``, ``narrow`` (reads that slice only) and
    ``materialize`` (reads it all)."""

    __slots__ = ("_slice", "name", "shape")

    def __init__(self, handle, name: str) -> None:
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)] if self.shape else self._slice[:]
