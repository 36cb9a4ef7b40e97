import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from extproc.control.config import ControlPlaneConfig, load_control_plane_config
from extproc.control.fleet import Fleet, build_fleet
from extproc.control.model import HostHealth, HostLoad
from extproc.control.snapshot import FleetSnapshot, LoadSnapshot, PublishedHost, SnapshotStore
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port, wait_until_async

# Loopback addresses of their own keep these tests clear of other suites' ports.
SIM_A = "127.0.0.61"
SIM_B = "127.0.0.62"
DEAD = "127.0.0.63"
MODEL = "fleet-model"
# The run loop's tests: rounds every 0.1 s.
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 0.1, "healthy_threshold": 2}
# Tests that drive the rounds themselves: a simulator answering slowly on a loaded machine
# must not read as down (a 0.1 s timeout failed one in a full run).
ROUNDS_HEALTH = {"interval_s": 5.0, "timeout_s": 5.0, "healthy_threshold": 2}
FAST_FEED = {"interval_s": 0.1, "timeout_s": 0.1}

A = "127.0.0.1:8001"
B = "127.0.0.2:8002"
C = "127.0.0.3:8003"

UP = HostHealth(healthy=True, consecutive_successes=2, models=("m",))
DOWN = HostHealth(healthy=False, consecutive_failures=2, models=("m",))


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def reloads(result: str) -> float:
    return metric("prefix_router_config_reloads_total", {"result": result})


