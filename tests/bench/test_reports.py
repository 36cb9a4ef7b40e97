"""Every committed report is a rendering of its stored run: rendering the JSON again
gives the committed markdown back, byte for byte."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from extproc.bench import ceiling, headline, reliability_report, report
from extproc.bench.workloads import WorkloadSpec, generate

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
# Pages that are not one run's report.
NOT_REPORTS = {"README.md"}
# The reliability page renders the soak and every saturation ladder on one page.
RELIABILITY = {
    "reliability.md": (
        "reliability-soak.json",
        "reliability-saturation.json",
        "reliability-saturation-32768.json",
    ),
}


def _reports() -> list[str]:
    return sorted(p.name for p in REPORTS.glob("*.md") if p.name not in NOT_REPORTS)


def test_every_report_has_its_stored_run():
    for name in _reports():
        stored = RELIABILITY.get(name, (name.removesuffix(".md") + ".json",))
        for part in stored:
            assert (REPORTS / part).exists(), f"{name} has no stored run ({part})"


@pytest.mark.parametrize("name", [n for n in _reports() if n not in RELIABILITY])
def test_report_is_its_stored_run_rendered(name, tmp_path):
    stem = name.removesuffix(".md")
    data = json.loads((REPORTS / f"{stem}.json").read_text())
    assert data.get("kind") in report.RENDERERS, f"{stem}.json does not name its generator"
    shutil.copy(REPORTS / f"{stem}.json", tmp_path)
    rendered = report.rerender(tmp_path / f"{stem}.json")
    assert rendered.read_text() == (REPORTS / name).read_text(), (
        f"docs/benchmarks/{name} is not its JSON rendered: re-run its command, or "
        f"`prefix-router bench render docs/benchmarks/{stem}.json` (never edit it by hand)"
    )


def test_reliability_page_is_its_stored_runs_rendered():
    soak = json.loads((REPORTS / "reliability-soak.json").read_text())
    saturations = reliability_report.saturations(REPORTS)
    # Every stored ladder is on the page, the main one (8 KiB bodies) first.
    stored = sorted(p.name for p in REPORTS.glob("reliability-saturation*.json"))
    assert stored == sorted(RELIABILITY["reliability.md"][1:])
    assert [s["options"]["body_bytes"] for s in saturations] == [8192, 32768]
    committed = (REPORTS / "reliability.md").read_text()
    assert reliability_report.render_text(soak, *saturations) == committed


def test_headline_page_is_the_stored_runs_rendered():
    committed = (REPORTS / headline.PAGE).read_text()
    assert headline.render(headline.load_runs(REPORTS)) == committed, (
        "docs/benchmarks/README.md is stale: prefix-router bench render"
    )


def _fleet_run(hit_rates: dict[str, float]) -> dict[str, object]:
    outcome = {"status": 200, "error": None, "ttft_s": 0.1}
    return {
        "machine": "m",
        "results": [
            {"path": path, "hit_rate": rate, "shares": {"a": 0.5, "b": 0.5},
             "outcomes": [outcome], "time_scale": 1.0, "skipped": None}
            for path, rate in hit_rates.items()
        ],
    }  # fmt: skip


@pytest.mark.parametrize(("ours", "met"), [(0.85, True), (0.80, False)])
def test_headline_targets_are_computed_from_the_runs(ours, met):
    run = _fleet_run({"PREFIX_AWARE": ours, "envoy-ring-hash": 0.82, "smg-cache-aware": 0.81})
    (row, *_) = headline.rows({"long-context": run})
    assert (row.ours, row.peer, row.met) == (f"{ours:.1%}", "ring_hash 82.0%", met)
    shares = next(r for r in headline.rows({"long-context": run}) if "busiest" in r.measure)
    assert (shares.ours, shares.met) == ("50.0%", False)  # two hosts: 50% each, over 20%


def test_headline_hit_rate_rows_carry_the_runs_computed_ceilings():
    spec = WorkloadSpec(name="long-context", rate_per_s=8.0, duration_s=5.0)
    run = _fleet_run({"PREFIX_AWARE": 0.8, "envoy-ring-hash": 0.82}) | {
        "workload": asdict(spec),
        "simulator": {"args": []},
        "requests": len(generate(spec)),
    }
    found = ceiling.stored_ceiling(run)
    assert found is not None and found.over_cap
    hit_rate, busiest, *_ = headline.rows({"long-context": run})
    assert hit_rate.ceiling == (
        f"{found.hit_rate:.1%}; at most {found.capped_hit_rate:.1%} with no instance above 20%"
    )
    assert hit_rate.met is False and busiest.ceiling == ""  # the targets are judged as before
    # A run that names no workload has no ceiling to show.
    (row, *_) = headline.rows({"long-context": _fleet_run({"PREFIX_AWARE": 0.8})})
    assert row.ceiling == ""


@pytest.mark.parametrize(
    ("growth", "requests", "met"),
    [(0.017, 1_001_239, True), (0.12, 1_001_239, False), (0.017, 200_000, False)],
)
def test_headline_soak_row_needs_a_million_requests_within_the_bound(growth, requests, met):
    run = {"growth": {"router": growth}, "requests": requests, "options": {"max_rss_growth": 0.1}}
    (row,) = headline.rows({"reliability-soak": run})
    assert (row.ours, row.met) == (f"{growth:+.1%}", met)


def test_headline_production_rows_read_the_concurrency_and_bodies_runs():
    held = {"level": 3000, "held": True}
    run = {"levels": [{"level": 1000, "held": True}, held, {"level": 4000, "held": False}]}
    (row,) = headline.rows({"concurrency": run})
    assert (row.ours, row.met) == ("3,000 held", True)
    (row,) = headline.rows({"concurrency": {"levels": [{"level": 1000, "held": True}]}})
    assert row.met is False
    (row,) = headline.rows({"concurrency-epp-kgateway": run})
    assert (row.ours, row.met) == ("3,000 held", True) and "picker" in row.measure
    options = {"refuse_bound_s": 2.0, "drip_pieces": 16, "drip_pause_s": 0.02}
    delivered = {"outcome": "delivered", "s": 0.1}
    hung = {"outcome": "hung", "s": 30}
    cells = [
        {"size": 10, "upload": "fixed", "results": [delivered]},
        {"size": 2**26 + 1, "upload": "fixed", "results": [hung]},
    ]
    run = {"cells": cells, "options": options, "max_body_bytes": 2**26}
    (row,) = headline.rows({"bodies": run})
    assert (row.ours, row.met) == ("2 requests, 1 hung, not all", False)


def test_headline_replica_rows_hold_each_count_with_events_to_one_replica():
    run = _fleet_run(
        {
            "PREFIX_AWARE": 0.815,
            "PREFIX_AWARE-two-replicas": 0.802,
            "PREFIX_AWARE-four-replicas": 0.809,
            "PREFIX_AWARE-approximate": 0.800,
            "PREFIX_AWARE-two-replicas-approximate": 0.794,
        }
    )
    estimates = {"PREFIX_AWARE-two-replicas": 0.84, "PREFIX_AWARE-four-replicas": 0.815}
    for result in run["results"]:  # type: ignore[attr-defined]
        result["index_estimate"] = estimates.get(result["path"])
    run["our_paths"] = {
        "PREFIX_AWARE-two-replicas": {"replicas": 2},
        "PREFIX_AWARE-four-replicas": {"replicas": 4},
    }
    two, two_estimate, four, four_estimate = headline.rows({"replicas-long-context": run})
    # Without events, two replicas are compared with one approximate replica.
    assert (two.ours, two.met) == ("-1.3 points (80.2% vs 81.5%); without events -0.6", False)
    assert (two_estimate.ours, two_estimate.met) == ("+3.8 points", False)
    assert (four.ours, four.met) == ("-0.6 points (80.9% vs 81.5%)", True)
    assert (four_estimate.ours, four_estimate.met) == ("+0.6 points", True)


def test_headline_kv_event_cost_rows_read_the_stored_run():
    run = {
        "options": {"prompt_chars": 32768},
        "request_path": [
            {"mode": "approximate", "lookup_us": 2.0, "record_us": 3.5},
            {"mode": "kv-events", "lookup_us": 5.5, "record_us": 3.5},
        ],
        "ingest": [
            {"decoder": "byte-level BPE", "cpu_us_per_block": [3.7, 2.3, 2.2]},
            {"decoder": "simulator code points", "cpu_us_per_block": [2.0, 2.1, 2.0]},
        ],
    }
    path, ingest = headline.rows({"kv-events": run})
    assert (path.ours, path.met) == ("+3.5 µs", True)
    assert (ingest.ours, ingest.met) == ("0.23 core (byte-level BPE)", True)
    run["ingest"][0]["cpu_us_per_block"] = [3.0, 2.6, 2.7]  # type: ignore[index]
    (_, ingest) = headline.rows({"kv-events": run})
    assert (ingest.ours, ingest.met) == ("0.27 core (byte-level BPE)", False)
