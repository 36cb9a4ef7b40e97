"""Stack specs and probes shared by the reliability tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

from extproc.stack.local import (
    FAST_CONTROL_PLANE,
    INSTANT_PREFILL,
    LocalStack,
    StackSpec,
    envoy_counters,
)
from extproc.stack.processes import wait_until

from ..prompts import document
from .steady import CHAT, chat

# No overflow at this traffic level, and placement by hash alone (no cache-pressure
# weights, which move new prefixes as the load shifts; simulators that answer at once, so
# no prefill queue builds), so placements can be compared exactly while background
# traffic runs.
# Never shed, for tests about placement. A router whose loop wakes 0.2 s late sheds by
# design: it places by load alone and ends the stream at the headers
# (tests/integration/test_shedding.py). On a 2-core CI machine starting vLLM engines
# beside these tests, the OS alone delays the loop that much at times: the project's CI
# then saw documents on two and three hosts, and a stream that ended before its body was
# answered. No test stack here sees a backlog near shed_backlog.
NEVER_SHED: dict[str, Any] = {"shed_lag_s": None}
PINNED_ROUTING = {
    "concurrency_threshold": 64,
    "balance_factor": None,
    "prefix_length": 4096,
    **NEVER_SHED,
    **INSTANT_PREFILL,
}
PINNED_CONTROL_PLANE = {
    **FAST_CONTROL_PLANE,
    "load_feed": {**FAST_CONTROL_PLANE["load_feed"], "pressure_factor": None},
}
# Caches that hold every test prefix: nothing is evicted, so a prefix's host changes only
# when routing moves it.
SIM_ARGS = ("--ttft-ms", "0", "--itl-ms", "20", "--capacity-blocks", "40000")


def reliability_spec(backends: int = 3, **overrides: Any) -> StackSpec:
    settings: dict[str, Any] = {
        "sim_args": SIM_ARGS,
        "router_settings": PINNED_ROUTING,
        "control_plane_settings": PINNED_CONTROL_PLANE,
        **overrides,
    }
    return StackSpec.ephemeral(backends, **settings)


def placements(stack: LocalStack, docs: Iterable[int]) -> dict[int, str]:
    """Where each document's prefix is served now, by the backend's own x-served-by."""
    return {doc: response.headers["x-served-by"] for doc, response in _asked(stack, docs)}


def served_cached(stack: LocalStack, docs: Iterable[int]) -> dict[int, tuple[str, bool]]:
    """Where each document's prefix is served now, and whether that backend had it cached
    (its usage reports cached tokens: documents differ in their first block)."""
    return {
        doc: (
            response.headers["x-served-by"],
            response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0,
        )
        for doc, response in _asked(stack, docs)
    }


def _asked(stack: LocalStack, docs: Iterable[int]) -> list[tuple[int, httpx.Response]]:
    """Each document asked once through the stack, in order; every answer a 200."""
    answers = []
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        for doc in docs:
            response = client.post(CHAT, json=chat(document(doc)))
            if response.status_code != 200:
                raise AssertionError(
                    (doc, response.status_code, response.text[:200], fleet_state(stack))
                )
            answers.append((doc, response))
    return answers


# What the control plane logs about the published set.
_FLEET_EVENTS = ("fleet_published", "host.ejected", "host.admitted", "health.every_host_failed")


def fleet_state(stack: LocalStack) -> dict[str, Any]:
    """Envoy's and the control plane's view of the fleet, for a failure's message: what
    Envoy has in its backend cluster, and the control plane's last events about it."""
    state: dict[str, Any] = {}
    try:
        state["envoy_hosts"] = sorted(stack.envoy_hosts())
        counters = envoy_counters(stack.admin_url, "cluster.vllm.")
        state["envoy_cluster"] = {
            name: counters.get(name)
            for name in ("membership_total", "membership_healthy", "update_empty",
                         "upstream_cx_none_healthy", "upstream_rq_retry")
        }  # fmt: skip
    except httpx.HTTPError as error:
        state["envoy"] = repr(error)
    log = stack.control_plane.log_path if stack.control_plane is not None else None
    lines = log.read_text(errors="replace").splitlines() if log and log.exists() else []
    state["control_plane"] = [
        line[:300] for line in lines if any(e in line for e in _FLEET_EVENTS)
    ][-8:]
    return state


def wait_for_fleet(stack: LocalStack, expected: set[str], timeout: float = 15) -> None:
    """Until Envoy's cluster and every router replica hold exactly ``expected``."""
    wait_until(lambda: stack.envoy_hosts() == expected, timeout, f"envoy hosts {expected}")
    for replica in range(len(stack.routers)):
        wait_until(
            lambda r=replica: stack.router_metric("prefix_router_hosts", r) == len(expected),
            timeout,
            f"router {replica} to know {len(expected)} hosts",
        )


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
