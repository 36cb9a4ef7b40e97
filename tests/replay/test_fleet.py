"""The virtual fleet's timing: a request stays in flight for the engine model's time on an
idle instance, and with prefill stalls, another request's prefill on its instance delays
it by the time that prefill's steps take beyond a decode step."""

import pytest

from extproc.replay.fleet import FleetModel, VirtualFleet, service_s
from extproc.sim.engine import EngineConfig

ENGINE = EngineConfig()


def ended(fleet: VirtualFleet, now: float) -> list[object]:
    return list(fleet.finish_until(now))


@pytest.mark.parametrize("stalls", [False, True])
def test_a_request_alone_takes_its_idle_service_time(stalls):
    fleet = VirtualFleet(FleetModel(instances=2, prefill_stalls=stalls))
    host = fleet.addresses[0]
    took = service_s(ENGINE, 8000, 64)
    fleet.admit(host, 8000, 0, 64, 10.0, "a")
    assert ended(fleet, 10.0 + took - 1e-6) == [] and fleet.in_flight[host] == 1
    assert ended(fleet, 10.0 + took + 1e-6) == ["a"] and fleet.in_flight[host] == 0


def test_a_prefill_delays_the_others_on_its_instance_only():
    fleet = VirtualFleet(FleetModel(instances=2, prefill_stalls=True))
    first, other = fleet.addresses
    took = service_s(ENGINE, 100, 64)
    fleet.admit(first, 100, 0, 64, 0.0, "waits")
    fleet.admit(other, 100, 0, 64, 0.0, "elsewhere")
    fleet.admit(first, 8000, 0, 64, 0.5, "prefills 8k")  # one step of 8,000 tokens
    stall = ENGINE.step_seconds(8000) - ENGINE.step_seconds(1)
    assert ended(fleet, took + 1e-6) == ["elsewhere"]
    assert ended(fleet, took + stall - 1e-6) == []
    assert ended(fleet, took + stall + 1e-6) == ["waits"]
    # Its own prefill is its own service time, not a stall on itself.
    own = service_s(ENGINE, 8000, 64)
    assert ended(fleet, 0.5 + own + 1e-6) == ["prefills 8k"]


def test_without_stalls_nothing_waits_for_anyone():
    fleet = VirtualFleet(FleetModel(instances=1))
    (host,) = fleet.addresses
    fleet.admit(host, 100, 0, 64, 0.0, "a")
    fleet.admit(host, 8000, 0, 64, 0.5, "b")
    assert ended(fleet, service_s(ENGINE, 100, 64) + 1e-6) == ["a"]
