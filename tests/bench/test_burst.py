"""The burst benchmark: its verdict on made-up rows, and a smoke-size burst through the real
Envoy and router, each variant on a fresh stack, rendered from the stored run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from extproc.bench import burst, report
from extproc.bench.burst import BurstOptions, holds
from extproc.stack.bootstrap import BootstrapParams

pytestmark = pytest.mark.envoy


def row(**changes):
    result = {
        "level": 10,
        "completed": 10,
        "decided": 10.0,
        "shed": 4.0,
        "variant": "defaults",
        "failures": {
            "http.ingress.ext_proc.message_timeouts": 0.0,
            "http.ingress.ext_proc.failure_mode_allowed": 0.0,
        },
    }
    return result | changes


def test_a_row_holds_only_if_the_router_answered_every_request_itself():
    assert holds(row())
    assert holds(row(shed=10.0))  # shed requests are decided, on their headers
    assert not holds(row(completed=9))
    assert not holds(row(decided=9.0))  # one placed by Envoy's fallback, unseen
    timed_out = {"http.ingress.ext_proc.message_timeouts": 1.0}
    assert not holds(row(failures=timed_out))


def test_none_waited_for_a_timeout_allows_only_the_breakers_fail_open_at_once():
    overflow = burst.BREAKER_OVERFLOW
    fail_open = "http.ingress.ext_proc.failure_mode_allowed"
    failed = "http.ingress.ext_proc.streams_failed"
    assert burst.waited_for_no_timeout(row())
    # Four refused by the breaker, failed open at once: none waited.
    at_once = {overflow: 4.0, fail_open: 4.0, failed: 4.0}
    assert burst.waited_for_no_timeout(row(decided=6.0, failures=at_once))
    assert not holds(row(decided=6.0, failures=at_once))  # the router did not answer them
    # One more failed open than the breaker refused: it waited, or its stream failed.
    assert not burst.waited_for_no_timeout(
        row(decided=5.0, failures={overflow: 4.0, fail_open: 5.0, failed: 5.0})
    )
    timed_out = at_once | {"http.ingress.ext_proc.message_timeouts": 1.0}
    assert not burst.waited_for_no_timeout(row(decided=6.0, failures=timed_out))
    assert not burst.waited_for_no_timeout(row(decided=6.0, completed=9, failures=at_once))


def test_a_variant_that_changes_envoy_names_it_beside_the_router_settings():
    for name, envoy in burst.ENVOY_VARIANTS.items():
        assert name in burst.VARIANTS
        assert set(envoy) <= {f.name for f in dataclasses.fields(BootstrapParams)}
    assert burst._settings({"stream_end": "decision"}, {"router_max_streams": 256}) == (
        "`stream_end: decision`; Envoy: `router_max_streams=256`"
    )


def test_an_unknown_variant_is_named():
    with pytest.raises(ValueError, match="sometimes"):
        BurstOptions(variants=("defaults", "sometimes"))
    with pytest.raises(ValueError, match="rounds"):
        BurstOptions(rounds=0)


def test_rows_are_medians_over_rounds_and_hold_only_if_every_round_held():
    def measured(timeouts, held, p99):
        failures = {"http.ingress.ext_proc.message_timeouts": timeouts}
        ttft = {"p50": p99 / 2, "p99": p99, "max": p99}
        return row(failures=failures, held=held, ttft_s=ttft, statuses={"200": 10}, variant="v")

    data = {
        "results": [measured(0.0, True, 1.0), measured(9.0, False, 3.0), measured(1.0, True, 2.0)]
    }
    (summary,) = burst.summaries(data)
    assert summary["rounds"] == 3
    assert summary["failures"] == {"http.ingress.ext_proc.message_timeouts": 1.0}
    assert summary["ttft_s"]["p99"] == 2.0
    assert summary["on_body"] == 6.0
    assert not summary["held"]


# The smoke's levels, from stored ladders of this quick burst at the defaults (2 cores):
#   tests/bench/burst_smoke/: `prefix-router bench concurrency --burst --quick --levels
#     150,300,450,600 --rounds 6` (written to docs/benchmarks/burst-smoke, as it says, and
#     moved here), the machine otherwise idle:
#     held in 6 of 6 rounds at 150 and 300, 3 of 6 at 450, 1 of 6 at 600 (the CI run that
#     failed at 600 was one of the five);
#   tests/bench/burst_smoke_beside_a_busy_core/: the same at 150,300 beside
#     `python -c 'while True: pass'` (one of the two cores busy, as the other xdist worker
#     keeps it in CI): 6 of 6 at 150, 5 of 6 at 300.
# So the burst that must hold is 150. Past that the router misses Envoy's message_timeout
# for some requests (issue 27, docs/benchmarks/burst.md): at 600 the smoke asserts only
# that nothing is lost, each request answered by the router or failed open by Envoy and
# counted by one of them (in every stored round at 600, decided + failed open = 600).
HOLDS_AT = 150
BEYOND = 600


@pytest.mark.timeout(240)
def test_a_smoke_burst_holds_within_capacity_loses_nothing_past_it_and_renders(tmp_path):
    options = BurstOptions(
        levels=(HOLDS_AT, BEYOND),
        variants=("defaults",),
        stream_s=2.0,
        itl_s=0.25,
        out_dir=tmp_path,
    )
    data = burst.run(options)
    by_level = {result["level"]: result for result in burst.summaries(data)}
    assert set(by_level) == {HOLDS_AT, BEYOND}
    within = by_level[HOLDS_AT]
    assert within["held"], within
    assert within["statuses"] == {"200": HOLDS_AT}
    assert 0 < within["ttft_s"]["p50"] <= within["ttft_s"]["p99"]
    beyond = by_level[BEYOND]
    assert beyond["statuses"] == {"200": BEYOND} and beyond["completed"] == BEYOND, beyond
    failed_open = beyond["failures"]["http.ingress.ext_proc.failure_mode_allowed"]
    assert beyond["decided"] + failed_open >= BEYOND, beyond
    stored = json.loads((tmp_path / "burst.json").read_text())
    rendered = (tmp_path / "burst.md").read_text()
    assert rendered == burst.render(stored)
    report.rerender(tmp_path / "burst.json")
    assert (tmp_path / "burst.md").read_text() == rendered


@pytest.mark.parametrize("ladder", ["burst_smoke", "burst_smoke_beside_a_busy_core"])
def test_the_smokes_levels_come_from_the_stored_ladders(ladder):
    stored = json.loads((Path(__file__).with_name(ladder) / "burst.json").read_text())
    held: dict[int, list[bool]] = {}
    for result in stored["results"]:
        held.setdefault(result["level"], []).append(result["held"])
    assert all(held[HOLDS_AT]) and len(held[HOLDS_AT]) == 6
    beyond = [r for r in stored["results"] if r["level"] == BEYOND]
    for result in beyond:
        failed_open = result["failures"]["http.ingress.ext_proc.failure_mode_allowed"]
        assert result["decided"] + failed_open == BEYOND
