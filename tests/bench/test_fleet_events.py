"""The fleet-events benchmark end to end, at smoke size."""

import json
from dataclasses import asdict

from extproc.bench.fleet_events import FleetEventOptions, one_round, run


def test_one_round_measures_consistent_movement_and_ejection():
    result = one_round(FleetEventOptions(prefixes=40))
    assert result.cached_moved_3_to_4 == 0  # the index knows where they are cached
    # At least its share: the new host's cache is the least pressed, so it draws more.
    assert 0.15 <= result.new_on_4th <= 0.9
    assert result.moved_4_to_3 == result.new_on_4th
    assert result.restored
    # Defaults: a probe every 1 s, ejection after 2 failures.
    assert 0.5 < result.ejection_envoy_s < 5


def test_report_is_written(tmp_path, monkeypatch):
    import extproc.bench.fleet_events as fleet_events

    fake = fleet_events.RoundResult(0.0, 0.25, 0.25, True, 2.0, 1.5, 1.6)
    monkeypatch.setattr(fleet_events, "one_round", lambda options: fake)
    text = run(FleetEventOptions(rounds=2, out_dir=tmp_path)).read_text()
    assert "| new prefixes the 4th host took | 0.250 |" in text
    assert "| SIGKILL to ejected from Envoy (s) | 1.50 |" in text
    assert (tmp_path / "fleet-events.png").stat().st_size > 10_000
    assert "- held in every round: no cached prefix moved when the 4th host joined" in text
    stored = json.loads((tmp_path / "fleet-events.json").read_text())
    assert fleet_events.render(stored) == text


def test_verdicts_follow_the_data():
    from extproc.bench.fleet_events import RoundResult, render

    good = RoundResult(0.0, 0.3, 0.3, True, 2.0, 1.5, 1.6)
    moved = RoundResult(0.02, 0.2, 0.2, False, 2.0, 3.0, 1.6)
    data = {
        "command": "c",
        "prefixes": 40,
        "machine": "m",
        "health": {"interval_s": 1, "timeout_s": 0.5, "unhealthy_threshold": 2,
                   "healthy_threshold": 2},
        "rounds": [asdict(good), asdict(moved)],
    }  # fmt: skip
    text = render(data)
    for claim in ("no cached prefix moved", "at least 1/4", "only the 4th host's", "within 2.5 s"):
        (line,) = [line for line in text.splitlines() if claim in line]
        assert line.startswith("- did not hold")
    assert render({**data, "rounds": [asdict(good)]}).count("- held in every round") == 4
