"""The shared wait helper: returns as soon as the condition holds, names it on timeout."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest

from extproc.stack.processes import (
    ManagedProcess,
    StackError,
    wait_until,
    wait_until_async,
)


def test_returns_the_first_truthy_value_without_waiting_for_the_timeout():
    counter = itertools.count()
    started = time.monotonic()
    assert wait_until(lambda: next(counter) >= 3 and "done", 5, interval_s=0.01) == "done"
    assert time.monotonic() - started < 1


def test_a_timeout_names_what_it_waited_for_and_the_last_value():
    with pytest.raises(AssertionError, match=r"after 0.05 s waiting for the cake \(last value: 0"):
        wait_until(lambda: 0, 0.05, interval_s=0.01, what="the cake")


def test_ignored_errors_count_as_not_yet_and_are_reported():
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 2:
            raise ConnectionRefusedError("not up yet")
        return True

    assert wait_until(flaky, 5, interval_s=0.01, ignoring=(OSError,)) is True
    with pytest.raises(AssertionError, match="last error: ConnectionRefusedError: nope"):
        wait_until(
            lambda: (_ for _ in ()).throw(ConnectionRefusedError("nope")),
            0.05,
            interval_s=0.01,
            ignoring=(OSError,),
        )
    with pytest.raises(ValueError):  # anything else propagates
        wait_until(lambda: int("x"), 1, ignoring=(OSError,))


async def test_the_async_twin_lets_the_loop_run_and_awaits_coroutine_predicates():
    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, flag.set)
    await wait_until_async(flag.is_set, 5, interval_s=0.01, what="the flag")

    async def ready() -> int:
        return 7

    assert await wait_until_async(ready, 1) == 7
    with pytest.raises(AssertionError, match="waiting for never"):
        await wait_until_async(lambda: False, 0.05, interval_s=0.01, what="never")


def test_a_timeout_is_a_stack_error_to_the_runtime():
    with pytest.raises(StackError, match="waiting for the stack"):
        wait_until(lambda: False, 0.05, "the stack", interval_s=0.01)


def test_a_process_that_exits_ends_the_wait_at_once_with_its_log(tmp_path):
    code = "print('bye'); raise SystemExit(3)"
    process = ManagedProcess("quitter", [sys.executable, "-c", code], tmp_path / "log").start()
    started = time.monotonic()
    with pytest.raises(
        StackError, match="quitter exited with 3 while waiting for it to serve:\nbye"
    ):
        wait_until(lambda: False, 30, "it to serve", process)
    assert time.monotonic() - started < 10
