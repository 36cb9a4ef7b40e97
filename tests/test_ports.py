"""Every default port, each router worker's included, is its own."""

from __future__ import annotations

import itertools

import pytest

from extproc import ports
from extproc.adapter.workers import worker_overrides
from extproc.cli import parse_args
from extproc.cli.epp import overrides_of
from extproc.cli.up import stack_spec
from extproc.config import RouterConfig, load_config
from extproc.control.config import ControlPlaneConfig
from extproc.stack.local import LocalStack


@pytest.mark.parametrize("workers", [1, 2, 16, ports.MAX_WORKERS])
def test_no_two_defaults_share_a_port_at_any_worker_count(workers):
    for a, b in itertools.combinations(ports.DEFAULTS, 2):
        overlap = set(a.span(workers)) & set(b.span(workers))
        assert not overlap, f"{a.name} and {b.name} share {sorted(overlap)} at {workers} workers"


def test_defaults_stay_below_the_ephemeral_range():
    # A client's own port (32768 and up) must never be a default some server binds: the
    # router's gRPC port was 50051, and a client's connection once held worker 1's 50052.
    for default in ports.DEFAULTS:
        assert default.span(ports.MAX_WORKERS)[-1] < 32768, default.name
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


def test_the_pickers_workers_share_its_grpc_and_health_ports_and_each_has_its_metrics():
    # A gateway knows one address for its picker: only the metrics port moves by worker,
    # and its span (9090 + 63) stays clear of the router's metrics (9190).
    table = {p.name: p for p in ports.DEFAULTS}
    assert not table["endpoint picker gRPC"].per_worker
    assert not table["endpoint picker health"].per_worker
    assert table["endpoint picker metrics"].per_worker
    assert table["router metrics"].port > ports.EPP_METRICS + ports.MAX_WORKERS - 1
    workers = ports.MAX_WORKERS
    args = parse_args(["epp", "--bind-address", ports.LOOPBACK, "--workers", str(workers)])
    overrides = overrides_of(args, None)
    config = load_config(None, env={}, overrides=overrides)
    assert config.workers == workers and config.workers_share_listen
    taken = set()
    for index in range(workers):
        worker = load_config(None, env={}, overrides=worker_overrides(config, overrides, index))
        assert worker.listen == ports.loopback(ports.EPP_GRPC)
        assert worker.health_listen == ports.loopback(ports.EPP_HEALTH)
        taken.add(worker.metrics_listen)
    assert taken == {ports.loopback(ports.EPP_METRICS + i) for i in range(workers)}
