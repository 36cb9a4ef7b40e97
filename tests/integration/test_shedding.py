"""Shedding through the real Envoy: a router that sheds (here always, shed_lag_s 0) decides
each request on its headers, ends the stream there, and Envoy delivers the body it never
sent the router byte for byte to the host the router chose, in every Envoy and body mode.
Each shed request is counted; none fails open."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec, envoy_counters

from .conftest import SIM_ARGS, VARIANTS

pytestmark = pytest.mark.envoy


@pytest.mark.parametrize(("mode", "body_mode"), VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_a_shedding_router_routes_on_headers_and_envoy_delivers_the_body(mode, body_mode):
    spec = StackSpec.ephemeral(
        3,
        mode=mode,
        body_mode=body_mode,
        sim_args=SIM_ARGS,
        router_settings={"shed_lag_s": 0, **INSTANT_PREFILL},
    )
    with LocalStack(spec) as stack, httpx.Client(base_url=stack.url, timeout=30) as client:
        fleet = set(stack.backend_addresses)
        before = stack.router_metric("prefix_router_shed_total") or 0.0
        sizes = [0, 1024, 64 * 1024, 1024 * 1024]
        for n, size in enumerate(sizes * 3):
            text = f"shed {n} ".encode() + b"a" * size
            body = b'{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":"'
            body += text + b'"}]}'
            response = client.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-served-by"] in fleet
            assert response.headers["x-upstream-host"] == response.headers["x-served-by"]
            assert response.headers["x-request-body-sha256"] == hashlib.sha256(body).hexdigest()
        shed = (stack.router_metric("prefix_router_shed_total") or 0.0) - before
        counters = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
    assert shed == len(sizes) * 3
    assert counters.get("failure_mode_allowed", 0) == 0
    assert counters.get("message_timeouts", 0) == 0
