"""Shadow mode off the request path: a thread that owns the ``Shadow`` and applies, in
order, what the router tells it through ``ShadowObserver`` (``observers.py``): place a
request, release it, the fleet changed.

A request only queues what the shadow needs (its key, whose block chain this thread
hashes, the hosts it could go to, the placement weights, the time); the shadow's
PREFIX_AWARE placement, which costs as much as a PREFIX_AWARE decision, runs in this
thread. Everything that changes the shadow goes through the one queue, so it sees events
in the order the router made them, and only this thread touches it. At most
``QUEUE_EVENTS`` requests wait to be placed: beyond that a request is left out of the
shadow (counted), never delayed. Releases and fleet changes are always queued: there are
no more releases than requests placed, and fleet changes are rare. The metrics read the
shadow's counters as they stand.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from extproc.adapter import metrics
from extproc.index.shadow import Shadow
from extproc.picker.blocks import PromptBlocks
from extproc.picker.hosts import HostSet

log = structlog.get_logger("router")

QUEUE_EVENTS = 65_536
_STOP = object()


class ShadowWorker:
    def __init__(self, shadow: Shadow) -> None:
        self.shadow = shadow
        self.dropped = 0
        self._events: queue.Queue[Any] = queue.Queue()
        self._room = threading.BoundedSemaphore(QUEUE_EVENTS)
        # Requests placed and not yet released: the router's token -> the shadow's host.
        self._placed: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="shadow", daemon=True)
        self._thread.start()

    # --- what the router calls (the event loop's thread)

    def place(
        self,
        token: int,
        blocks: PromptBlocks | Callable[[], PromptBlocks],
        hosts: HostSet,
        weights: Mapping[str, float],
        now: float,
    ) -> None:
        """Queue one request's placement; ``blocks`` may be a callable that hashes the
        chain, which this worker then calls, off the request path."""
        if not self._room.acquire(blocking=False):
            self.dropped += 1
            metrics.SHADOW_DROPPED.inc()
            return
        self._events.put((self._place, token, blocks, hosts, weights, now))

    def release(self, token: int) -> None:
        self._events.put((self._release, token))

    def retain(self, hosts: Iterable[str]) -> None:
        self._events.put((self.shadow.retain, frozenset(hosts)))

    def forget(self, host: str) -> None:
        self._events.put((self.shadow.forget, host))

    def set_cache_sizes(self, tokens: Mapping[str, float]) -> None:
        self._events.put((self.shadow.set_cache_sizes, dict(tokens)))

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until every event queued so far is applied (tests, and a clean stop)."""
        done = threading.Event()
        self._events.put((done.set,))
        done.wait(timeout)

    def stop(self) -> None:
        self._events.put((_STOP,))
        self._thread.join(timeout=10)

    # --- the worker thread

    def _run(self) -> None:
        while True:
            event = self._events.get()
            apply: Callable[..., Any] | object = event[0]
            if apply is _STOP:
                return
            assert callable(apply)
            try:
                apply(*event[1:])
            except Exception:  # a bug in the shadow must not end shadow mode silently
                log.exception("shadow_event_failed", kind=getattr(apply, "__name__", "?"))

    def _place(
        self,
        token: int,
        blocks: PromptBlocks | Callable[[], PromptBlocks],
        hosts: HostSet,
        weights: Mapping[str, float],
        now: float,
    ) -> None:
        try:
            with metrics.SHADOW_SECONDS.time():
                if callable(blocks):
                    blocks = blocks()
                self._placed[token] = self.shadow.place(blocks, hosts, weights, now)
        finally:
            self._room.release()

    def _release(self, token: int) -> None:
        host = self._placed.pop(token, None)
        if host is not None:
            self.shadow.release(host)

    @property
    def pending(self) -> int:
        """Requests placed and not released, as of the last applied event."""
        return len(self._placed)
