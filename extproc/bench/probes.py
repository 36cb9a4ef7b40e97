"""What the long-run benchmarks read off running processes: resident memory from /proc,
and Prometheus samples (labelled ones too) from a /metrics endpoint, read by
extproc/stack/prometheus.py (its helpers re-exported here)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

import httpx
import structlog

from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until
from extproc.stack.prometheus import Samples as Samples
from extproc.stack.prometheus import by_host as by_host
from extproc.stack.prometheus import scrape as scrape
from extproc.stack.prometheus import series as series
from extproc.stack.prometheus import total as total

log = structlog.get_logger("bench")


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid} (a zombie?)")


def placement_weights(stack: LocalStack) -> dict[str, float]:
    """The control plane's placement weights (cache pressure), by host address."""
    return by_host(scrape(stack.control_plane_metrics_url), "prefix_router_cp_placement_weight")


def wait_for_precise(stack: LocalStack, replicas: int, hosts: int, timeout_s: float = 30) -> None:
    """Until each of the first ``replicas`` routers reads ``hosts`` engines' KV events."""

    def precise(replica: int) -> float:
        samples = scrape(stack.replica_metrics_url(replica))
        return samples.get(("prefix_router_kv_events_hosts", (("state", "precise"),)), 0.0)

    wait_until(
        lambda: all(precise(r) == hosts for r in range(replicas)),
        timeout_s,
        f"{replicas} router replica(s) reading {hosts} engines' KV events",
    )


def wait_for_empty_views(stack: LocalStack, hosts: int, timeout_s: float = 60.0) -> None:
    """Until every live router process follows ``hosts`` engines' KV events and holds none
    of their blocks (after the engines' caches were reset and the resets published: see
    ``publish_resets``). For routers that read the engines' events only."""

    def empty(endpoint: int) -> bool:
        samples = scrape(stack.replica_metrics_url(endpoint))
        precise = samples.get(("prefix_router_kv_events_hosts", (("state", "precise"),)))
        blocks = by_host(samples, "prefix_router_kv_events_blocks")
        return precise == hosts and not any(blocks.values())

    wait_until(
        lambda: all(empty(e) for e in stack.live_router_endpoints()),
        timeout_s,
        f"every router process to follow {hosts} engines' KV events and hold none of their blocks",
    )


def publish_resets(addresses: Iterable[str], model: str) -> None:
    """Make each engine publish the ``AllBlocksCleared`` of a ``/reset_prefix_cache``.

    vLLM queues that event until the end of its next engine step, and an idle engine runs
    none: until a request reaches it, every subscriber to its events (our routers, a peer's
    KV-aware policy) still believes in the blocks it dropped, and a router started since
    replays them from the engine's buffer. A CI run of the real-vLLM tier sent a document's
    second request to an engine that had served nothing yet in that path and showed the
    path before's copy of it. One request of a one-token prompt runs a step that caches
    nothing (no block is full), so the event goes out alone."""
    for address in addresses:
        body = {"model": model, "prompt": "a", "max_tokens": 1}
        httpx.post(f"http://{address}/v1/completions", json=body, timeout=60).raise_for_status()


def reset_caches(
    addresses: Sequence[str],
    model: str,
    stack: LocalStack | None = None,
    followed: int | None = None,
) -> None:
    """Empty each engine's prefix cache and publish the resets (``publish_resets``).
    ``stack``: its routers read the engines' KV events; return once each follows
    ``followed`` engines (all of ``addresses`` by default) and holds none of their blocks."""
    for address in addresses:
        httpx.post(f"http://{address}/reset_prefix_cache", timeout=30).raise_for_status()
    publish_resets(addresses, model)
    if stack is not None:
        wait_for_empty_views(stack, len(addresses) if followed is None else followed)


def wait_for_idle_pressure(stack: LocalStack, timeout_s: float = 120.0) -> None:
    """Wait until no host's cache pressure steers placement (every weight is 1): the
    traffic of a run before, even one that bypassed the routers, has died away."""

    def idle() -> bool:
        try:
            return all(weight == 1.0 for weight in placement_weights(stack).values())
        except OSError:  # the control plane did not answer this time
            return False

    started = time.monotonic()
    wait_until(
        idle, timeout_s, "the cache pressure of earlier traffic to die away", stack.control_plane
    )
    # Each benchmark path may wait here: the log says how much of a run it is.
    log.info("bench.idle_pressure_wait", seconds=round(time.monotonic() - started, 1))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        # The command name may hold spaces; the fields after its closing parenthesis don't.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
