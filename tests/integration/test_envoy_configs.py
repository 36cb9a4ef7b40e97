"""The shipped bootstraps match the generator and load into the real Envoy binary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc.stack.bootstrap import BODY_MODES, MODES, BootstrapParams, build_bootstrap, render
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
    # BUFFERED_PARTIAL streams last as long as their requests: no log needed.
    buffered = build_bootstrap(BootstrapParams(routers=routers))
    manager = buffered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert "access_log" not in manager["typed_config"]


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
