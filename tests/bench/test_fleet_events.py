"""The fleet-events benchmark end to end, at smoke size."""

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
