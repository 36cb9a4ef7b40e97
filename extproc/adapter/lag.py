"""How far behind the router's event loop runs: the signal to shed.

A task asks to wake every ``interval_s`` and measures how late it wakes. Every ext_proc
message waits in the same loop, so a loop that wakes late answers Envoy late, and past
Envoy's ``message_timeout`` Envoy gives up on the router and places the request by its
own fallback, which the router never sees. The worst lateness over the last ``window``
wake-ups is the lag; the service sheds while it is over ``shed_lag_s``.

A wake-up that is due but has not happened yet counts too, as late as it already is: in a
burst, thousands of streams open within one turn of the loop, and a lag read only when the
task wakes would rise after all of them had been admitted to wait.
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
        # When the task's next wake-up is due; None while it is not waiting for one.
        self._due: float | None = None

    @property
    def seconds(self) -> float:
        """The worst lateness of the recent wake-ups and of the one now due (0 before the
        first)."""
        overdue = 0.0 if self._due is None else self._clock() - self._due
        return max(overdue, max(self._late, default=0.0))

    def woke(self, late_s: float) -> None:
        self._late.append(max(0.0, late_s))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            due = self._due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._due = None
            self.woke(self._clock() - due)
