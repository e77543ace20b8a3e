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


def iter_safetensors_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one shard at a time."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
