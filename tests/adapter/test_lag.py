"""The event loop's lag: how late it wakes, the second worst of a window (one late wake-up
is a pause, not a loop running late)."""

from __future__ import annotations

import asyncio
import time

from extproc.adapter.lag import LoopLag


def test_the_lag_is_the_second_worst_of_the_recent_wake_ups():
    lag = LoopLag(window=3)
    assert lag.seconds == 0.0
    lag.woke(0.3)
    assert lag.seconds == 0.0  # one late wake-up alone: a pause
    for late in (0.01, 0.25):
        lag.woke(late)
    assert lag.seconds == 0.25  # a second one: the loop runs late
    lag.woke(0.0)  # the 0.3 s one has left the window
    assert lag.seconds == 0.01
    lag.woke(0.0)
    lag.woke(-0.001)  # early (clock granularity) counts as on time, not as negative lag
    assert lag.seconds == 0.0


async def test_a_loop_blocked_twice_shows_as_lag_once_does_not_and_an_idle_one_does_not():
    lag = LoopLag(interval_s=0.01, window=5)
    stop = asyncio.Event()
    task = asyncio.create_task(lag.run(stop))
    await asyncio.sleep(0.1)  # idle: prompt wake-ups fill the window
    time.sleep(0.25)  # a handler that holds the loop
    await asyncio.sleep(0.02)  # a turn or two: the task records the late wake-up
    assert lag.seconds < 0.1  # one pause
    time.sleep(0.25)  # and again, within the window
    await asyncio.sleep(0.02)
    assert lag.seconds >= 0.2
    await asyncio.sleep(0.2)  # five prompt wake-ups later both blocks have left the window
    assert lag.seconds < 0.1
    stop.set()
    await asyncio.wait_for(task, 1)


async def test_a_wake_up_overdue_counts_before_it_happens_after_one_late_already():
    """In a burst, streams opened in the same turn of the loop see the lag rising."""
    lag = LoopLag(interval_s=0.01, window=5)
    stop = asyncio.Event()
    task = asyncio.create_task(lag.run(stop))
    await asyncio.sleep(0.05)  # idle: prompt wake-ups only
    time.sleep(0.25)  # the loop is held: the task's wake-up is overdue, not yet recorded
    assert lag.seconds < 0.1  # the first pause, overdue or recorded, is a pause
    await asyncio.sleep(0.02)
    time.sleep(0.25)  # held again: the overdue wake-up is the second late one
    assert lag.seconds >= 0.2
    stop.set()
    await asyncio.wait_for(task, 1)
