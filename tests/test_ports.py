"""Every default port, each router worker's included, is its own."""

from __future__ import annotations

import itertools

import pytest

from extproc import ports
from extproc.cli import parse_args
from extproc.cli.up import stack_spec
from extproc.config import RouterConfig
from extproc.control.config import ControlPlaneConfig
from extproc.stack.local import LocalStack


@pytest.mark.parametrize("workers", [1, 2, 16, ports.MAX_WORKERS])
def test_no_two_defaults_share_a_port_at_any_worker_count(workers):
    for a, b in itertools.combinations(ports.DEFAULTS, 2):
        overlap = set(a.span(workers)) & set(b.span(workers))
        assert not overlap, f"{a.name} and {b.name} share {sorted(overlap)} at {workers} workers"


def test_defaults_stay_below_the_ephemeral_range():
    # A client's own port (32768 and up) must never be a default some server binds; the
    # router's gRPC port keeps gRPC's usual 50051.
    ours = [p for p in ports.DEFAULTS if p.port != ports.ROUTER_GRPC]
    assert all(p.span(ports.MAX_WORKERS)[-1] < 32768 for p in ours)
    assert ports.KV_EVENTS < 32768 and ports.KV_EVENTS_REPLAY < 32768


def test_every_process_takes_its_defaults_from_the_table():
    router = RouterConfig()
    control = ControlPlaneConfig()
    assert router.listen == ports.loopback(ports.ROUTER_GRPC)
    assert router.metrics_listen == ports.loopback(ports.ROUTER_METRICS)
    assert control.listen == ports.loopback(ports.CONTROL_PLANE_XDS)
    assert control.metrics_listen == ports.loopback(ports.CONTROL_PLANE_METRICS)


def test_up_with_workers_puts_every_worker_on_a_port_of_its_own():
    stack = LocalStack(stack_spec(parse_args(["up", "--workers", "4"])))
    try:
        taken = [port for grpc, metrics in stack.router_addresses for port in (grpc[1], metrics[1])]
        spec = stack.spec
        taken += [spec.listen[1], spec.admin[1]]
        assert spec.control_plane is not None
        taken += [spec.control_plane[1], spec.control_plane_metrics[1]]
        assert len(taken) == len(set(taken)), taken
    finally:
        stack.stop()
