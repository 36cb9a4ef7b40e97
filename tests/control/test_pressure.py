"""Placement weights from cache pressure, and how often they change."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.control.model import HostLoad
from extproc.control.rates import MAX_WEIGHT, MIN_WEIGHT, CachePressure, placement_weights

HOSTS = [f"127.0.0.{i}:8000" for i in range(1, 6)]


def test_an_idle_host_draws_a_busy_one_repels_the_rest_are_equal():
    rates = dict(zip(HOSTS[:4], [5000.0, 1500.0, 1700.0, 200.0], strict=True))  # mean 2100
    weights = placement_weights(rates, HOSTS[:4])
    assert weights == {
        HOSTS[0]: MIN_WEIGHT,  # over twice the mean
        HOSTS[1]: 1.0,
        HOSTS[2]: 1.0,
        HOSTS[3]: MAX_WEIGHT,  # under half of it
    }


def test_everyday_differences_move_nothing_and_unknowns_mean_equal():
    rates = dict(zip(HOSTS[:3], [1300.0, 1000.0, 800.0], strict=True))
    assert set(placement_weights(rates, HOSTS[:3]).values()) == {1.0}
    # A host with no rate yet weighs 1 and is left out of the mean.
    assert placement_weights(rates, HOSTS[:4]) == dict.fromkeys(HOSTS[:4], 1.0)
    assert placement_weights(dict.fromkeys(HOSTS, 0.0), HOSTS) == {}  # an idle fleet


@given(st.lists(st.floats(min_value=0, max_value=1e7), min_size=5, max_size=5))
def test_weights_take_three_levels_and_fall_as_the_rate_rises(values):
    rates = dict(zip(HOSTS, values, strict=True))
    weights = placement_weights(rates, HOSTS)
    if not weights:
        return
    assert set(weights.values()) <= {MIN_WEIGHT, 1.0, MAX_WEIGHT}
    ordered = sorted(HOSTS, key=lambda h: rates[h])
    assert [weights[h] for h in ordered] == sorted(weights.values(), reverse=True)


def test_weights_change_only_every_interval():
    pressure = CachePressure(time_constant_s=2, weights_interval_s=10, factor=1.5)

    def loads(second: int, busy: float) -> dict[str, HostLoad]:
        return {
            HOSTS[0]: HostLoad(prefix_cache_queries=busy * second, scraped_at=second),
            HOSTS[1]: HostLoad(prefix_cache_queries=1000.0 * second, scraped_at=second),
        }

    published = [pressure.update(loads(s, 1000), s) for s in range(0, 10)]
    assert all(p[HOSTS[0]][1] == 1.0 for p in published)
    # Host 0 becomes busy at once, but its weight waits for the next interval.
    held = [pressure.update(loads(s, 8000 if s > 10 else 1000), s) for s in range(10, 20)]
    assert held[5][HOSTS[0]][0] > 3000  # the rate moves at once
    assert held[5][HOSTS[0]][1] == 1.0  # the weight does not
    assert pressure.update(loads(20, 8000), 20)[HOSTS[0]][1] == MIN_WEIGHT


def test_a_host_missing_from_one_round_keeps_its_rate_and_weight():
    pressure = CachePressure(time_constant_s=2, weights_interval_s=0)
    fleet = HOSTS[:3]

    def loads(second: int, hosts) -> dict[str, HostLoad]:
        rates = {HOSTS[0]: 100.0, HOSTS[1]: 1000.0, HOSTS[2]: 1000.0}
        return {
            h: HostLoad(prefix_cache_queries=rates[h] * second, scraped_at=second) for h in hosts
        }

    for second in range(10):
        published = pressure.update(loads(second, fleet), second, fleet)
    assert published[HOSTS[0]][1] == MAX_WEIGHT
    # Host 1's scrape times out: the others keep their weights, and so does host 1.
    published = pressure.update(loads(10, [HOSTS[0], HOSTS[2]]), 10, fleet)
    assert published[HOSTS[0]][1] == MAX_WEIGHT
    assert HOSTS[1] in pressure.rates.update({})
    assert pressure.update(loads(11, fleet), 11, fleet)[HOSTS[1]][1] == 1.0
