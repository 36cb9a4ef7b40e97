"""The concurrency benchmark at smoke size, through the real Envoy and router, and its
verdict on made-up levels."""

from __future__ import annotations

import json

import pytest

from extproc.bench import concurrency, report
from extproc.bench.concurrency import ConcurrencyOptions, holds

pytestmark = pytest.mark.envoy


def level(**changes):
    result = {
        "level": 10,
        "completed": 10,
        "decided": 10.0,
        "failures": dict.fromkeys(["http.ingress.ext_proc.failure_mode_allowed"], 0.0),
        "open_streams_end": 0.0,
        "samples": [{"router_in_flight": 0.0}],
    }
    return result | changes


def test_a_level_holds_only_if_every_request_is_decided_and_nothing_trips():
    assert holds(level())
    assert not holds(level(completed=9))
    assert not holds(level(decided=9.0))  # one placed by Envoy's fallback
    assert not holds(level(failures={"cluster.vllm.upstream_rq_pending_overflow": 1.0}))
    assert not holds(level(samples=[{"router_in_flight": 1.0}]))
    assert not holds(level(open_streams_end=2.0))


@pytest.mark.timeout(180)
def test_a_small_ladder_holds_and_its_report_renders_from_the_stored_run(tmp_path):
    options = ConcurrencyOptions(
        levels=(60, 120), stream_s=2.0, itl_s=0.25, ramp_s=0.5, out_dir=tmp_path
    )
    data = concurrency.run(options)
    assert [level["level"] for level in data["levels"]] == [60, 120]
    for result in data["levels"]:
        assert result["held"], result
        assert result["peak_client_in_flight"] > result["level"] // 2
        assert max(s["router_rss"] for s in result["samples"]) > 0
    assert concurrency.highest_held(data) == 120
    stored = json.loads((tmp_path / "concurrency.json").read_text())
    rendered = (tmp_path / "concurrency.md").read_text()
    assert rendered == concurrency.render(stored)
    assert "**120** requests in flight at once" in rendered
    assert (tmp_path / "concurrency.png").stat().st_size > 0
    report.rerender(tmp_path / "concurrency.json")
    assert (tmp_path / "concurrency.md").read_text() == rendered


@pytest.mark.timeout(180)
def test_a_small_ladder_through_an_endpoint_picker_holds_and_renders(tmp_path):
    """kgateway's 5 s message timeout, every reply chunk echoed by the picker."""
    options = ConcurrencyOptions(
        levels=(80,), stream_s=2.0, itl_s=0.25, ramp_s=0.5, out_dir=tmp_path, gateway="kgateway"
    )
    data = concurrency.run(options)
    (result,) = data["levels"]
    assert result["held"], result
    assert set(result["failures"]) >= {
        "http.inference_gateway.ext_proc.message_timeouts",
        "cluster.endpoint_picker.upstream_rq_active_overflow",
    }
    stored = json.loads((tmp_path / "concurrency-epp-kgateway.json").read_text())
    rendered = (tmp_path / "concurrency-epp-kgateway.md").read_text()
    assert rendered == concurrency.render(stored)
    assert "configured as kgateway" in rendered and "concurrency-epp-kgateway.png" in rendered
