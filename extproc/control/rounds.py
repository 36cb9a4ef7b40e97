"""Shared timing for the control plane's periodic rounds."""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_unless_stopped(seconds: float, stop: asyncio.Event) -> None:
    """Sleep ``seconds``, waking at once if ``stop`` is set."""
    if seconds <= 0:
        await asyncio.sleep(0)  # let other tasks run between back-to-back rounds
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
