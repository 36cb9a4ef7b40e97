"""Envoy's pooled connections to the backends: Envoy closes an idle one before vLLM does.

vLLM closes a connection idle for 5 s. If Envoy kept it longer, a request sent just as vLLM
closed it would be reset, and Envoy's retry would take it to the next host of the router's
list, away from its cache. The real Envoy, simulators with vLLM's keep-alive, both ways
round, on a short scale."""

from __future__ import annotations

import time

import httpx
import pytest

from extproc.sim.options import VLLM_KEEPALIVE_S
from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.local import LocalStack, StackSpec, envoy_counters
from extproc.stack.processes import wait_until

BODY = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def test_the_generated_bootstraps_close_before_vllm():
    idle = BootstrapParams().backend_idle_timeout_s
    assert idle is not None and idle < VLLM_KEEPALIVE_S


def _closed_after_one_idle_request(envoy_idle_s: float | None, backend_keepalive_s: float):
    spec = StackSpec.ephemeral(
        1,
        sim_args=("--ttft-ms", "0", "--itl-ms", "0", "--keepalive-s", str(backend_keepalive_s)),
        control_plane=None,
        envoy_settings={"backend_idle_timeout_s": envoy_idle_s},
    )
    with LocalStack(spec) as stack, httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200

        def counts() -> dict[str, float]:
            return envoy_counters(stack.admin_url, "cluster.vllm.")

        wait_until(lambda: counts().get("upstream_cx_active", 1) == 0, 10, "the connection closed")
        return counts()


@pytest.mark.parametrize(
    ("envoy_idle_s", "backend_keepalive_s", "closed_by"),
    [(0.5, VLLM_KEEPALIVE_S, "envoy"), (None, 0.5, "backend")],
    ids=["envoy-first", "backend-first"],
)
def test_who_closes_an_idle_backend_connection(envoy_idle_s, backend_keepalive_s, closed_by):
    started = time.monotonic()
    counts = _closed_after_one_idle_request(envoy_idle_s, backend_keepalive_s)
    assert time.monotonic() - started < 10
    if closed_by == "envoy":
        assert counts.get("upstream_cx_idle_timeout", 0) == 1
        assert counts.get("upstream_cx_destroy_remote", 0) == 0
    else:
        # Envoy's default (an hour) leaves it to the backend: the race the bootstraps avoid.
        assert counts.get("upstream_cx_idle_timeout", 0) == 0
        assert counts.get("upstream_cx_destroy_remote", 0) == 1
