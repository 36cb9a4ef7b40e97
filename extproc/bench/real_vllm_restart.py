"""One real vLLM instance restarted under router workers: how soon its entries leave
every router process's view, how soon they follow it again, and whether the hit rate
comes back.

With ``router --workers N`` (every worker subscribed to every engine's KV events):

1. From reset caches, the documents scenario (one request at a time) fills the caches.
2. The instance whose cache holds the most is killed (SIGKILL: a crash, its cache gone).
   ``cleared_s``: until no worker's view holds a block of it
   (``prefix_router_kv_events_blocks{host}`` absent or 0 in every worker).
3. It starts again, empty. ``rejoined_s``: from its start until every worker knows the
   whole fleet again and follows every engine's events (``prefix_router_kv_events_hosts``
   precise for each).
4. The same requests again: the survivors still hold their documents, the restarted
   instance holds nothing, so the routing recovers when this pass's hit rate is at least
   the first pass's (which started from nothing everywhere) and the restarted instance
   serves again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from extproc.bench.counters import prefix_counters
from extproc.bench.probes import wait_for_idle_pressure
from extproc.bench.real_vllm import (
    RealVllmOptions,
    Recorder,
    document_requests,
    reset_caches,
    run_documents,
)
from extproc.stack import prometheus
from extproc.stack.local import LocalStack
from extproc.stack.processes import ManagedProcess, StackError, http_ok, wait_until

log = structlog.get_logger("bench")

# wait_until polls every 50 ms: the times below are that fine, plus a scrape of each worker.
CLEAR_TIMEOUT_S = 120.0
REJOIN_TIMEOUT_S = 600.0


@dataclass
class RestartResult:
    workers: int
    victim: str
    # The victim's blocks in each worker's view just before the kill.
    blocks_before: list[int]
    # Kill to no worker's view holding a block of the victim; None: not within
    # CLEAR_TIMEOUT_S.
    cleared_s: float | None
    # The victim's start to every worker following every engine again.
    rejoined_s: float
    hit_rate_before: float
    hit_rate_after: float
    served_before: dict[str, int]
    served_after: dict[str, int]

    @property
    def recovered(self) -> bool:
        return (
            self.cleared_s is not None
            and self.hit_rate_after >= self.hit_rate_before
            and self.served_after[self.victim] > 0
        )


def _views(stack: LocalStack) -> list[prometheus.Samples]:
    return [
        prometheus.scrape(stack.replica_metrics_url(endpoint))
        for endpoint in stack.live_router_endpoints()
    ]


def _blocks_of(stack: LocalStack, host: str) -> list[int]:
    return [
        int(prometheus.by_host(view, "prefix_router_kv_events_blocks").get(host, 0))
        for view in _views(stack)
    ]


def _timed(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    wait_until(condition, timeout_s, what)
    return time.monotonic() - started


def _every_worker_follows(stack: LocalStack, hosts: int) -> bool:
    for view in _views(stack):
        states = prometheus.by_label(view, "prefix_router_kv_events_hosts", "state")
        if view.get(("prefix_router_hosts", ())) != hosts or states.get("precise") != hosts:
            return False
    return True


def _pass(stack: LocalStack, options: RealVllmOptions) -> tuple[float, dict[str, int]]:
    """The documents scenario through the stack: (hit rate, requests served per host)."""
    addresses = stack.backend_addresses
    queries_before, hits_before = prefix_counters(addresses)
    recorder = Recorder(None)
    requests = document_requests(
        options, options.documents, options.document_chars, options.questions, "documents"
    )
    run_documents(stack.url, requests, 1, recorder)
    queries, hits = prefix_counters(addresses)
    hit_rate = (hits - hits_before) / max(1.0, queries - queries_before)
    return hit_rate, {a: recorder.served.get(a, 0) for a in addresses}


def run_restart(
    stack: LocalStack, servers: list[ManagedProcess], options: RealVllmOptions, workers: int
) -> RestartResult:
    addresses = stack.backend_addresses
    stack.use_router_workers(workers)
    stack.write_router_config(routing_strategy="PREFIX_AWARE")
    stack.restart_routers()
    wait_for_idle_pressure(stack)
    reset_caches(addresses, stack)  # and every worker follows every engine, holding nothing
    hit_rate_before, served_before = _pass(stack, options)
    # The instance holding the most, as the first worker sees it.
    first_view = prometheus.by_host(_views(stack)[0], "prefix_router_kv_events_blocks")
    victim = max(addresses, key=lambda a: first_view.get(a, 0))
    index = addresses.index(victim)
    blocks_before = _blocks_of(stack, victim)
    servers[index].kill()
    try:
        cleared_s: float | None = _timed(
            lambda: not any(_blocks_of(stack, victim)),
            CLEAR_TIMEOUT_S,
            f"every router worker to forget {victim}'s blocks",
        )
    except StackError:
        cleared_s = None  # a finding, reported as such; the run goes on

    servers[index].start()
    rejoined_s = _timed(
        lambda: http_ok(f"http://{victim}/health") and _every_worker_follows(stack, len(addresses)),
        REJOIN_TIMEOUT_S,
        f"{victim} back, and every worker following its events",
    )
    wait_for_idle_pressure(stack)
    hit_rate_after, served_after = _pass(stack, options)
    result = RestartResult(
        workers=workers,
        victim=victim,
        blocks_before=blocks_before,
        cleared_s=None if cleared_s is None else round(cleared_s, 2),
        rejoined_s=round(rejoined_s, 2),
        hit_rate_before=hit_rate_before,
        hit_rate_after=hit_rate_after,
        served_before=served_before,
        served_after=served_after,
    )
    log.info(
        "bench.real_vllm_restart",
        victim=victim,
        cleared_s=result.cleared_s,
        rejoined_s=result.rejoined_s,
        before=round(hit_rate_before, 3),
        after=round(hit_rate_after, 3),
    )
    return result