@contextlib.asynccontextmanager
async def simulators(*hosts: str, model: str = MODEL) -> AsyncIterator[list[str]]:
    addresses = [(host, free_port(host)) for host in hosts]
    ready = asyncio.Event()
    server = asyncio.create_task(serve(addresses, SimOptions(model=model), ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield [f"{host}:{port}" for host, port in addresses]
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


def write_config(path: Path, values: dict[str, Any]) -> None:
    """Atomic rewrite, as a config-management tool would do it."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(values))
    os.replace(temporary, path)


def published(store: SnapshotStore, cluster: str = "vllm") -> FleetSnapshot:
    snapshot = store.get(cluster)
    assert isinstance(snapshot, FleetSnapshot)
    return snapshot


def addresses_of(snapshot: FleetSnapshot) -> list[str]:
    return [h.address for h in snapshot.hosts]


async def health_rounds(fleet: Fleet, rounds: int = 2) -> None:
    states = fleet.health.states
    for _ in range(rounds):
        states = await fleet.health.check_once(await fleet.discover())
    fleet.publish_fleet(states)


# --- build_fleet ----------------------------------------------------------------------------


def test_build_fleet_only_includes_healthy_hosts() -> None:
    config = ControlPlaneConfig(hosts=(A, B, C))
    snapshot = build_fleet(config, {A: UP, B: DOWN, C: HostHealth()})
    assert addresses_of(snapshot) == [A]
    assert snapshot.name == "vllm"


def test_build_fleet_marks_draining_and_carries_models_and_zones() -> None:
    config = ControlPlaneConfig(
        cluster="pool",
        hosts=(A, B, C),
        draining=(B,),
        zones={A: "z1", B: "z2"},
    )
    states = {
        A: HostHealth(healthy=True, models=("base", "lora-1")),
        B: HostHealth(healthy=True, models=("base",)),
        C: HostHealth(healthy=True),
    }
    snapshot = build_fleet(config, states)
    assert snapshot.name == "pool"
    assert snapshot.hosts == (
        PublishedHost(A, False, ("base", "lora-1"), "z1"),
        PublishedHost(B, True, ("base",), "z2"),
        PublishedHost(C, False, (), ""),
    )
    assert [h.address for h in snapshot.serving] == [A, C]


def test_build_fleet_of_no_states_is_empty() -> None:
    assert build_fleet(ControlPlaneConfig(hosts=(A,)), {}).hosts == ()


def test_fleet_publishes_an_empty_fleet_at_once() -> None:
    store = SnapshotStore()
    Fleet(ControlPlaneConfig(hosts=(A,)), store)
    assert published(store).hosts == ()
    assert store.generation == 1


def test_publish_fleet_of_unchanged_states_is_a_noop() -> None:
    store = SnapshotStore()
    fleet = Fleet(ControlPlaneConfig(hosts=(A,)), store)
    first = fleet.publish_fleet({A: UP})
    generation = store.generation
    again = fleet.publish_fleet({A: UP})
    assert again.version == first.version
    assert store.generation == generation


def test_publish_loads_stamps_each_scrape_in_wall_time_and_skips_empty_rounds() -> None:
    store = SnapshotStore()
    fleet = Fleet(
        ControlPlaneConfig(hosts=(A,)), store, wall_clock=lambda: 1234.5, clock=lambda: 3.0
    )
    fleet.publish_loads({})
    assert store.get("vllm/load") is None
    # Scraped 2 s ago on the monotonic clock: 2 s before the wall time now.
    fleet.publish_loads({A: HostLoad(running=2, scraped_at=1.0)})
    loads = store.get("vllm/load")
    assert isinstance(loads, LoadSnapshot)
    assert loads.loads == ((A, HostLoad(running=2, scraped_at=1232.5)),)


# --- with simulators ------------------------------------------------------------------------


async def test_fleet_publishes_the_healthy_simulators() -> None:
    async with simulators(SIM_A, SIM_B) as (sim_a, sim_b):
        dead = f"{DEAD}:{free_port(DEAD)}"
        config = load_control_plane_config(
            None, {"hosts": [sim_a, sim_b, dead], "health": ROUNDS_HEALTH}
        )
        store = SnapshotStore()
        fleet = Fleet(config, store)
        await health_rounds(fleet, rounds=1)
        assert published(store).hosts == ()  # one success is not enough
        await health_rounds(fleet, rounds=1)
        snapshot = published(store)
        assert addresses_of(snapshot) == sorted([sim_a, sim_b])
        assert all(h.models == (MODEL,) for h in snapshot.hosts)
        assert not any(h.draining for h in snapshot.hosts)
        assert not fleet.health.states[dead].healthy


async def test_fleet_run_publishes_hosts_and_loads() -> None:
    async with simulators(SIM_A, SIM_B) as sims:
        config = load_control_plane_config(
            None, {"hosts": sims, "health": FAST_HEALTH, "load_feed": FAST_FEED}
        )
        store = SnapshotStore()
        fleet = Fleet(config, store, wall_clock=lambda: 42.0)
        stop = asyncio.Event()
        runner = asyncio.create_task(fleet.run(stop))
        try:
            await wait_until_async(
                lambda: (
                    addresses_of(published(store)) == sorted(sims)
                    and isinstance(loads := store.get("vllm/load"), LoadSnapshot)
                    and len(loads.loads) == len(sims)
                ),
                10,
                "both hosts and their loads published",
            )
        finally:
            stop.set()
            await asyncio.wait_for(runner, timeout=5)
        loads = store.get("vllm/load")
        assert isinstance(loads, LoadSnapshot)
        assert [address for address, _ in loads.loads] == sorted(sims)
        # Stamped in (the injected) wall time, at the scrapes' start: just before "now".
        assert all(0 <= 42.0 - load.scraped_at < 1.0 for _, load in loads.loads)


async def test_fleet_ejects_a_host_that_stops(tmp_path: Path) -> None:
    async with simulators(SIM_A) as (sim_a,):
        async with simulators(SIM_B) as (sim_b,):
            config = load_control_plane_config(None, {"hosts": [sim_a, sim_b]})
            store = SnapshotStore()
            fleet = Fleet(config, store)
            await health_rounds(fleet)
            assert addresses_of(published(store)) == sorted([sim_a, sim_b])
        await health_rounds(fleet)  # unhealthy_threshold is 2
        assert addresses_of(published(store)) == [sim_a]


# --- hot reload -----------------------------------------------------------------------------


@pytest.fixture
async def reloading(tmp_path: Path) -> AsyncIterator[tuple[Fleet, Path, list[str]]]:
    async with simulators(SIM_A, SIM_B) as sims:
        path = tmp_path / "control.yaml"
        write_config(path, {"hosts": sims, "health": ROUNDS_HEALTH})
        store = SnapshotStore()
        fleet = Fleet(load_control_plane_config(path), store, config_path=path)
        await health_rounds(fleet)
        assert addresses_of(published(store)) == sorted(sims)
        yield fleet, path, sims


async def test_reload_marks_a_host_draining_without_a_health_round(
    reloading: tuple[Fleet, Path, list[str]],
) -> None:
    fleet, path, (sim_a, sim_b) = reloading
    before = reloads("applied")
    write_config(
        path,
        {
            "hosts": [sim_a, sim_b],
            "draining": [sim_b],
            "zones": {sim_a: "za"},
            "health": ROUNDS_HEALTH,
        },
    )
    await fleet.discover()
    assert reloads("applied") == before + 1
    by_address = {h.address: h for h in published(fleet.store).hosts}
    assert by_address[sim_b].draining
    assert not by_address[sim_a].draining
    assert by_address[sim_a].zone == "za"
    # An unchanged file is not reloaded again.
    await fleet.discover()
    assert reloads("applied") == before + 1


async def test_reload_removes_a_host_after_the_next_health_round(
    reloading: tuple[Fleet, Path, list[str]],
) -> None:
    fleet, path, (sim_a, _) = reloading
    write_config(path, {"hosts": [sim_a], "health": ROUNDS_HEALTH})
    assert await fleet.discover() == frozenset({sim_a})
    await health_rounds(fleet, rounds=1)
    assert addresses_of(published(fleet.store)) == [sim_a]


async def test_reload_removes_a_host_at_once(reloading: tuple[Fleet, Path, list[str]]) -> None:
    fleet, path, (sim_a, _) = reloading
    write_config(path, {"hosts": [sim_a], "health": ROUNDS_HEALTH})
    await fleet.discover()
    assert addresses_of(published(fleet.store)) == [sim_a]


@pytest.mark.parametrize(
    "bad",
    [
        {"hosts": ["not-an-address"]},
        {"health": {"interval_s": -1}},
        {"surprise": True},
    ],
    ids=["host", "interval", "unknown"],
)
async def test_invalid_reload_is_rejected_and_the_old_config_stays(
    reloading: tuple[Fleet, Path, list[str]], bad: dict[str, Any]
) -> None:
    fleet, path, sims = reloading
    old_config = fleet.config
    old_snapshot = published(fleet.store)
    rejected, applied = reloads("rejected"), reloads("applied")
    write_config(path, bad)
    assert await fleet.discover() == frozenset(sims)
    assert reloads("rejected") == rejected + 1
    assert reloads("applied") == applied
    assert fleet.config is old_config
    assert published(fleet.store) is old_snapshot
    # A later valid edit is applied.
    write_config(path, {"hosts": sims, "draining": [sims[0]], "health": ROUNDS_HEALTH})
    await fleet.discover()
    assert reloads("applied") == applied + 1
    assert [h.address for h in published(fleet.store).hosts if h.draining] == [sims[0]]


async def test_an_unexpected_reload_error_keeps_the_old_config_and_the_watch(
    reloading: tuple[Fleet, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet, path, sims = reloading
    old_config, old_snapshot = fleet.config, published(fleet.store)
    failed, applied = reloads("failed"), reloads("applied")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug in discovery")

    # A fault injected where no real input reaches today: any bug in a reload.
    monkeypatch.setattr("extproc.control.fleet.sources_for", broken)
    write_config(path, {"hosts": sims, "draining": [sims[0]], "health": ROUNDS_HEALTH})
    assert await fleet.discover() == frozenset(sims)
    assert reloads("failed") == failed + 1 and reloads("applied") == applied
    assert fleet.config is old_config and published(fleet.store) is old_snapshot
    monkeypatch.undo()
    write_config(path, {"hosts": sims, "draining": [sims[1]], "health": ROUNDS_HEALTH})
    await fleet.discover()
    assert reloads("applied") == applied + 1
    assert [h.address for h in published(fleet.store).hosts if h.draining] == [sims[1]]


async def test_reload_keeps_restart_only_fields(
    reloading: tuple[Fleet, Path, list[str]],
) -> None:
    fleet, path, (sim_a, sim_b) = reloading
    old = fleet.config
    write_config(
        path,
        {
            "hosts": [sim_a, sim_b],
            "draining": [sim_a],
            "cluster": "renamed",
            "listen": "127.0.0.1:1",
            "health": {"interval_s": 5, "timeout_s": 1},
        },
    )
    await fleet.discover()
    assert fleet.config.cluster == old.cluster
    assert fleet.config.listen == old.listen
    assert fleet.config.health == old.health
    assert fleet.config.draining == (sim_a,)
    assert fleet.store.get("renamed") is None
    assert [h.address for h in published(fleet.store).hosts if h.draining] == [sim_a]


async def test_reload_with_a_bad_dns_entry_is_rejected(
    reloading: tuple[Fleet, Path, list[str]],
) -> None:
    fleet, path, sims = reloading
    old_config = fleet.config
    rejected = reloads("rejected")
    write_config(path, {"hosts": sims, "dns": ["vllm.internal:http"], "health": ROUNDS_HEALTH})
    assert await fleet.discover() == frozenset(sims)
    assert reloads("rejected") == rejected + 1
    assert fleet.config is old_config
