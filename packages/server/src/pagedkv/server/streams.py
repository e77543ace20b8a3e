"""Async plumbing between HTTP requests and engine streams: merging, cleanup, disconnects.

The one rule here: a request the client no longer waits for must be aborted, so that its KV
blocks go back to the pool. Every engine stream is therefore closed in a `finally` (closing the
engine's generator aborts an unfinished request), and that cleanup runs shielded from the
cancellation that triggered it (Starlette cancels a streaming response's task group when the
client disconnects; an unshielded `await` in the cleanup would be cancelled again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")

_DONE = object()


async def aclose_quietly(it: AsyncIterator[Any]) -> None:
    """Close an async generator even while our own task is being cancelled."""
    aclose = getattr(it, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await aclose()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    An exception in one stream cancels the others and is raised here; closing this generator
    early (client gone) cancels and closes every stream.
    """
    if len(streams) == 1:
        only = streams[0]
        try:
            async for item in only:
                yield 0, item
        finally:
            await aclose_quietly(only)
        return

    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait((i, None, exc))
            return
        finally:
            await aclose_quietly(it)
        queue.put_nowait((i, _DONE, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("client disconnected before the answer was ready")
    return task.result()


async def start_stream(it: AsyncIterator[T]) -> AsyncIterator[T]:
    """Start `it` now and return a stream of the same items.

    The engine validates a request when its stream starts (before its first await). Running
    the stream up to that point before the HTTP response begins turns a rejected request into
    a proper 400 instead of an error event inside a 200 stream.
    """

    async def first_item() -> T:
        return await it.__anext__()

    first = asyncio.ensure_future(first_item())
    await asyncio.sleep(0)  # the task runs up to its first suspension (or its error)
    if first.done() and not first.cancelled() and first.exception() is not None:
        exc = first.exception()
        if not isinstance(exc, StopAsyncIteration):
            await aclose_quietly(it)
            raise exc  # type: ignore[misc]
    return _resume(first, it)


async def _resume(first: asyncio.Future[T], it: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in it:
            yield item
    finally:
        if not first.done():
            first.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(first, return_exceptions=True)
        await aclose_quietly(it)
