"""The long-streams benchmark, small: Envoy holds ext_proc streams as long as the responses
only where they do not end at the decision, and the router counts every request either way."""

from __future__ import annotations

import pytest

from extproc.bench import long_streams

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(240)]


def test_streams_follow_the_decisions_and_the_router_counts_every_response(tmp_path):
    options = long_streams.LongStreamOptions(
        requests=60, stream_s=6.0, itl_s=0.25, sample_every_s=0.5, out_dir=tmp_path
    )
    data = long_streams.run(options)
    stored = data["options"]
    for body_mode, run in data["runs"].items():
        assert run["completed"] == options.requests, body_mode
        assert long_streams.middle(run, stored, "backend_requests") == options.requests
        assert long_streams.middle(run, stored, "router_in_flight") == options.requests
        # Nothing is left once the responses have ended.
        assert run["samples"][-1]["router_in_flight"] == 0
    held = {m: long_streams.middle(r, stored, "ext_proc_streams") for m, r in data["runs"].items()}
    assert held == {"buffered-partial": options.requests, "streamed": 0}
    report = (tmp_path / "long-streams.md").read_text()
    assert "| streamed | 60 | 60 | 0 |" in report
    assert (tmp_path / "long-streams.png").stat().st_size > 0
