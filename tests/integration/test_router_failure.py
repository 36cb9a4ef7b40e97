"""With the router down: override-host fails open, original-dst fails closed with a 503."""

from __future__ import annotations

import httpx

from extproc.stack import prometheus
from extproc.stack.bootstrap import ROUTER_CLUSTER
from extproc.stack.envoy_admin import envoy_counters
from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until

from .conftest import fleet


def test_router_down_then_back(stack: LocalStack, client):
    body = {
        "model": "sim-model",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x" * 5000}],
    }
    before = client.post("/v1/chat/completions", json=body)
    assert before.status_code == 200
    home = before.headers["x-served-by"]

    stack.router.kill()
    try:
        responses = [client.post("/v1/chat/completions", json=body) for _ in range(6)]
        if stack.spec.mode == "override-host":
            assert [r.status_code for r in responses] == [200] * 6
            assert {r.headers["x-served-by"] for r in responses} <= fleet(stack)
        else:
            assert [r.status_code for r in responses] == [503] * 6
            assert all("x-served-by" not in r.headers for r in responses)
    finally:
        stack.start_router()

    # Affinity is back once the router is: Envoy reconnects on the next request, and the
    # new router decides every request.
    # Back in the path is what a probe shows: Envoy's health check readmits the router
    # within its interval (1 s), and its gauges said healthy while its worker still
    # answered "no healthy upstream" (a run here failed all three requests open).
    probe = {**body, "messages": [{"role": "user", "content": "probe"}]}
    wait_until(
        lambda: decided(stack, client.post("/v1/chat/completions", json=probe)),
        10,
        what="the restarted router to decide a request",
    )
    probes = decisions_made(stack)
    after = []
    for _ in range(3):
        after.append(client.post("/v1/chat/completions", json=body))
        # With STREAMED bodies, decisions made before Envoy's access log has reconnected
        # count as load until their host's next scrape (0.25 s): let them, at threshold 2.
        wait_until(lambda: idle(stack), 5, what="the router to count nothing in flight")
    assert all(r.status_code == 200 for r in after), router_state(stack)
    # The new router reads every engine's KV events, replayed from before it started: the
    # prompt is cached on its old home and wherever the failed-open requests went, and it
    # goes to one of those, the less loaded of equal holders (with STREAMED bodies a
    # decision counts as load until the next scrape, so equal holders may alternate).
    holders = {home} | (
        {r.headers["x-served-by"] for r in responses}
        if stack.spec.mode == "override-host"
        else set()
    )
    assert {r.headers["x-served-by"] for r in after} <= holders, router_state(stack)
    assert after[0].headers["x-served-by"] in fleet(stack)
    assert decisions_made(stack) == probes + 3, router_state(stack)
    assert home in fleet(stack)


def idle(stack: LocalStack) -> bool:
    """Whether the router counts no request as load: none in flight, none unseen."""
    samples = prometheus.scrape(stack.router_metrics_url)
    in_flight = prometheus.by_host(samples, "prefix_router_in_flight_requests")
    unseen = samples.get(("prefix_router_unseen_decisions", ()))
    return unseen == 0 and all(value == 0 for value in in_flight.values())


def decided(stack: LocalStack, response: httpx.Response) -> bool:
    """Whether the router has decided any request yet (``response`` is the latest)."""
    return decisions_made(stack) > 0


def decisions_made(stack: LocalStack) -> float:
    samples = prometheus.scrape(stack.router_metrics_url)
    return prometheus.total(samples, "prefix_router_decisions_total")


def router_state(stack: LocalStack) -> str:
    """For a failure's message: the router's decision, load and completion samples,
    Envoy's ext_proc and router-cluster counters and gauges that are not zero, and the
    tails of both logs."""
    wanted = (
        "prefix_router_decisions_total{",
        "prefix_router_in_flight_requests{",
        "prefix_router_unseen_decisions",
        "prefix_router_access_log_streams",
        "prefix_router_completions_total",
        "prefix_router_load_feed_age_seconds",
    )
    router = httpx.get(stack.router_metrics_url).text.splitlines()
    envoy = {
        prefix + name: value
        for prefix in ("http.ingress.ext_proc.", f"cluster.{ROUTER_CLUSTER}.")
        for name, value in envoy_counters(stack.admin_url, prefix).items()
    }
    return "\n".join(
        [line for line in router if line.startswith(wanted)]
        + [f"{name}: {value:.0f}" for name, value in envoy.items() if value]
        + stack.router_log_path(0).read_text().splitlines()[-10:]
        + (stack.work_dir / "envoy.log").read_text().splitlines()[-10:]
    )
