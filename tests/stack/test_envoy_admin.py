"""The harness's reader of Envoy's admin interface (extproc/stack/envoy_admin.py) against
the real Envoy binary: its JSON pages give what it is configured with, and the same as its
text pages (which the harness read before)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.envoy_admin import envoy_counters, envoy_hosts, healthy_hosts
from extproc.stack.local import INSTANT_PREFILL, LocalStack, StackSpec, start_envoy
from extproc.stack.processes import free_ports, wait_until

pytestmark = pytest.mark.envoy

BACKEND_HOSTS = ("127.0.0.11", "127.0.0.12")


# The text page on purpose, not envoy_admin's JSON: it is what the JSON reader is checked against.
def text_hosts(admin_url: str, cluster: str, healthy: bool = False) -> set[str]:
    """Envoy's text /clusters page read line by line: the hosts of ``cluster`` (each has a
    cx_active line), or those whose health flags read "healthy"."""
    response = httpx.get(f"{admin_url}/clusters", timeout=2).raise_for_status()
    lines = response.text.splitlines()
    fields = [line.split("::") for line in lines if line.startswith(f"{cluster}::")]
    if healthy:
        return {f[1] for f in fields if f[2:] == ["health_flags", "healthy"]}
    return {f[1] for f in fields if f[2] == "cx_active"}


@pytest.fixture(scope="module")
def lone_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, BootstrapParams]]:
    """Envoy alone: a static backend cluster of two hosts (nothing listens: Envoy does not
    health-check them) and one router endpoint nothing serves (its health checks fail)."""
    listen, admin, router, *backend_ports = free_ports(2 + 1 + len(BACKEND_HOSTS))
    params = BootstrapParams(
        listen=("127.0.0.1", listen),
        admin=("127.0.0.1", admin),
        routers=(("127.0.0.1", router),),
        control_plane=None,
        backends=tuple(zip(BACKEND_HOSTS, backend_ports, strict=True)),
    )
    work_dir: Path = tmp_path_factory.mktemp("envoy-admin")
    envoy = start_envoy("envoy", params, work_dir)
    try:
        yield f"http://127.0.0.1:{admin}", params
    finally:
        envoy.stop()


def test_hosts_are_the_configured_ones_and_a_failing_router_is_not_healthy(lone_envoy):
    admin_url, params = lone_envoy
    backends = {f"{host}:{port}" for host, port in params.backends}
    (router,) = {f"{host}:{port}" for host, port in params.routers}
    wait_until(
        lambda: (
            envoy_counters(admin_url, "cluster.prefix_router.health_check.").get("failure", 0) >= 1
        ),
        10,
        "Envoy's health check of the router to fail",
    )
    assert envoy_hosts(admin_url, "vllm") == backends == text_hosts(admin_url, "vllm")
    assert healthy_hosts(admin_url, "vllm") == backends
    assert healthy_hosts(admin_url, "vllm") == text_hosts(admin_url, "vllm", healthy=True)
    assert envoy_hosts(admin_url, "prefix_router") == {router}
    assert healthy_hosts(admin_url, "prefix_router") == set()
    assert text_hosts(admin_url, "prefix_router", healthy=True) == set()
    assert envoy_hosts(admin_url, "no_such_cluster") == set()


def test_counters_and_gauges_under_a_prefix_by_the_rest_of_their_names(lone_envoy):
    admin_url, params = lone_envoy
    vllm = envoy_counters(admin_url, "cluster.vllm.")
    assert vllm["membership_total"] == len(params.backends)  # a gauge
    assert vllm["membership_healthy"] == len(params.backends)
    assert vllm["upstream_rq_total"] == 0  # a counter; zero is a value too
    assert all(isinstance(value, float) for value in vllm.values())
    # Only names under the prefix, and the prefix is literal (its dots match only dots).
    assert not any(name.startswith("cluster.") for name in vllm)
    assert envoy_counters(admin_url, "cluster.vllm.membership_total") == {"": 2.0}
    assert envoy_counters(admin_url, "cluster_vllm.") == {}
    # The server's stats include histograms (in the JSON, an entry of their own): skipped.
    server = envoy_counters(admin_url, "server.")
    assert server["live"] == 1
    assert not any(name.startswith("initialization_time") for name in server)


def test_a_stack_routes_to_its_healthy_router_replicas_and_its_fleet():
    spec = StackSpec.ephemeral(2, router_replicas=2, router_settings=dict(INSTANT_PREFILL))
    with LocalStack(spec) as stack:
        routers = {f"{host}:{port}" for (host, port), _ in stack.router_addresses}
        wait_until(lambda: stack.healthy_routers() == routers, 30, "both routers healthy")
        assert text_hosts(stack.admin_url, "prefix_router", healthy=True) == routers
        assert stack.envoy_hosts() == set(stack.backend_addresses)
        assert stack.envoy_hosts() == text_hosts(stack.admin_url, "vllm")
        assert stack.envoy_hosts(admin_url=stack.admin_url) == stack.envoy_hosts()
        router = envoy_counters(stack.admin_url, "cluster.prefix_router.")
        assert router["membership_healthy"] == len(routers)
