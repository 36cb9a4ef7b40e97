"""How far behind the router's event loop runs: the signal to shed.

A task asks to wake every ``interval_s`` and measures how late it wakes. Every ext_proc
message waits in the same loop, so a loop that wakes late answers Envoy late, and past
Envoy's ``message_timeout`` Envoy gives up on the router and places the request by its
own fallback, which the router never sees. The second worst lateness over the last
``window`` wake-ups is the lag; the service sheds while it is over ``shed_lag_s``. One
late wake-up alone is a pause (the OS ran other processes first, a collection), not a loop
that runs late: on a busy 2-core CI machine, the worst alone shed requests of a router
that was keeping up, which then lost their prefix's host.

A wake-up that is due but has not happened yet counts too, as late as it already is: in a
burst, thousands of streams open within one turn of the loop, and a lag read only when the
task wakes would rise after all of them had been admitted to wait (a burst from an idle
loop is caught by the count of undecided streams, ``shed_backlog``, until then).
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
        # The worst and second worst of the window, kept as wake-ups come (every interval_s)
        # so that reading the lag, once per stream, stays cheap.
        self._worst = (0.0, 0.0)
        self._clock = clock
        # When the task's next wake-up is due; None while it is not waiting for one.
        self._due: float | None = None

    @property
    def seconds(self) -> float:
        """The second worst lateness of the recent wake-ups and of the one now due (0 while
        at most one was late)."""
        overdue = 0.0 if self._due is None else self._clock() - self._due
        worst, second = self._worst
        return max(second, min(overdue, worst))

    def woke(self, late_s: float) -> None:
        self._late.append(max(0.0, late_s))
        ordered = sorted(self._late, reverse=True)
        self._worst = (ordered[0], ordered[1] if len(ordered) > 1 else 0.0)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            due = self._due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._due = None
            self.woke(self._clock() - due)
