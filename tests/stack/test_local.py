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
