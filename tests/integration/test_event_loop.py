"""event_loop, through the real Envoy: the same decisions on libuv's loop (the default)
and on asyncio's own."""

from __future__ import annotations

import httpx
import pytest

from extproc.stack import prometheus
from extproc.stack.local import LocalStack, StackSpec

from ..prompts import document


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_router_on_either_loop_routes_each_prefix_to_one_host(loop: str):
    settings = {"event_loop": loop} if loop != "uvloop" else {}  # uvloop: the default
    spec = StackSpec.ephemeral(
        3, sim_args=("--ttft-ms", "0", "--itl-ms", "0"), router_settings=settings
    )
    with LocalStack(spec) as stack, httpx.Client(base_url=stack.url, timeout=30) as client:
        served: dict[int, set[str]] = {}
        for question in range(3):
            for doc in range(4):
                body = {
                    "model": "sim-model",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": f"{document(doc)} q{question}"}],
                }
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                served.setdefault(doc, set()).add(response.headers["x-upstream-host"])
        assert all(len(hosts) == 1 for hosts in served.values()), served
        decided = prometheus.total(
            prometheus.scrape(stack.router_metrics_url), "prefix_router_decisions_total"
        )
        assert decided == 12
        log = stack.router_log_path(0).read_text()
    assert f'"event_loop": "{loop}"' in log
