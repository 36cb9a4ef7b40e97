"""Wait for something to happen instead of sleeping for a fixed time.

``wait_until`` polls a predicate until it holds and returns its value; after
``timeout_s`` it raises an AssertionError naming what it waited for. ``wait_until_async``
is the same for async tests (its predicate may be a plain function or a coroutine
function; the event loop runs between polls). A fixed sleep stays only where the time
itself is under test: pacing load, holding a loop, a deliberate outage.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.05


def _timed_out(what: str, timeout_s: float, last: object, error: BaseException | None) -> str:
    message = f"timed out after {timeout_s:g} s waiting for {what} (last value: {last!r})"
    if error is not None:
        message += f"; last error: {type(error).__name__}: {error}"
    return message


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    *,
    interval_s: float = INTERVAL_S,
    what: str = "the condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` every ``interval_s`` until it returns a truthy value, and return
    it. Exceptions of the types in ``ignoring`` count as "not yet" (a server still
    starting). AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except ignoring as caught:
            error = caught
        else:
            if value:
                return value
            last, error = value, None
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s, last, error))
        time.sleep(interval_s)


async def wait_until_async(
    predicate: Callable[[], T] | Callable[[], Awaitable[T]],
    timeout_s: float,
    *,
    interval_s: float = INTERVAL_S,
    what: str = "the condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """``wait_until`` for async tests: sleeps with ``asyncio.sleep``, so the tasks under
    test run between polls; awaits ``predicate``'s result when it is awaitable."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as caught:
            error = caught
        else:
            if value:
                return value  # type: ignore[return-value]
            last, error = value, None
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s, last, error))
        await asyncio.sleep(interval_s)
