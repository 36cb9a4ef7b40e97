"""The shipped bootstraps match the generator and load into the real Envoy binary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from extproc.stack.bootstrap import (
    BODY_MODES,
    COMPLETIONS_CLUSTER,
    MODES,
    BootstrapParams,
    build_bootstrap,
    render,
)
from extproc.stack.local import envoy_binary

ENVOY_DIR = Path(__file__).resolve().parents[2] / "envoy"


def validate_in_envoy(path: Path) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


@pytest.mark.parametrize("mode", MODES)
def test_shipped_file_is_the_generators_output(mode):
    shipped = (ENVOY_DIR / f"{mode}.yaml").read_text()
    assert shipped == render(BootstrapParams(mode=mode)), (
        f"envoy/{mode}.yaml is stale: prefix-router envoy-config --mode {mode} > envoy/{mode}.yaml"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("upstream_host_header", [True, False])
@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_bootstrap_validates_in_envoy(tmp_path, mode, upstream_host_header, body_mode):
    path = tmp_path / "bootstrap.yaml"
    path.write_text(
        render(
            BootstrapParams(
                mode=mode, upstream_host_header=upstream_host_header, body_mode=body_mode
            )
        )
    )
    validate_in_envoy(path)
    assert ("x-upstream-host" in path.read_text()) is upstream_host_header
    assert ("x-router-target" in path.read_text()) is upstream_host_header


def test_original_dst_strips_client_routing_headers_before_ext_proc():
    text = render(BootstrapParams(mode="original-dst"))
    strip = text.index("envoy.filters.http.header_mutation")
    ext_proc = text.index("envoy.filters.http.ext_proc")
    assert strip < ext_proc
    assert "remove: x-target-host" in text
    assert "failure_mode_allow: false" in text


def test_streamed_bodies_log_completions_to_each_router_process():
    routers = (("127.0.0.1", 50051), ("127.0.0.1", 50052))
    bootstrap = build_bootstrap(BootstrapParams(body_mode="streamed", routers=routers))
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [
        f for f in manager["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")
    ]
    assert ext_proc["typed_config"]["processing_mode"]["request_body_mode"] == "STREAMED"
    assert ext_proc["typed_config"]["send_body_without_waiting_for_header_response"] is True
    logs = manager["typed_config"]["access_log"]
    targets = [log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"] for log in logs]
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    endpoints = [
        clusters[t["cluster_name"]]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        for t in targets
    ]
    addresses = [
        (e[0]["endpoint"]["address"]["socket_address"]["address"],
         e[0]["endpoint"]["address"]["socket_address"]["port_value"])
        for e in endpoints
    ]  # fmt: skip
    # One log, to one router each: every router sees its own requests complete.
    assert addresses == list(routers)
    # Each entry at once: a batch would count finished requests in flight for a flush.
    assert all(log["typed_config"]["common_config"]["buffer_size_bytes"] == 0 for log in logs)
    # BUFFERED_PARTIAL streams last as long as their requests: no log needed, unless the
    # routers end them at the decision (stream_end: decision), where it is asked for.
    buffered = build_bootstrap(BootstrapParams(routers=routers))
    manager = buffered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert "access_log" not in manager["typed_config"]
    assert not any(c["name"].startswith(COMPLETIONS_CLUSTER) for c in _clusters(buffered))
    logged = build_bootstrap(BootstrapParams(routers=routers, completion_log=True))
    manager = logged["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert len(manager["typed_config"]["access_log"]) == len(routers)
    assert [c["name"] for c in _clusters(logged) if c["name"].startswith(COMPLETIONS_CLUSTER)] == [
        f"{COMPLETIONS_CLUSTER}_0",
        f"{COMPLETIONS_CLUSTER}_1",
    ]
    # Without ext_proc there is no router to tell.
    bare = build_bootstrap(BootstrapParams(routers=routers, completion_log=True, ext_proc=False))
    manager = bare["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert "access_log" not in manager["typed_config"]


def _clusters(bootstrap: dict) -> list[dict]:
    return bootstrap["static_resources"]["clusters"]


def test_routers_on_unix_sockets_and_forwarded_headers_validate_in_envoy(tmp_path):
    from extproc.picker.keys import READ_HEADERS

    params = BootstrapParams(
        body_mode="streamed", routers=("/run/r.sock", ("127.0.0.1", 50052)),
        forward_headers=READ_HEADERS,
    )  # fmt: skip
    bootstrap = build_bootstrap(params)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    (group,) = clusters["prefix_router"]["load_assignment"]["endpoints"]
    assert group["lb_endpoints"][0]["endpoint"]["address"] == {"pipe": {"path": "/run/r.sock"}}
    (log_group,) = clusters["prefix_router_completions_0"]["load_assignment"]["endpoints"]
    assert log_group["lb_endpoints"][0]["endpoint"]["address"] == {"pipe": {"path": "/run/r.sock"}}
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [
        f for f in manager["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")
    ]
    patterns = ext_proc["typed_config"]["forward_rules"]["allowed_headers"]["patterns"]
    assert [p["exact"] for p in patterns] == list(READ_HEADERS)
    # The shipped default forwards every header: the lever did not pay (overhead.md).
    assert "forward_rules" not in render(BootstrapParams())
    path = tmp_path / "bootstrap.yaml"
    path.write_text(render(params))
    validate_in_envoy(path)


def test_a_trusted_salt_header_is_stripped_from_the_client_before_ext_proc(tmp_path):
    text = render(BootstrapParams(trusted_salt_header="x-tenant-id"))
    strip, ext_proc = text.index("remove: x-tenant-id"), text.index("envoy.filters.http.ext_proc")
    assert text.index("envoy.filters.http.header_mutation") < strip < ext_proc
    assert "x-tenant-id" not in render(BootstrapParams())
    path = tmp_path / "bootstrap.yaml"
    path.write_text(text)
    validate_in_envoy(path)


@pytest.mark.parametrize("mode", MODES)
def test_every_cluster_that_carries_requests_has_breakers_sized_for_llm_streams(mode):
    params = BootstrapParams(mode=mode, body_mode="streamed", max_concurrent=5000)
    clusters = {c["name"]: c for c in build_bootstrap(params)["static_resources"]["clusters"]}
    carrying = [n for n in clusters if n == "vllm" or n.startswith("prefix_router")]
    assert "vllm" in carrying and "prefix_router" in carrying and len(carrying) >= 3
    for name in carrying:
        (limits,) = clusters[name]["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] == limits["max_pending_requests"] == 5000, name
        assert limits["max_connections"] == 5000 and limits["max_retries"] == 312, name
    # The mesh snippets carry the shipped defaults.
    mesh = ENVOY_DIR.parent / "docs" / "mesh"
    for snippet in (
        "cluster-router.yaml",
        "cluster-override-host.yaml",
        "cluster-original-dst.yaml",
    ):
        (cluster, *_) = yaml.safe_load((mesh / snippet).read_text())
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        assert limits["max_requests"] == BootstrapParams.max_concurrent, snippet
