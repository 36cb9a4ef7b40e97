"""With the router down: override-host fails open, original-dst fails closed with a 503."""

from __future__ import annotations

import httpx

from extproc.stack.local import LocalStack

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

    # Affinity is back once the router is: Envoy reconnects on the next request.
    after = [client.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert [r.headers.get("x-served-by") for r in after] == [home] * 3
    assert "prefix_router_decisions_total" in httpx.get(stack.router_metrics_url).text
