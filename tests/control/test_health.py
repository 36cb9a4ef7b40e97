import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from extproc.control.health import (
    HealthChecker,
    HealthPolicy,
    ProbeResult,
    hold_when_every_host_fails,
    models_from_listing,
    next_health,
    probe,
)
from extproc.control.model import HostHealth
from extproc.http_client import host_client
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port, wait_until_async

# Loopback addresses of their own keep these tests clear of other suites' ports.
SIM_HOST = "127.0.0.31"
DEAD_HOST = "127.0.0.32"
OTHER_SIM_HOST = "127.0.0.33"
MODEL = "llama-test"
# Generous for loopback, yet well under a test's patience.
FAST = HealthPolicy(interval_s=0.2, timeout_s=0.2)

OK = ProbeResult(True, models=("m",))
FAIL = ProbeResult(False, error="refused")


@contextlib.asynccontextmanager
async def simulator(host: str, port: int, model: str = MODEL) -> AsyncIterator[str]:
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], SimOptions(model=model), ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield f"{host}:{port}"
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


def respond_with(status: int) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(status=status)

    return handler


@contextlib.asynccontextmanager
async def app_server(app: web.Application, host: str) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port(host)
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"{host}:{port}"
    finally:
        await runner.cleanup()


# --- policy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"interval_s": 0}, "interval_s"),
        ({"interval_s": float("inf")}, "interval_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"interval_s": 1.0, "timeout_s": 2.0}, "timeout_s"),
        ({"unhealthy_threshold": 0}, "unhealthy_threshold"),
        ({"healthy_threshold": 1.5}, "healthy_threshold"),
        ({"healthy_threshold": True}, "healthy_threshold"),
    ],
)
def test_policy_rejects_out_of_range_values(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=.*allowed"):
        HealthPolicy(**overrides)


# --- transitions ----------------------------------------------------------------------


def test_new_host_is_admitted_only_after_healthy_threshold_successes() -> None:
    policy = HealthPolicy(healthy_threshold=3)
    state = HostHealth()
    for _ in range(2):
        state = next_health(state, OK, policy)
        assert not state.healthy
    state = next_health(state, OK, policy)
    assert state.healthy
    assert state.consecutive_successes == 3
    assert state.models == ("m",)


def test_healthy_host_is_ejected_after_unhealthy_threshold_failures() -> None:
    policy = HealthPolicy(unhealthy_threshold=2)
    state = HostHealth(healthy=True, consecutive_successes=5, models=("m",))
    state = next_health(state, FAIL, policy)
    assert state.healthy
    assert state.consecutive_failures == 1
    assert state.consecutive_successes == 0
    state = next_health(state, FAIL, policy)
    assert not state.healthy
    # Models are kept across failures; the error is recorded.
    assert state.models == ("m",)
    assert state.last_error == "refused"


def test_a_success_resets_failures_and_clears_the_error() -> None:
    policy = HealthPolicy(unhealthy_threshold=2)
    state = next_health(HostHealth(healthy=True), FAIL, policy)
    state = next_health(state, ProbeResult(True, models=("a", "b")), policy)
    assert state == HostHealth(
        healthy=True, consecutive_successes=1, models=("a", "b"), last_error=None
    )
    # One failure after the reset is not enough to eject.
    assert next_health(state, FAIL, policy).healthy


def test_a_failed_model_listing_keeps_the_last_known_models() -> None:
    policy = HealthPolicy()
    state = HostHealth(healthy=True, consecutive_successes=3, models=("m",))
    state = next_health(state, ProbeResult(True, models=None), policy)
    assert state.healthy
    assert state.models == ("m",)
    # A host never listed stays without models until a listing answers.
    assert next_health(HostHealth(), ProbeResult(True, models=None), policy).models == ()


def test_a_failure_resets_successes_of_an_unhealthy_host() -> None:
    policy = HealthPolicy(healthy_threshold=2)
    state = next_health(HostHealth(), OK, policy)
    state = next_health(state, FAIL, policy)
    state = next_health(state, OK, policy)
    assert not state.healthy
    assert state.consecutive_successes == 1


@given(
    history=st.lists(st.booleans(), max_size=30),
    run_length=st.integers(min_value=0, max_value=5),
    final_ok=st.booleans(),
    unhealthy_threshold=st.integers(min_value=1, max_value=5),
    healthy_threshold=st.integers(min_value=1, max_value=5),
)
def test_a_long_enough_run_decides_health_whatever_came_before(
    history: list[bool],
    run_length: int,
    final_ok: bool,
    unhealthy_threshold: int,
    healthy_threshold: int,
) -> None:
    policy = HealthPolicy(
        unhealthy_threshold=unhealthy_threshold, healthy_threshold=healthy_threshold
    )
    threshold = healthy_threshold if final_ok else unhealthy_threshold
    state = HostHealth()
    for ok in history:
        state = next_health(state, OK if ok else FAIL, policy)
    for _ in range(threshold + run_length):
        state = next_health(state, OK if final_ok else FAIL, policy)
    assert state.healthy is final_ok
    assert state.consecutive_successes + state.consecutive_failures >= threshold
    assert (state.last_error is None) is final_ok


@given(st.lists(st.booleans(), min_size=1, max_size=30))
def test_health_flips_only_at_a_threshold(outcomes: list[bool]) -> None:
    policy = HealthPolicy(unhealthy_threshold=2, healthy_threshold=3)
    state = HostHealth()
    for ok in outcomes:
        after = next_health(state, OK if ok else FAIL, policy)
        if after.healthy and not state.healthy:
            assert ok
            assert after.consecutive_successes == policy.healthy_threshold
        if state.healthy and not after.healthy:
            assert not ok
            assert after.consecutive_failures == policy.unhealthy_threshold
        state = after


# --- /v1/models -----------------------------------------------------------------------


def test_models_listing_keeps_base_models_and_lora_adapters() -> None:
    listing = {
        "object": "list",
        "data": [
            {"id": "meta-llama/Llama-3.1-8B", "object": "model", "parent": None},
            {"id": "sql-lora", "object": "model", "parent": "meta-llama/Llama-3.1-8B"},
            {"id": "chat-lora", "object": "model", "parent": "meta-llama/Llama-3.1-8B"},
        ],
    }
    assert models_from_listing(listing) == ("chat-lora", "meta-llama/Llama-3.1-8B", "sql-lora")


@pytest.mark.parametrize("listing", [[], {"data": "x"}, {"data": [{"object": "model"}]}, None])
def test_models_listing_of_another_shape_is_rejected(listing: object) -> None:
    with pytest.raises(ValueError, match="/v1/models"):
        models_from_listing(listing)


# --- probe ----------------------------------------------------------------------------


async def test_probe_of_a_simulator_learns_its_models() -> None:
    async with simulator(SIM_HOST, free_port(SIM_HOST)) as address, host_client() as s:
        assert await probe(s, address, timeout_s=2) == ProbeResult(True, models=(MODEL,))


async def test_probe_of_a_closed_port_fails_without_raising() -> None:
    async with host_client() as client:
        result = await probe(client, f"{DEAD_HOST}:{free_port(DEAD_HOST)}", timeout_s=2)
    assert not result.ok
    assert result.error


async def test_probe_needs_a_2xx_health() -> None:
    app = web.Application()
    app.router.add_get("/health", respond_with(503))
    async with app_server(app, SIM_HOST) as address, host_client() as client:
        result = await probe(client, address, timeout_s=2)
    assert result == ProbeResult(False, error="/health answered HTTP 503")


async def test_probe_without_a_model_listing_is_ok_with_models_unknown() -> None:
    app = web.Application()
    app.router.add_get("/health", respond_with(200))
    async with app_server(app, SIM_HOST) as address, host_client() as client:
        assert await probe(client, address, timeout_s=2) == ProbeResult(True, models=None)


async def test_probe_of_a_hung_host_times_out() -> None:
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        async with asyncio.timeout(10):
            await release.wait()
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", hang)
    async with app_server(app, SIM_HOST) as address, host_client() as client:
        started = time.monotonic()
        result = await probe(client, address, timeout_s=0.2)
        elapsed = time.monotonic() - started
        release.set()
    assert not result.ok
    assert "timed out" in (result.error or "")
    assert elapsed < 1.0


async def test_probe_follows_no_redirect() -> None:
    async def elsewhere(_: web.Request) -> web.Response:
        raise web.HTTPFound("/healthy-elsewhere")

    app = web.Application()
    app.router.add_get("/health", elsewhere)
    app.router.add_get("/healthy-elsewhere", respond_with(200))
    async with app_server(app, SIM_HOST) as address, host_client() as client:
        result = await probe(client, address, timeout_s=2)
    assert result == ProbeResult(False, error="/health answered HTTP 302")


async def test_probe_ignores_the_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing listens there: a probe sent through it would fail.
    proxy = f"http://{DEAD_HOST}:{free_port(DEAD_HOST)}"
    for variable in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(variable, proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with simulator(SIM_HOST, free_port(SIM_HOST)) as address, host_client() as client:
        assert await probe(client, address, timeout_s=2) == ProbeResult(True, models=(MODEL,))


async def test_a_model_listing_that_is_not_json_leaves_the_models_unknown() -> None:
    async def not_json(_: web.Request) -> web.Response:
        return web.Response(body=b"\xff{", content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", respond_with(200))
    app.router.add_get("/v1/models", not_json)
    async with app_server(app, SIM_HOST) as address, host_client() as client:
        assert await probe(client, address, timeout_s=2) == ProbeResult(True, models=None)


# --- checker --------------------------------------------------------------------------


async def test_simulator_is_admitted_after_two_rounds_and_ejected_after_it_stops() -> None:
    checker = HealthChecker(HealthPolicy(timeout_s=0.5, healthy_threshold=2))
    # Another host stays up: were the stopped one the last healthy host, it would be held.
    async with simulator(OTHER_SIM_HOST, free_port(OTHER_SIM_HOST)) as other:
        async with simulator(SIM_HOST, free_port(SIM_HOST)) as address:
            first = await checker.check_once([address, other])
            assert not first[address].healthy
            assert first[address].models == (MODEL,)
            second = await checker.check_once([address, other])
            assert second[address].healthy
            assert second[address].models == (MODEL,)
        # The simulator is gone: one failure is tolerated, the second ejects.
        third = await checker.check_once([address, other])
        assert third[address].healthy
        assert third[address].consecutive_failures == 1
        fourth = await checker.check_once([address, other])
        assert not fourth[address].healthy
        assert fourth[address].models == (MODEL,)
        assert fourth[address].last_error
        assert fourth[other].healthy


def healthy(*, failures: int = 0) -> HostHealth:
    return HostHealth(healthy=True, consecutive_failures=failures, models=("m",))


def ejected(*, failures: int = 2) -> HostHealth:
    return HostHealth(
        healthy=False, consecutive_failures=failures, models=("m",), last_error="refused"
    )


def test_a_round_with_a_healthy_host_left_is_kept_as_it_is() -> None:
    previous = {"a": healthy(), "b": healthy()}
    current = {"a": healthy(), "b": ejected()}
    assert hold_when_every_host_fails(previous, current) == (current, [])


def test_a_round_that_would_eject_every_host_keeps_those_that_were_healthy() -> None:
    previous = {"a": healthy(failures=1), "b": healthy(failures=1), "c": ejected()}
    current = {"a": ejected(), "b": ejected(), "c": ejected(failures=3), "new": HostHealth()}
    kept, held = hold_when_every_host_fails(previous, current)
    assert held == ["a", "b"]
    # Held healthy, still counting failures, so the first round that finds the prober
    # working again ejects them if they still fail.
    assert kept["a"] == HostHealth(True, 2, 0, ("m",), "refused")
    assert kept["b"].healthy
    # Hosts that were not healthy, and new ones, are not let in.
    assert kept["c"] == current["c"]
    assert kept["new"] == HostHealth()


def test_a_fleet_that_was_never_healthy_holds_nothing() -> None:
    current = {"a": ejected(), "new": HostHealth()}
    assert hold_when_every_host_fails({"a": ejected()}, current) == (current, [])
    assert hold_when_every_host_fails({}, {}) == ({}, [])


def test_a_host_no_longer_listed_is_not_held() -> None:
    previous = {"gone": healthy(), "a": ejected()}
    current = {"a": ejected(failures=3)}
    assert hold_when_every_host_fails(previous, current) == (current, [])


@given(
    st.dictionaries(
        st.sampled_from("abcd"),
        st.tuples(st.booleans(), st.booleans()),
        max_size=4,
    )
)
def test_a_round_never_empties_a_fleet_that_had_a_listed_healthy_host(
    hosts: dict[str, tuple[bool, bool]],
) -> None:
    # Each host: whether it was healthy, and whether its probe passed this round.
    policy = HealthPolicy(unhealthy_threshold=1, healthy_threshold=1)
    previous = {a: healthy() if was else ejected() for a, (was, _) in hosts.items()}
    current = {
        a: next_health(previous[a], OK if passed else FAIL, policy)
        for a, (_, passed) in hosts.items()
    }
    kept, held = hold_when_every_host_fails(previous, current)
    if any(s.healthy for s in previous.values()):
        assert any(s.healthy for s in kept.values())
    # Only a round with no healthy host holds, and only what was healthy.
    assert held == [] or not any(s.healthy for s in current.values())
    assert all(previous[a].healthy for a in held)
    assert {a for a, s in kept.items() if s.healthy} == (
        {a for a, s in current.items() if s.healthy} | set(held)
    )


async def test_a_port_with_nothing_listening_never_becomes_healthy() -> None:
    checker = HealthChecker(FAST)
    address = f"{DEAD_HOST}:{free_port(DEAD_HOST)}"
    for _ in range(4):
        states = await checker.check_once([address])
        assert not states[address].healthy
    assert states[address].consecutive_failures == 4


async def test_hosts_no_longer_listed_are_forgotten() -> None:
    checker = HealthChecker(FAST)
    gone = f"{DEAD_HOST}:{free_port(DEAD_HOST)}"
    await checker.check_once([gone])
    assert set(checker.states) == {gone}
    async with simulator(SIM_HOST, free_port(SIM_HOST)) as address:
        states = await checker.check_once([address])
    assert set(states) == {address}
    assert set(checker.states) == {address}


async def test_run_reports_transitions_only_and_stops_promptly() -> None:
    checker = HealthChecker(FAST)
    dead = f"{DEAD_HOST}:{free_port(DEAD_HOST)}"
    changes: list[Mapping[str, HostHealth]] = []
    rounds = 0
    stop = asyncio.Event()
    sim_address = f"{SIM_HOST}:{free_port(SIM_HOST)}"
    other_address = f"{OTHER_SIM_HOST}:{free_port(OTHER_SIM_HOST)}"

    def addresses() -> list[str]:
        nonlocal rounds
        rounds += 1
        return [sim_address, other_address, dead]

    async def wait_for_rounds(count: int) -> None:
        target = rounds + count
        await wait_until_async(
            lambda: rounds >= target, 10, f"{count} more health rounds", interval_s=0.01
        )

    def healthy_sets() -> list[set[str]]:
        return [{a for a, s in states.items() if s.healthy} for states in changes]

    async with simulator(OTHER_SIM_HOST, int(other_address.rpartition(":")[2])):
        async with simulator(SIM_HOST, int(sim_address.rpartition(":")[2])):
            runner = asyncio.create_task(checker.run(addresses, changes.append, stop))
            # Round 2 reports the admission (round 1 could admit no host, so it reports
            # nothing); the rest are quiet.
            await wait_for_rounds(5)
            assert healthy_sets() == [{sim_address, other_address}]
            assert changes[-1][sim_address].models == (MODEL,)
        # Ejection after unhealthy_threshold=2 failed rounds is reported once.
        await wait_for_rounds(4)
        assert healthy_sets() == [{sim_address, other_address}, {other_address}]

    stop.set()
    started = time.monotonic()
    async with asyncio.timeout(5):
        await runner
    assert time.monotonic() - started < FAST.timeout_s + 0.5
    assert len(changes) == 2


def held_rounds() -> float:
    return REGISTRY.get_sample_value("prefix_router_cp_health_holds_total") or 0.0


async def test_every_host_failing_at_once_is_held_until_a_probe_passes_again() -> None:
    """Fail static: the prober losing every host at once keeps them published; once it
    reaches one again, those still failing go."""
    checker = HealthChecker(HealthPolicy(interval_s=0.2, timeout_s=0.2, healthy_threshold=1))
    holds = held_rounds()
    sim_port, other_port = free_port(SIM_HOST), free_port(OTHER_SIM_HOST)
    sim_address, other_address = f"{SIM_HOST}:{sim_port}", f"{OTHER_SIM_HOST}:{other_port}"
    both = [sim_address, other_address]
    async with simulator(SIM_HOST, sim_port), simulator(OTHER_SIM_HOST, other_port):
        admitted = await checker.check_once(both)
        assert all(state.healthy for state in admitted.values())
    for failures in (1, 2, 3):  # past unhealthy_threshold (2): held, failures counted
        states = await checker.check_once(both)
        assert all(s.healthy and s.consecutive_failures == failures for s in states.values())
    assert held_rounds() == holds + 2  # failures 2 and 3 were held
    async with simulator(SIM_HOST, sim_port):
        states = await checker.check_once(both)
    assert states[sim_address].healthy
    assert states[sim_address].consecutive_failures == 0
    assert not states[other_address].healthy


async def test_run_publishes_nothing_before_a_host_could_be_admitted() -> None:
    # A control plane that restarts knows no host yet: it must not publish the set of
    # none (Envoy and the routers keep their last set until it publishes).
    checker = HealthChecker(HealthPolicy(interval_s=0.2, timeout_s=0.2, healthy_threshold=3))
    changes: list[Mapping[str, HostHealth]] = []
    published_before_round: list[int] = []
    stop = asyncio.Event()
    sim_address = f"{SIM_HOST}:{free_port(SIM_HOST)}"

    def addresses() -> list[str]:
        published_before_round.append(len(changes))
        return [sim_address]

    async with simulator(SIM_HOST, int(sim_address.rpartition(":")[2])):
        runner = asyncio.create_task(checker.run(addresses, changes.append, stop))
        await wait_until_async(
            lambda: len(published_before_round) >= 4, 10, "4 rounds begun", interval_s=0.01
        )
        # Nothing before rounds 1 to 3 began; round 3 admitted the host and published.
        assert published_before_round[:4] == [0, 0, 0, 1]
        assert [{a for a, s in c.items() if s.healthy} for c in changes] == [{sim_address}]
        stop.set()
        async with asyncio.timeout(5):
            await runner


async def test_run_stops_during_a_long_interval() -> None:
    # A threshold of 1: the first round publishes, and then a long interval begins.
    checker = HealthChecker(HealthPolicy(interval_s=30, timeout_s=0.5, healthy_threshold=1))
    reported = asyncio.Event()
    stop = asyncio.Event()
    runner = asyncio.create_task(
        checker.run(lambda: [f"{DEAD_HOST}:{free_port(DEAD_HOST)}"], lambda _: reported.set(), stop)
    )
    async with asyncio.timeout(5):
        await reported.wait()
    stop.set()
    started = time.monotonic()
    async with asyncio.timeout(5):
        await runner
    assert time.monotonic() - started < 0.5


async def test_run_closes_its_client() -> None:
    clients: list[httpx.AsyncClient] = []

    def factory() -> httpx.AsyncClient:
        clients.append(host_client())
        return clients[-1]

    stop = asyncio.Event()
    checker = HealthChecker(FAST, client_factory=factory)
    await checker.run(lambda: [], lambda _: stop.set(), stop)
    assert len(clients) == 1
    assert clients[0].is_closed


async def test_run_probes_a_host_over_one_connection_round_after_round() -> None:
    connections: set[object] = set()

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        connections.add(request.transport.get_extra_info("peername"))
        return web.json_response({"data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_get("/health", answer)
    app.router.add_get("/v1/models", answer)
    rounds = 0
    stop = asyncio.Event()

    async with app_server(app, SIM_HOST) as address:

        def count_round() -> list[str]:
            nonlocal rounds
            rounds += 1
            return [address]

        checker = HealthChecker(HealthPolicy(interval_s=0.05, timeout_s=0.05))
        runner = asyncio.create_task(checker.run(count_round, lambda _: None, stop))
        # Round 3 begins once rounds 1 and 2 (the admission) have probed the host.
        await wait_until_async(lambda: rounds >= 3, 10, "two rounds probed", interval_s=0.01)
        stop.set()
        await runner
    assert len(connections) == 1
