"""A replay predicts what the router would do: it agrees with the offline placement model,
which routes the same requests (with their text) through a real Router over the same
virtual fleet, and it reads nothing but the log."""

import pytest

from extproc.adapter.strategies import LongestMatchStrategy
from extproc.bench.offline import OfflineFleet, simulate
from extproc.bench.workloads import WorkloadSpec, generate
from extproc.config import RouterConfig
from extproc.picker.strategy import KeyStrategy, LeastLoadedStrategy, RandomStrategy
from extproc.replay.configs import FIXED, LEAST_OUTSTANDING, PREFIX_AWARE, RANDOM, ReplayConfig
from extproc.replay.fleet import addresses
from extproc.replay.replayer import Replayer, ServiceModel
from extproc.replay.run import replay

from .logs import record_log

FLEET = OfflineFleet()  # 7 instances of 4,000 blocks of 16 tokens
CACHE_TOKENS = FLEET.capacity_blocks * FLEET.block_size_tokens
CASES = [
    # (strategy, the router's settings, what the replay routes with)
    (PREFIX_AWARE, {"routing_strategy": "PREFIX_AWARE", "block_bytes": 64}, (64, None)),
    (FIXED, {"routing_strategy": "PREFIX_AWARE", "prefix_match": "fixed"}, (None, 8192)),
    (LEAST_OUTSTANDING, {"routing_strategy": LEAST_OUTSTANDING}, (None, None)),
]


@pytest.fixture(scope="module", params=["long-context", "conversations"])
def workload(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    requests = generate(WorkloadSpec(name=request.param, rate_per_s=8, duration_s=40))
    path = tmp_path_factory.mktemp(request.param) / "traffic.log"
    record_log(path, requests, block_bytes=64)
    return requests, path


@pytest.mark.parametrize(("strategy", "settings", "replayed"), CASES)
def test_a_replay_agrees_with_the_router_on_the_same_fleet(workload, strategy, settings, replayed):
    requests, log = workload
    real = simulate(requests, FLEET, settings)
    threshold = 32 if strategy in (PREFIX_AWARE, FIXED) else None
    config = ReplayConfig(strategy, FLEET.instances, CACHE_TOKENS, threshold, *replayed)
    outputs = [r.body["max_tokens"] for r in requests]
    # The offline model has no prefill stalls: compare like with like.
    service = ServiceModel(output_tokens=round(sum(outputs) / len(outputs)), prefill_stalls=False)
    (predicted,) = replay(log, [config], RouterConfig(), service, hosts=FLEET.addresses).results
    assert predicted.requests == len(requests)
    assert abs(predicted.hit_rate - real.hit_rate) < 0.05, (predicted.hit_rate, real.hit_rate)
    shares = dict(zip(FLEET.addresses, predicted.shares, strict=True))
    worst = max(abs(shares[a] - real.shares[a]) for a in FLEET.addresses)
    assert worst < 0.03, (shares, real.shares)


def test_random_is_a_seeded_draw_and_the_grid_runs_in_one_pass(workload):
    requests, log = workload
    configs = [
        ReplayConfig(RANDOM, 7, CACHE_TOKENS),
        ReplayConfig(RANDOM, 4, CACHE_TOKENS),
        ReplayConfig(PREFIX_AWARE, 7, CACHE_TOKENS, 32, 512),
    ]
    first, second = replay(log, configs), replay(log, configs)
    assert [r.shares for r in first.results] == [r.shares for r in second.results]
    assert first.records == len(requests) and first.skipped == 0
    seven, four, prefix = first.results
    assert len(seven.shares) == 7 and len(four.shares) == 4
    assert prefix.hit_rate > seven.hit_rate + 0.2  # what the replay is for
    assert prefix.prefill_tokens + prefix.saved_tokens == seven.prefill_tokens + seven.saved_tokens
    assert prefix.outcomes.keys() <= {"placed", "matched", "overflow", "saturated"}


def test_virtual_addresses_stand_in_for_a_fleet_not_named(workload):
    _, log = workload
    config = ReplayConfig(PREFIX_AWARE, 5, CACHE_TOKENS, 32, 512)
    named = replay(log, [config], hosts=FLEET.addresses)  # 7 named: not this fleet's size
    assert len(named.results[0].shares) == 5
    assert addresses(5)[0] == "127.0.0.31:8000"


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [
        (RANDOM, RandomStrategy),
        (LEAST_OUTSTANDING, LeastLoadedStrategy),
        (FIXED, KeyStrategy),
        (PREFIX_AWARE, LongestMatchStrategy),
    ],
)
def test_each_configuration_decides_through_the_routers_strategy_table(strategy, kind):
    # The strategy objects the router itself calls, over the replay's own index and fleet.
    config = ReplayConfig(strategy, 3, CACHE_TOKENS, 4)
    replayer = Replayer(config, 64, RouterConfig(), ServiceModel())
    assert type(replayer.routing) is kind
    if strategy == PREFIX_AWARE:
        assert replayer.routing.index is replayer.index
