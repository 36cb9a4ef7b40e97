"""An open-loop load generator: each request is sent at its scheduled time, whatever the
state of earlier ones, and its time to first token is read from the streamed response.

The one exception is a conversation: its later turns resend the replies to the earlier
ones, so a client sends turn k+1 only once it has turn k's reply, after a think time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp


class ScheduledRequest(Protocol):
    @property
    def at_s(self) -> float: ...

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def headers(self) -> dict[str, str]: ...

    @property
    def group(self) -> str: ...

    @property
    def think_s(self) -> float | None: ...


@dataclass(frozen=True)
class RequestOutcome:
    group: str
    status: int
    ttft_s: float | None
    latency_s: float | None
    output_tokens: int
    served_by: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


async def _one(
    session: aiohttp.ClientSession, url: str, request: ScheduledRequest
) -> RequestOutcome:
    started = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        async with session.post(url, json=request.body, headers=request.headers) as response:
            served_by = response.headers.get("x-served-by")
            if response.status != 200:
                await response.read()
                return RequestOutcome(request.group, response.status, None, None, 0, served_by)
            async for raw in response.content:
                line = raw.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    tokens += 1
            return RequestOutcome(
                request.group, 200, ttft, time.perf_counter() - started, tokens, served_by
            )
    except (aiohttp.ClientError, TimeoutError) as error:
        return RequestOutcome(request.group, 0, None, None, tokens, None, repr(error)[:200])


async def run_open_loop(
    url: str,
    requests: Sequence[ScheduledRequest],
    time_scale: float = 1.0,
    timeout_s: float = 300.0,
) -> tuple[list[RequestOutcome], float]:
    """Send every request at ``at_s * time_scale``, or, if it has a think time, that long
    (times ``time_scale``) after the previous request of its group (in ``at_s`` order) has
    ended; returns outcomes (in request order) and the wall time from the first send to
    the last completion."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    ended: dict[int, asyncio.Event] = {}  # request index -> its response has ended
    previous: dict[int, int] = {}  # request index -> the group's request before it
    last_of_group: dict[str, int] = {}
    for index in sorted(range(len(requests)), key=lambda i: requests[i].at_s):
        group = requests[index].group
        if requests[index].think_s is not None and group in last_of_group:
            previous[index] = last_of_group[group]
        last_of_group[group] = index
        ended[index] = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def scheduled(index: int, request: ScheduledRequest) -> RequestOutcome:
            try:
                if index in previous and request.think_s is not None:
                    await ended[previous[index]].wait()
                    await asyncio.sleep(request.think_s * time_scale)
                else:
                    delay = start + request.at_s * time_scale - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                return await _one(session, url, request)
            finally:
                ended[index].set()

        outcomes = await asyncio.gather(*(scheduled(i, r) for i, r in enumerate(requests)))
        return list(outcomes), loop.time() - start


async def run_closed_loop(
    url: str,
    requests: Sequence[ScheduledRequest],
    concurrency: int,
    time_limit_s: float,
    timeout_s: float = 300.0,
) -> tuple[list[RequestOutcome], float]:
    """``concurrency`` clients, each sending its next request as soon as its last one ends
    (arrival times ignored), until the requests run out or ``time_limit_s`` has passed.
    Returns the outcomes of the requests sent, in completion order, and the wall time from
    the first send to the last completion: at saturation, completions per second are the
    capacity of the path and the fleet behind it."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    pending = iter(requests)
    outcomes: list[RequestOutcome] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def client() -> None:
            while loop.time() - start < time_limit_s:
                request = next(pending, None)
                if request is None:
                    return
                outcomes.append(await _one(session, url, request))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return outcomes, loop.time() - start
