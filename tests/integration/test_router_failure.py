"""With the router down: override-host fails open, original-dst fails closed with a 503."""

from __future__ import annotations

import time

import httpx

from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until

from .conftest import fleet
from .test_routing_through_envoy import envoy_stat


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
    # new router decides every request. It starts with an empty index, and the requests
    # that failed open have shifted the hosts' cache pressure, so the prompt's new home
    # need not be the old one; it is one host, every time.
    wait_until(
        lambda: envoy_stat(stack, "cluster.prefix_router.membership_healthy") == 1,
        10,
        "Envoy's health check to readmit the router",
    )
    after = []
    for _ in range(3):
        after.append(client.post("/v1/chat/completions", json=body))
        # With STREAMED bodies, decisions made before Envoy's access log has reconnected
        # count as load until their host's next scrape (0.25 s): let them, at threshold 2.
        time.sleep(0.3)
    assert all(r.status_code == 200 for r in after)
    assert len({r.headers["x-served-by"] for r in after}) == 1
    assert after[0].headers["x-served-by"] in fleet(stack)
    assert decisions_made(stack) == 3
    assert home in fleet(stack)


def decisions_made(stack: LocalStack) -> float:
    total = 0.0
    for line in httpx.get(stack.router_metrics_url).text.splitlines():
        if line.startswith("prefix_router_decisions_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
