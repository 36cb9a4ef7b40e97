"""One failure policy: when the router cannot decide, its ext_proc stream ends with a gRPC
error and Envoy's failure mode decides. override-host places the request by its fallback
(Envoy counts it as failure_mode_allowed); original-dst answers 503."""

from __future__ import annotations

import httpx
import pytest
import yaml

from extproc.stack.local import LocalStack, StackSpec, envoy_counters
from extproc.stack.processes import wait_until

BODY = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_a_router_with_no_hosts_leaves_the_request_to_envoys_failure_mode(mode: str):
    # A static fleet: the router's host set comes from its config file, Envoy's from its
    # bootstrap, so the router can lose its hosts while Envoy keeps them.
    spec = StackSpec.ephemeral(3, sim_args=("--ttft-ms", "0", "--itl-ms", "0"), mode=mode,
                               control_plane=None)  # fmt: skip
    with LocalStack(spec) as stack, httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
        path = stack.router_config_path()
        config = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**config, "hosts": []}))
        wait_until(lambda: stack.router_metric("prefix_router_hosts") == 0, 10, "no hosts")
        responses = [client.post("/v1/chat/completions", json=BODY) for _ in range(3)]
        counts = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
        metrics = httpx.get(stack.router_metrics_url).text
    assert 'prefix_router_fallbacks_total{reason="no_hosts"} 3.0' in metrics
    assert counts["streams_failed"] >= 3
    if mode == "override-host":
        # Envoy's fallback placed them: served by the fleet, and counted as failed open.
        assert [r.status_code for r in responses] == [200] * 3
        assert {r.headers["x-served-by"] for r in responses} <= set(stack.backend_addresses)
        assert counts["failure_mode_allowed"] >= 3
    else:
        # No safe fallback: a clear 503, and no backend saw them.
        assert [r.status_code for r in responses] == [503] * 3
        assert all("x-served-by" not in r.headers for r in responses)
        assert counts.get("failure_mode_allowed", 0) == 0
