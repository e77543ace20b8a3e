"""`TokenizerWorker`: whole-prompt tokenization off the event loop.

A 4 MB prompt tokenized on the event loop would stall /health and every other stream for as
long as it takes, so whole prompts, detokenization, chat templates and grammar compilation run
on one thread of their own, with their own copy of the tokenizer. A text that must be longer
than the context is refused before it is tokenized, from a lower bound on its tokens that its
bytes give.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedkv.server.errors import bad_request

T = TypeVar("T")


class TokenizerWorker:
    """One thread with its own copy of the tokenizer: whole-prompt tokenization,
    detokenization, chat templates and grammar compilation run there, off the event loop.

    One thread, so the copy is never used by two threads at once; the event loop keeps the
    engine's tokenizer for its per-token work."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer")
        #: Most UTF-8 bytes one token can stand for (4 per character of its vocabulary entry:
        #: byte-level entries are one character per byte, others at most 4 bytes per character);
        #: a text of B bytes has at least B / this many tokens.
        self.max_token_bytes: int | None = None
        get_vocab = getattr(tokenizer, "get_vocab", None)
        if callable(get_vocab):
            with_added = list(get_vocab())
            if with_added:
                self.max_token_bytes = 4 * max(len(t) for t in with_added)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def min_tokens(self, text: str) -> tuple[int, int]:
        """(a lower bound on the tokens of `text`, its UTF-8 bytes)."""
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise bad_request(
                f"text has a lone UTF-16 surrogate at character {exc.start}, which is not valid "
                "Unicode; send valid UTF-8 text"
            ) from None
        if not self.max_token_bytes:
            return 0, nbytes
        return -(-nbytes // self.max_token_bytes), nbytes

    def encode(self, text: str, add_special_tokens: bool, limit: int | None, param: str
               ) -> list[int]:
        """Token ids of `text`; a 400 when it is not valid Unicode or must have more than
        `limit` tokens (checked from its length before tokenizing)."""
        bound, nbytes = self.min_tokens(text)
        if limit is not None and bound > limit:
            raise bad_request(
                f"the prompt has at least {bound} tokens ({nbytes} bytes of text, at most "
                f"{self.max_token_bytes} bytes per token), more than this model's maximum "
                f"context length of {limit} tokens; shorten the prompt",
                param,
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))
