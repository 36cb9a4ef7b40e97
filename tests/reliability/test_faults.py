"""Single faults under steady traffic (~50 req/s through the real Envoy): a backend, the
router, the control plane, scaling and config reloads. Each test counts the requests the
routing layer failed (a 5xx or no response, with no backend's x-served-by): zero.
"""

from __future__ import annotations

import json
import time

import pytest

from extproc.stack import prometheus
from extproc.stack.local import LocalStack, envoy_counters
from extproc.stack.processes import wait_until

from .stacks import placements, reliability_spec, served_cached, wait_for_fleet
from .steady import SteadyTraffic

pytestmark = pytest.mark.envoy

DOCS = range(40)
# The documents the background traffic sends (SteadyTraffic's docs): the first half.
OUTAGE_DOCS = range(20)


@pytest.fixture
def stack():
    with LocalStack(reliability_spec(3)) as running:
        yield running


def assert_clean(traffic: SteadyTraffic, fleet: set[str], at_least: int) -> None:
    sent = traffic.sent
    assert len(sent) >= at_least, traffic.summary()
    assert traffic.routing_failures == [], traffic.summary()
    assert traffic.served_outside(fleet) == []


def moved(after: dict[int, str], before: dict[int, str], traffic: SteadyTraffic) -> dict:
    """The documents whose probe moved between two rounds, but for those that moved to a
    host the background traffic had served them on against the router's choice (Envoy
    failed the request over, retried it or failed it open on a busy machine): that host
    caches the document too, and of two holders the router may pick either (affinity.py)."""
    sent = traffic.sent
    # Without the router's choice on its responses every request would look strayed.
    assert any(s.routed_to and s.served_by == s.routed_to for s in sent), traffic.summary()
    strays = traffic.strays()
    return {
        doc: (before[doc], host)
        for doc, host in after.items()
        if host != before[doc] and host not in strays.get(doc, set())
    }


