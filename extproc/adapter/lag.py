"""How far behind the router's event loop runs: the signal to shed.

A task asks to wake every ``interval_s`` and measures how late it wakes. Every ext_proc
message waits in the same loop, so a loop that wakes late answers Envoy late, and past
Envoy's ``message_timeout`` Envoy gives up on the router and places the request by its
own fallback, which the router never sees. The worst lateness over the last ``window``
wake-ups is the lag; the service sheds while it is over ``shed_lag_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class LoopLag:
    def __init__(
        self,
        interval_s: float = 0.05,
        window: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._late: deque[float] = deque(maxlen=window)
        self._clock = clock

    @property
    def seconds(self) -> float:
        """The worst lateness of the recent wake-ups (0 before the first)."""
        return max(self._late, default=0.0)

    def woke(self, late_s: float) -> None:
        self._late.append(max(0.0, late_s))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            asked = self._clock()
            await asyncio.sleep(self.interval_s)
            self.woke(self._clock() - asked - self.interval_s)
