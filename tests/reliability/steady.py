"""Steady background traffic through Envoy, with every outcome recorded and attributed.

A response that carries the simulator's ``x-served-by`` header came from a backend; a 5xx
without it (or no response at all) was made by the routing layer: Envoy, the router or
the control plane's view of the fleet. Faults are judged by the routing layer's count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx

from extproc.stack.bootstrap import ROUTER_TARGET_HEADER
from extproc.stack.processes import WaitTimeout, wait_until

from ..prompts import document

CHAT = "/v1/chat/completions"


def chat(text: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


@dataclass(frozen=True)
class Sent:
    """One request's fate."""

    at: float  # monotonic send time
    doc: int
    status: int  # 0: no response (connection error or timeout)
    served_by: str | None  # the backend's x-served-by, None if no backend answered
    upstream: str | None  # Envoy's x-upstream-host
    error: str | None = None  # transport error, including a response cut mid-body
    # The router's primary for it (x-router-target): None or empty where Envoy went without
    # the router's answer (failed open).
    routed_to: str | None = None

    @property
    def routing_failure(self) -> bool:
        """No backend answered, and the client got an error: the routing layer failed."""
        return self.served_by is None and (self.status == 0 or self.status >= 500)

    @property
    def strayed(self) -> bool:
        """A backend served it, but not the one the router chose: Envoy failed it over,
        retried it elsewhere or failed it open, and that backend now caches its prompt."""
        return self.served_by is not None and self.served_by != self.routed_to

    @property
    def backend_failure(self) -> bool:
        """A backend answered with a 5xx, or its response was cut after its headers."""
        return self.served_by is not None and (self.status >= 500 or self.error is not None)


class SteadyTraffic:
    """About ``rate`` requests a second, open loop, for at most ``limit`` requests and
    ``max_seconds``, from a background thread. Request n carries ``document(n % docs)``,
    so affinity can be read from the record. ``body`` builds a request body per doc.
    """

    def __init__(
        self,
        url: str,
        rate: float = 50.0,
        limit: int = 6000,
        max_seconds: float = 150.0,
        docs: int = 20,
        body: Callable[[int], dict[str, Any]] | None = None,
        timeout_s: float = 10.0,
        max_concurrency: int = 64,
    ) -> None:
        self._url = url
        self._interval = 1.0 / rate
        self._limit = limit
        self._max_seconds = max_seconds
        self._docs = docs
        self._body = body or (lambda doc: chat(document(doc)))
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent: list[Sent] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    @property
    def sent(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)

    def since(self, started: float) -> list[Sent]:
        return [s for s in self.sent if s.at >= started]

    @property
    def routing_failures(self) -> list[Sent]:
        return [s for s in self.sent if s.routing_failure]

    @property
    def backend_failures(self) -> list[Sent]:
        return [s for s in self.sent if s.backend_failure]

    def strays(self) -> dict[int, set[str]]:
        """For each document, the backends that served it against the router's choice."""
        found: dict[int, set[str]] = {}
        for s in self.sent:
            if s.strayed:
                found.setdefault(s.doc, set()).add(s.served_by)
        return found

    def served_outside(self, fleet: set[str]) -> list[Sent]:
        return [s for s in self.sent if s.served_by is not None and s.served_by not in fleet]

    def summary(self) -> str:
        sent = self.sent
        statuses: dict[int, int] = {}
        for s in sent:
            statuses[s.status] = statuses.get(s.status, 0) + 1
        errors = [s.error for s in sent if s.error][:3]
        strayed = sum(s.strayed for s in sent)
        return f"{len(sent)} sent, statuses {statuses}, {strayed} strayed, first errors {errors}"

    def wait_for(self, count: int, timeout_s: float = 30.0) -> None:
        """Block until ``count`` more requests have completed, or ``timeout_s`` has passed:
        no error then, the assertions that follow judge what did complete."""
        target = len(self.sent) + count
        with suppress(WaitTimeout):
            wait_until(lambda: len(self.sent) >= target, timeout_s, f"{count} more requests")

    async def _one(self, client: httpx.AsyncClient, doc: int) -> None:
        at = time.monotonic()
        status, served_by, upstream, routed_to, error = 0, None, None, None, None
        try:
            async with client.stream("POST", CHAT, json=self._body(doc)) as response:
                status = response.status_code
                served_by = response.headers.get("x-served-by")
                upstream = response.headers.get("x-upstream-host")
                routed_to = response.headers.get(ROUTER_TARGET_HEADER)
                await response.aread()
        except httpx.HTTPError as caught:
            error = f"{type(caught).__name__}: {caught}"
        with self._lock:
            self._sent.append(Sent(at, doc, status, served_by, upstream, error, routed_to))

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self._max_concurrency)
        gate = asyncio.Semaphore(self._max_concurrency)
        tasks: set[asyncio.Task[None]] = set()

        async def gated(client: httpx.AsyncClient, doc: int) -> None:
            async with gate:
                await self._one(client, doc)

        async with httpx.AsyncClient(
            base_url=self._url, timeout=self._timeout_s, limits=limits
        ) as client:
            started = time.monotonic()
            for n in range(self._limit):
                due = started + n * self._interval
                now = time.monotonic()
                if self._stop.is_set() or now - started > self._max_seconds:
                    break
                if due > now:
                    await asyncio.sleep(due - now)  # paced: one request per interval
                task = asyncio.create_task(gated(client, n % self._docs))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=self._timeout_s + 5)
                # Those still queued at the gate are dropped before the client closes
                # under them (each would raise, and nobody would read it).
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)

    @contextmanager
    def running(self) -> Iterator[SteadyTraffic]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=self._timeout_s + 15)
            assert not self._thread.is_alive(), "steady traffic did not stop"
