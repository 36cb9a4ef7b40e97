"""trusted_salt_header through the real Envoy: the client's own copy never reaches the
router, and neither do the salts a client may set, so a client cannot move placement."""

from __future__ import annotations

import httpx

from extproc.stack.local import LocalStack, StackSpec

from ..prompts import document
from ..reliability.stacks import NEVER_SHED

TRUSTED = "x-tenant-id"


def test_salts_a_client_sends_move_nothing_when_the_salt_is_trusted():
    spec = StackSpec.ephemeral(
        3,
        sim_args=("--ttft-ms", "0", "--itl-ms", "0"),
        router_settings={"trusted_salt_header": TRUSTED, **NEVER_SHED},
        envoy_settings={"trusted_salt_header": TRUSTED},
    )
    with LocalStack(spec) as stack, httpx.Client(base_url=stack.url, timeout=30) as client:
        served: dict[int, set[str]] = {}
        for doc in range(6):
            for tenant in ("a", "b", "c"):
                body = {
                    "model": "sim-model",
                    "max_tokens": 1,
                    "prompt_cache_key": f"body-{tenant}",
                    "messages": [{"role": "user", "content": f"{document(doc)} q{tenant}"}],
                }
                headers = {TRUSTED: f"tenant-{tenant}", "x-prefix-aware-id": f"id-{tenant}"}
                response = client.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                served.setdefault(doc, set()).add(response.headers["x-upstream-host"])
        metrics = httpx.get(stack.router_metrics_url).text
    # No salt reached the router: each document stayed on one host for every "tenant"
    # (three independent salts would split most of six documents).
    assert all(len(hosts) == 1 for hosts in served.values()), served
    assert "prefix_router_salt_rejected_total{" not in metrics
