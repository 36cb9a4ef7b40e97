"""Helpers for control-plane tests: fast health settings, prefix probes, background load."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import httpx

from extproc.stack.local import FAST_CONTROL_PLANE, INSTANT_PREFILL, LocalStack, StackSpec
from extproc.stack.processes import wait_until
from extproc.stack.prometheus import scrape, total

from ..prompts import document
from ..reliability.stacks import NEVER_SHED


def fleet_spec(backends: int = 3, **overrides) -> StackSpec:
    settings = {
        # Caches large enough that no test prefix is evicted: placements then show routing
        # alone (an evicted prefix is placed afresh, by its anchor and the cache pressure).
        "sim_args": ("--ttft-ms", "0", "--itl-ms", "20", "--capacity-blocks", "40000"),
        # The simulators answer at once (--ttft-ms 0).
        "router_settings": {
            "concurrency_threshold": 4,
            "prefix_length": 4096,
            **INSTANT_PREFILL,
            **NEVER_SHED,
        },
        "control_plane_settings": FAST_CONTROL_PLANE,
        **overrides,
    }
    return StackSpec.ephemeral(backends, **settings)


def chat(text: str, max_tokens: int = 1) -> dict:
    return {
        "model": "sim-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }


__all__ = ["document", "moved_fraction"]


def moved_fraction(before: dict[int, str], after: dict[int, str]) -> float:
    """The share of ``before``'s documents served somewhere else ``after``."""
    return sum(before[d] != after[d] for d in before) / len(before)


def placements(stack: LocalStack, docs: Iterable[int]) -> dict[int, str]:
    """Where each document's prefix is served now (every request must succeed)."""
    result = {}
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        for doc in docs:
            response = client.post("/v1/chat/completions", json=chat(document(doc)))
            response.raise_for_status()
            result[doc] = response.headers["x-upstream-host"]
    return result


def wait_for_envoy_hosts(stack: LocalStack, expected: set[str], timeout: float = 10) -> float:
    """Seconds until Envoy's cluster holds exactly ``expected``."""
    started = time.monotonic()
    wait_until(lambda: stack.envoy_hosts() == expected, timeout, f"envoy hosts {expected}")
    return time.monotonic() - started


def wait_for_router_hosts(stack: LocalStack, count: int, timeout: float = 10) -> None:
    wait_until(
        lambda: stack.router_metric("prefix_router_hosts") == count,
        timeout,
        f"router to know {count} hosts",
    )


def wait_for_load_in_feed(stack: LocalStack, host: str, running: int, timeout: float = 10) -> None:
    """Until ``host`` reports ``running`` requests running and the router has taken two
    load-feed rounds since: one may have been scraped before the host's load changed."""
    wait_until(
        lambda: host_running(host) == running,
        timeout,
        f"{host} to run {running} requests",
    )
    rounds = load_rounds(stack)
    wait_until(lambda: load_rounds(stack) >= rounds + 2, timeout, "two load-feed rounds")


def host_running(host: str) -> float:
    """vLLM's running requests, as ``host`` reports them (summed over its models)."""
    return total(scrape(f"http://{host}/metrics", timeout_s=5), "vllm:num_requests_running")


def load_rounds(stack: LocalStack) -> float:
    samples = scrape(stack.router_metrics_url, timeout_s=5)
    return samples.get(("prefix_router_fleet_updates_total", (("kind", "load"),)), 0.0)


class Traffic:
    """Background requests over a rotating set of prefixes, bounded in count and time."""

    def __init__(self, stack: LocalStack, docs: int = 20, limit: int = 5000) -> None:
        self._stack = stack
        self._docs = docs
        self._limit = limit
        self._stop = threading.Event()
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=self._stack.url, timeout=10) as client:
            n = 0
            while not self._stop.is_set() and n < self._limit and time.monotonic() < deadline:
                try:
                    body = chat(document(1000 + n % self._docs))
                    self.statuses.append(client.post("/v1/chat/completions", json=body).status_code)
                except httpx.HTTPError as error:
                    self.errors.append(repr(error))
                n += 1

    @property
    def failures(self) -> int:
        return sum(s >= 500 for s in self.statuses) + len(self.errors)

    @property
    def failed(self) -> str:
        """What failed, for an assertion's message: each 5xx status's count, the first errors."""
        statuses = Counter(s for s in self.statuses if s >= 500)
        return f"statuses {dict(statuses)}, errors {self.errors[:3]}"

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=30)