def test_sigkilled_backend_is_routed_around_and_rejoins(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    before = placements(stack, DOCS)
    victim, victim_address = stack.sims[0], stack.backend_addresses[0]
    host, port = stack.spec.backends[0]
    with SteadyTraffic(stack.url).running() as traffic:
        traffic.wait_for(50)
        victim.kill()  # SIGKILL: no goodbye, in-flight connections reset
        wait_for_fleet(stack, fleet - {victim_address})
        traffic.wait_for(100)
        without = placements(stack, DOCS)
        stack.start_sim(host, port)
        wait_for_fleet(stack, fleet)
        traffic.wait_for(100)
        rejoined = placements(stack, DOCS)
        fresh = placements(stack, range(100, 160))
    for doc in DOCS:
        if before[doc] == victim_address:
            assert without[doc] in fleet - {victim_address}
    # Only the dead host's prefixes moved.
    survivors = {doc: host for doc, host in before.items() if host != victim_address}
    assert moved({doc: without[doc] for doc in survivors}, survivors, traffic) == {}, (
        traffic.summary()
    )
    # The restarted host's cache is empty: its old prefixes stay where they are cached
    # now, and it takes new ones.
    assert moved(rejoined, without, traffic) == {}, traffic.summary()
    assert victim_address in fresh.values()
    assert_clean(traffic, fleet, 250)
    # A response already streaming from the host when it died is cut; with max_tokens=1
    # that window is a few milliseconds, so at most one such request.
    assert len(traffic.backend_failures) <= 1, traffic.summary()


def test_killed_router_fails_open_and_affinity_returns_with_it(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    before = placements(stack, DOCS)
    with SteadyTraffic(stack.url, docs=len(OUTAGE_DOCS)).running() as traffic:
        traffic.wait_for(50)
        assert stack.router is not None
        stack.router.kill()
        killed_at = time.monotonic()
        # Requests fail open from the kill on; Envoy's health check then marks it down.
        wait_until(
            lambda: not stack.healthy_routers(),
            10,
            what="Envoy's health check to mark the router down",
        )
        down_at = time.monotonic()
        wait_until(
            lambda: len(traffic.since(killed_at)) >= 50 and len(traffic.since(down_at)) >= 10,
            15,
            what="requests answered during the outage, before and after the router was marked down",
        )
        during = traffic.since(killed_at)
        stack.start_router()
        # Envoy's 1 s health check brings the router back into its ext_proc cluster; until
        # then requests still fail open (and a probe would spread the documents further).
        # Its admin page says healthy a little before its workers act on it
        # (tests/integration/test_router_failure.py), so: until the router decides the
        # traffic and nothing more fails open.
        wait_until(
            BackInThePath(stack), 10, "Envoy to route through the router again", interval_s=0.5
        )
        # The restarted router learns from the engines' KV events what each holds. The
        # documents the outage's traffic sent are cached at home and wherever Envoy sent them
        # failing open: each goes to one of those holders (of equal holders, the less
        # loaded). The others are cached at home alone, and go there: they are the test of
        # affinity.
        wait_until(
            lambda: affinity_returned(stack, before, traffic),
            15,
            what="affinity to return",
        )
        traffic.wait_for(50)
    assert len(during) >= 50, traffic.summary()
    assert all(s.status == 200 for s in during), traffic.summary()  # fail open
    assert_clean(traffic, fleet, 200)
    assert traffic.backend_failures == []


class BackInThePath:
    """True once, between two polls, the router decided at least 10 requests and Envoy
    failed none open."""

    def __init__(self, stack: LocalStack) -> None:
        self._stack = stack
        self._last: tuple[float, float] | None = None

    def __call__(self) -> bool:
        failed_open = _failed_open(self._stack)
        decided = prometheus.total(
            prometheus.scrape(self._stack.router_metrics_url), "prefix_router_decisions_total"
        )
        last, self._last = self._last, (failed_open, decided)
        return last is not None and failed_open == last[0] and decided >= last[1] + 10


def affinity_returned(stack: LocalStack, before: dict[int, str], traffic: SteadyTraffic) -> bool:
    failed_open = _failed_open(stack)
    now = served_cached(stack, DOCS)
    # A probe that failed open would cache its document on a second host and leave the
    # router free to pick either from then on: that is a broken test, not a slow router.
    assert _failed_open(stack) == failed_open, "requests failed open while probing"
    sent = traffic.sent
    holders = {
        doc: {before[doc]} | {s.served_by for s in sent if s.doc == doc and s.served_by}
        for doc in OUTAGE_DOCS
    }
    spread_by_the_outage = all(now[doc][0] in holders[doc] and now[doc][1] for doc in OUTAGE_DOCS)
    at_home = all(now[doc] == (before[doc], True) for doc in DOCS if doc not in OUTAGE_DOCS)
    return spread_by_the_outage and at_home


def _failed_open(stack: LocalStack) -> float:
    counters = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
    return counters.get("failure_mode_allowed", 0.0)


def test_control_plane_outage_of_30s_fails_nothing_and_moves_nothing(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    before = placements(stack, DOCS)
    with SteadyTraffic(stack.url, limit=3000, max_seconds=60).running() as traffic:
        traffic.wait_for(50)
        assert stack.control_plane is not None
        stack.control_plane.kill()
        # The outage's length is the scenario, not a wait for an event: 30 s outlasts every
        # timer an outage trips (the router's stale-feed age, 2 s; its reconnect backoff,
        # at most 2 s; gRPC keepalive, 15 s).
        time.sleep(15)
        during = placements(stack, DOCS)
        assert stack.envoy_hosts() == fleet  # Envoy keeps the last set
        time.sleep(15)  # the outage's second half
        stack.start_control_plane()
        # Both subscribers reconnect and are sent the fleet again. Envoy within about 2 s;
        # the router's own backoff is at most 2 s, but grpc's connection backoff, shared by
        # its channels to one target, has grown over the outage: about 12 s after this one.
        wait_until(
            lambda: control_plane_connected(stack) == (1, 1),
            40,
            what="Envoy and the router to reconnect to the control plane",
        )
        wait_for_fleet(stack, fleet)
        after = placements(stack, DOCS)
        traffic.wait_for(50)
    assert moved(during, before, traffic) == {}, traffic.summary()
    assert moved(after, before, traffic) == {}, traffic.summary()
    assert_clean(traffic, fleet, 1000)
    assert traffic.backend_failures == []


def control_plane_connected(stack: LocalStack) -> tuple[float | None, float | None]:
    """Envoy's ADS and the router's xDS stream: (1, 1) while both are connected."""
    envoy = envoy_counters(stack.admin_url, "control_plane.").get("connected_state")
    return envoy, stack.router_metric("prefix_router_control_plane_connected")


def test_scale_3_to_7_to_2_under_load(stack: LocalStack):
    three = list(stack.backend_addresses)
    port = stack.spec.backends[0][1]
    extra = [f"127.0.0.{14 + i}:{port}" for i in range(4)]
    for address in extra:
        host, _, extra_port = address.partition(":")
        stack.launch_sim(host, int(extra_port))
    before = placements(stack, DOCS)
    with SteadyTraffic(stack.url).running() as traffic:
        traffic.wait_for(50)
        seven = three + extra
        stack.write_control_plane_config(hosts=seven)
        wait_for_fleet(stack, set(seven))
        grown = placements(stack, DOCS)
        fresh = placements(stack, range(100, 170))
        traffic.wait_for(100)
        two = three[:2]
        stack.write_control_plane_config(hosts=two)
        wait_for_fleet(stack, set(two))
        shrunk = placements(stack, DOCS)
        traffic.wait_for(100)
    # Growing moves no cached prefix; shrinking moves only those of the removed hosts.
    assert moved(grown, before, traffic) == {}, traffic.summary()
    assert set(shrunk.values()) <= set(two)
    kept = {doc: host for doc, host in before.items() if host in two}
    assert moved({doc: shrunk[doc] for doc in kept}, kept, traffic) == {}, traffic.summary()
    assert len(set(fresh.values()) & set(extra)) >= 3  # the new hosts take new prefixes
    assert_clean(traffic, set(three + extra), 250)
    assert traffic.backend_failures == []


def rejected_reloads(stack: LocalStack) -> list[dict]:
    lines = stack.router_log_path().read_text(errors="replace").splitlines()
    events = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "config_reload_rejected":
            events.append(record)
    return events


def test_router_config_reload_mid_traffic_rejects_an_invalid_edit(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    assert stack.router is not None
    pid = stack.router.popen.pid
    before = placements(stack, DOCS)
    with SteadyTraffic(stack.url).running() as traffic:
        traffic.wait_for(50)
        # A valid edit applies without a restart (a shorter prefix still separates DOCS).
        stack.write_router_config(prefix_length=1024)
        wait_until(
            lambda: "config_reloaded" in stack.router_log_path().read_text(), 10, what="reload"
        )
        applied = placements(stack, DOCS)
        # An out-of-range value, with a strategy change that must not sneak in with it.
        stack.write_router_config(
            prefix_length=1024, routing_strategy="RANDOM", concurrency_threshold=5000
        )
        wait_until(lambda: len(rejected_reloads(stack)) >= 1, 10, what="the rejected reload")
        after_invalid = placements(stack, DOCS)
        # Broken YAML is rejected the same way.
        stack.router_config_path().write_text("routing_strategy: [RANDOM\n  prefix_length: {")
        wait_until(lambda: len(rejected_reloads(stack)) >= 2, 10, what="the second rejected reload")
        after_garbage = placements(stack, DOCS)
        traffic.wait_for(50)
    out_of_range, garbage = rejected_reloads(stack)[:2]
    assert "concurrency_threshold=5000" in out_of_range["error"]
    assert "1 to 1024" in out_of_range["error"]
    assert out_of_range["path"] == str(stack.router_config_path())
    assert "valid YAML" in garbage["error"]
    # The last good config (PREFIX_AWARE) stayed in force: placements did not scatter.
    assert moved(after_invalid, applied, traffic) == {}, traffic.summary()
    assert moved(after_garbage, applied, traffic) == {}, traffic.summary()
    assert len(set(before.values())) == 3
    assert stack.router.popen.pid == pid and stack.router.running
    assert_clean(traffic, fleet, 150)
    assert traffic.backend_failures == []
