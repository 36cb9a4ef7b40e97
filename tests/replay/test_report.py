"""The replay's recommendation and its report, rendered from the stored document alone."""

import json

from extproc.bench import report
from extproc.replay.report import recommend


def result(instances: int, saved: int, busiest: float, bottleneck: float) -> dict:
    config = {"instances": instances, "cache_tokens": 1000}
    return {
        "config": config,
        "saved_tokens": saved,
        "busiest_share": busiest,
        "busiest_prefill_tokens": bottleneck,
    }


def test_the_least_prefill_on_the_busiest_instance_within_the_balance_bound():
    results = [
        result(4, 100, 0.25, 90),  # even, but saves little: its busiest prefills 90
        result(4, 900, 0.60, 10),  # the least bottleneck, but one instance takes 60%
        result(4, 500, 0.45, 40),  # within 2 x 25%, the least bottleneck of those
        result(4, 600, 0.50, 40),  # as little on its busiest, and saves more: preferred
        result(8, 50, 0.50, 5),
        result(8, 10, 0.40, 9),  # nothing within 2 x 12.5%: the most even
    ]
    assert recommend(results, 2.0) == [3, 5]
    assert recommend(results, 2.4) == [1, 5]
    assert recommend(results, 4.0) == [1, 4]


def test_the_report_is_its_stored_run_rendered(tmp_path, monkeypatch):
    from extproc.cli import main

    from .logs import record_log
    from .test_run import requests

    log = record_log(tmp_path / "traffic.log", requests(200))
    out = tmp_path / "out"
    argv = ["replay", str(log), "--instances", "3", "5", "--cache-tokens", "20000"]
    assert main([*argv, "--out", str(out), "--name", "r"]) == 0
    stored = json.loads((out / "r.json").read_text())
    assert stored["kind"] == "replay" and stored["records"] == 200
    assert len(stored["results"]) == 2 * 4 and len(stored["recommended"]) == 2
    assert (out / "r.png").stat().st_size > 0
    written = (out / "r.md").read_text()
    assert "(recommended)" in written and "prefix-router replay" in written
    (out / "r.md").unlink()
    report.rerender(out / "r.json")
    assert (out / "r.md").read_text() == written
