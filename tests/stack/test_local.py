"""The local stack's process starters: a start that never gets ready leaves nothing behind."""

from __future__ import annotations

import pytest

from extproc.stack import local
from extproc.stack.processes import ManagedProcess, StackError, free_ports


@pytest.fixture
def started(monkeypatch):
    """Every ManagedProcess started in the test, with readiness given one second."""
    processes: list[ManagedProcess] = []
    start = ManagedProcess.start

    def recording(self: ManagedProcess) -> ManagedProcess:
        processes.append(self)
        return start(self)

    monkeypatch.setattr(ManagedProcess, "start", recording)
    monkeypatch.setattr(local, "READY_TIMEOUT_S", 1.0)
    yield processes
    for process in processes:
        process.stop()


def test_a_router_that_never_knows_a_fleet_is_stopped_before_the_error(started, tmp_path):
    # A control plane nobody serves: the router runs, but never learns a fleet.
    grpc, metrics, nowhere = free_ports(3)
    with pytest.raises(StackError, match="router worker 0"):
        local.start_router(
            "router", tmp_path, ("127.0.0.1", grpc), ("127.0.0.1", metrics), ("127.0.0.1", nowhere)
        )
    assert len(started) == 1
    assert not started[0].running  # its caller never got it to stop


def test_a_stack_runs_fewer_router_workers_than_envoy_knows(tmp_path):
    spec = local.StackSpec.ephemeral(0, router_workers=4, work_dir=tmp_path)
    stack = local.LocalStack(spec)
    # Envoy's router cluster lists all four; the config and the readiness wait follow the
    # workers running now.
    assert len(stack.bootstrap_params().routers) == 4
    stack.use_router_workers(2)
    stack.write_router_config()
    assert "workers: 2" in stack.router_config_path().read_text()
    assert list(stack._endpoints_of(0)) == [0, 1]
    assert stack.live_router_endpoints() == []  # nothing started
    for wrong in (0, 5):
        with pytest.raises(StackError, match=f"got {wrong}"):
            stack.use_router_workers(wrong)
