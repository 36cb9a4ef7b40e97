"""The fleet reports are renderings of their stored runs: every committed report renders
again from its JSON, byte for byte, and the renderer reads nothing but the document."""

import difflib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from extproc.bench import ceiling, fleet, fleet_render, report
from extproc.bench.fleet_results import ClosedLoopResult, PathResult, path_result
from extproc.bench.loadgen import RequestOutcome
from extproc.bench.workloads import WorkloadSpec, generate
from extproc.config import RouterConfig

BENCHMARKS = Path(__file__).parents[2] / "docs" / "benchmarks"
COMMITTED = (
    "long-context",
    "long-context-rate-16",
    "long-context-short-prefix",
    "conversations",
    "multi-tenant",
    "hot-spot",
)


def _stored_fleet_runs() -> list[Path]:
    paths = []
    for path in sorted(BENCHMARKS.glob("*.json")):
        with path.open() as file:
            head = file.read(200)
        if '"kind": "fleet"' in head:
            paths.append(path)
    return paths


def test_every_committed_fleet_report_is_a_stored_run():
    assert {p.stem for p in _stored_fleet_runs()} >= set(COMMITTED)


@pytest.mark.parametrize("json_path", _stored_fleet_runs(), ids=lambda p: p.stem)
def test_committed_report_renders_from_its_json_unchanged(json_path):
    document = json.loads(json_path.read_text())
    committed = json_path.with_suffix(".md").read_text()
    rendered = fleet_render.render_report(document)
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            rendered.splitlines(keepends=True),
            "committed",
            "rendered",
        )
    )
    assert rendered == committed, f"{json_path.name} renders differently:\n{diff}"


# A small synthetic document, pure data, as fleet.document stores it.


def _outcomes(ttfts_ms, hosts=("a:1", "b:1"), failed=0):
    outcomes = [
        {
            "group": f"doc-{i}",
            "status": 200,
            "ttft_s": ttft / 1000,
            "latency_s": ttft / 1000 + 1,
            "output_tokens": 10,
            "served_by": hosts[i % len(hosts)],
            "error": None,
        }
        for i, ttft in enumerate(ttfts_ms)
    ]
    outcomes += [
        {
            "group": "doc-x",
            "status": 503,
            "ttft_s": None,
            "latency_s": None,
            "output_tokens": 0,
            "served_by": None,
            "error": None,
        }
    ] * failed
    return outcomes


def _result(path, ttfts_ms, hit_rate, shares=(0.5, 0.5), **extra):
    """One path's stored result: ``ttfts_ms`` of successful requests over 10 s."""
    result = {
        "path": path,
        "outcomes": _outcomes(ttfts_ms),
        "wall_s": 10.0,
        "time_scale": 1.0,
        "hit_rate": hit_rate,
        "overflow_rate": None,
        "skipped": None,
        "shares": dict(zip(("a:1", "b:1"), shares, strict=False)),
        "overhead_ms": None,
        "index_estimate": None,
        "closed_loop": None,
        "overhead_pairs_ms": None,
    }
    result.update(extra)
    return result


def _skipped(path):
    return _result(path, [], 0.0, shares=(), wall_s=0.0, skipped="not installed")


def _document(results, workload="long-context", **top):
    spec = WorkloadSpec(name=workload, rate_per_s=8.0, duration_s=5.0)
    document = {
        "kind": "fleet",
        "format": 1,
        "name": "synthetic",
        "command": "prefix-router bench long-context --quick",
        "machine": "3 cores (Test CPU), 5 GiB, Linux test, Python 3.99",
        "workload": asdict(spec),
        "instances": 2,
        "time_scale": 1.0,
        "requests": len(generate(spec)),  # the ceiling replays the regenerated schedule
        "simulator": {
            "args": ["--timing", "model", "--time-scale", "1.0", "--capacity-blocks", "77"]
        },
        "router": {
            "concurrency_threshold": 21,
            "prefix_length": 999,
            "balance_factor": 2.5,
            "balance_min_in_flight": 6,
            "overload_cost": 0.75,
        },
        "our_paths": fleet.our_paths_document(tuple(r["path"] for r in results)),
        "session_header": "x-session-id",
        "overhead_probes": 0,
        "overhead_warm_up_pairs": 3,
        "closed_loop": {
            "concurrency": 0,
            "requests": 300,
            "time_scale": 4.0,
            "time_limit_s": 90.0,
            "paths": ["RANDOM", "PREFIX_AWARE", "envoy-ring-hash"],
        },
        "results": results,
    }
    document.update(top)
    return json.loads(json.dumps(document))  # as read back from the stored JSON


def _row(text, path):
    """``path``'s row of the main table (the first table)."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {path} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_main_table_from_the_results():
    text = fleet_render.render_report(
        _document(
            [
                _result("RANDOM", [100] * 10, 0.4),
                _result("PREFIX_AWARE", [50] * 10, 0.8, (0.3, 0.7), overflow_rate=0.1,
                        index_estimate=0.75),
            ]
        )
    )  # fmt: skip
    random_row, ours = _row(text, "RANDOM"), _row(text, "PREFIX_AWARE")
    assert random_row[1:4] == ["100", "100", "100"] and random_row[6] == "40.0%"
    assert ours[1] == "50" and ours[6:10] == ["80.0%", "75.0%", "30.0% to 70.0%", "10.0%"]
    assert ours[11] == "-50%"  # p50 against RANDOM's
    assert ours[4] == "1.00"  # 10 requests over 10 s
    assert "## Throughput at saturation" not in text and "Routing overhead" not in text


def test_the_ceiling_line_is_computed_from_the_workload():
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.8)], workload="hot-spot")
    found = ceiling.ceiling(generate(WorkloadSpec(**document["workload"])))
    assert found.over_cap  # the hot document takes about half the requests
    text = " ".join(fleet_render.render_report(document).split())
    assert (
        f"one instance with an unlimited cache would hit {found.hit_rate:.1%} of these "
        "requests' prompt tokens (cold misses only)" in text
    )
    assert (
        f"with no instance above 20% of requests, at most {found.capped_hit_rate:.1%} "
        f"(doc-0 carries {found.busiest_share:.1%} of them)." in text
    )


def test_the_ceiling_line_says_when_no_group_is_over_the_cap():
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.8)], workload="multi-tenant")
    text = " ".join(fleet_render.render_report(document).split())
    assert "so the bound is the same with no instance above 20%." in text


def test_no_ceiling_when_the_workload_generates_another_schedule():
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.8)])
    text = fleet_render.render_report(document | {"requests": document["requests"] + 1})
    assert "Ceiling: not computed, the `long-context` workload no longer generates" in text
    assert "unlimited cache" not in text


def test_a_skipped_path_is_a_row_that_says_so():
    text = fleet_render.render_report(
        _document([_result("RANDOM", [100] * 4, 0.4), _skipped("smg-cache-aware")])
    )
    assert _row(text, "smg-cache-aware")[1] == "skipped: not installed"


def test_without_random_there_is_no_comparison():
    text = fleet_render.render_report(_document([_result("PREFIX_AWARE", [50] * 4, 0.8)]))
    row = _row(text, "PREFIX_AWARE")
    assert row[11:14] == ["", "", ""]


def test_the_settings_and_machine_come_from_the_document(monkeypatch):
    def probe():
        raise AssertionError("the renderer probed the machine")

    monkeypatch.setattr(report, "machine_description", probe)
    text = fleet_render.render_report(_document([_result("PREFIX_AWARE", [50] * 4, 0.8)]))
    assert "- Machine: 3 cores (Test CPU), 5 GiB, Linux test, Python 3.99" in text
    assert "`concurrency_threshold` 21" in text and "`prefix_length` 999" in text
    assert "`balance_factor` 2.5" in text and "`overload_cost`\n  0.75" in text
    assert "`prefix-router sim --timing model --time-scale 1.0 --capacity-blocks 77`" in text
    assert "prefix-router bench long-context --quick" in text
    assert "270 ms" not in text and "2 shared cores" not in text
    assert "- Time: time_scale = 1, no compression" in text


def test_a_compressed_run_says_how_much_fixed_costs_are_inflated():
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.8)], time_scale=0.25)
    text = fleet_render.render_report(document)
    assert "time_scale = 0.25" in text and "appear 4 times larger" in text


def test_hot_spot_section_from_the_document():
    document = _document(
        [
            _result("PREFIX_AWARE", [50] * 10, 0.9, (0.4, 0.6), overflow_rate=0.2),
            _result("PREFIX_AWARE-no-overflow", [200] * 10, 0.95, (0.1, 0.9), overflow_rate=0.0),
        ],
        workload="hot-spot",
        simulator={"args": ["--timing", "model", "--max-num-seqs", "3"]},
    )
    text = fleet_render.render_report(document)
    section = text.split("## Overflow against the hot spot")[1].split("## Workload")[0]
    assert "(~4 of the\n~8 requests/s offered)" in section  # 50% of 8 requests/s
    assert "`concurrency_threshold` 1024, `balance_factor` null" in section
    assert "`balance_factor` 2.5" in section and "never\nbelow 6 in flight" in section
    assert "`overload_cost` 0.75" in section
    assert "| TTFT p50 (ms) | 50 | 200 | -75% |" in section
    assert "| hit rate | 90.0% | 95.0% | -5.0 points |" in section
    assert "| busiest instance's share | 60.0% | 90.0% |  |" in section
    assert "`--timing model --max-num-seqs 3`" in section
    assert "7.5" not in section and "70B" not in section


def test_streamed_section_compares_the_body_modes_from_the_document():
    document = _document(
        [
            _result("PREFIX_AWARE", [50] * 10, 0.9, (0.4, 0.6), overflow_rate=0.2),
            _result("PREFIX_AWARE-streamed", [60] * 10, 0.85, (0.45, 0.55), overflow_rate=0.25),
            _result("PREFIX_AWARE-no-overflow", [200] * 10, 0.95, (0.1, 0.9), overflow_rate=0.0),
        ],
        workload="hot-spot",
    )
    text = fleet_render.render_report(document)
    section = text.split("## Streamed bodies")[1].split("## Workload")[0]
    assert "TTFT p99 +20% against the buffered path" in section
    assert "| TTFT p50 (ms) | 50 | 60 | 200 |" in section
    assert "| busiest instance's share | 60.0% | 55.0% | 90.0% |" in section
    assert "| overflow | 20.0% | 25.0% | 0.0% |" in section
    assert (
        "`PREFIX_AWARE-streamed`: `routing_strategy` PREFIX_AWARE, Envoy body mode streamed" in text
    )
    # A path whose Envoy logs completions with buffered bodies says so; streamed ones always
    # log, and say their body mode only.
    logged, unlogged = "PREFIX_AWARE-stream-end-decision", "PREFIX_AWARE-stream-end-decision-no-log"
    document = _document(
        [_result(logged, [50] * 4, 0.9), _result(unlogged, [50] * 4, 0.9)], workload="hot-spot"
    )
    assert document["our_paths"][logged]["completion_log"] is True
    assert document["our_paths"][unlogged]["completion_log"] is False
    text = fleet_render.render_report(document)
    assert (
        "`PREFIX_AWARE-stream-end-decision`: `routing_strategy` PREFIX_AWARE, `stream_end` "
        "decision, Envoy reports completions to the router (`completion_log`)" in text
    )
    assert (
        "`PREFIX_AWARE-stream-end-decision-no-log`: `routing_strategy` PREFIX_AWARE, "
        "`stream_end` decision\n" in text
    )
    streamed = fleet.our_paths_document(("PREFIX_AWARE-streamed",))["PREFIX_AWARE-streamed"]
    assert streamed["completion_log"] is True
    # Without the streamed path, no section.
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.9)], workload="hot-spot")
    assert "## Streamed bodies" not in fleet_render.render_report(document)


def test_no_hot_spot_section_without_the_no_overflow_path():
    document = _document([_result("PREFIX_AWARE", [50] * 4, 0.9)], workload="hot-spot")
    assert "## Overflow against the hot spot" not in fleet_render.render_report(document)


def test_closed_loop_section():
    loop = {"concurrency": 16, "completed": 24, "failed": 0, "requests_per_s": 3.0,
            "tokens_per_s": 192.0, "hit_rate": 0.5, "ttft_p50_ms": 400.0}  # fmt: skip
    document = _document(
        [
            _result("RANDOM", [100] * 10, 0.4, closed_loop=loop),
            _result("PREFIX_AWARE", [50] * 20, 0.8, closed_loop=loop | {"requests_per_s": 6.0}),
            _result("envoy-ring-hash", [60] * 10, 0.8),
        ],
        closed_loop={"concurrency": 16, "requests": 24, "time_scale": 2.0, "time_limit_s": 30.0,
                     "paths": ["RANDOM", "PREFIX_AWARE"]},
    )  # fmt: skip
    text = fleet_render.render_report(document)
    section = text.split("## Throughput at saturation (closed loop)")[1]
    assert "completed 1.00 to 2.00 req/s" in section  # the open loop's range, computed
    assert "16 clients" in section and "first 24 requests" in section
    assert "at most\n30 s" in section and "runs 2 times slower" in section
    assert "| RANDOM | 3.00 | 192 | +0% | 50.0% | 400 | 24 | 0 |" in section
    assert "| PREFIX_AWARE | 6.00 | 192 | +100% |" in section
    assert "| envoy-ring-hash |" not in section.split("## Workload")[0]


def test_overhead_section_with_the_pairs_spread():
    document = _document(
        [
            _result("RANDOM", [100] * 4, 0.4, overhead_ms=1.5,
                    overhead_pairs_ms=[1.0, 1.5, 2.0, 3.0, 1.2]),
            _result("envoy-ring-hash", [100] * 4, 0.4, overhead_ms=0.25),
        ],
        overhead_probes=5,
    )  # fmt: skip
    text = fleet_render.render_report(document)
    assert _row(text, "RANDOM")[14] == "+1.50"
    assert "5 times through the path and 5 times straight to one" in text
    assert "after 3 warm-up pairs" in text
    assert "| RANDOM | 5 | +1.20 | +1.50 | +2.00 |" in text  # quartiles of the pairs
    assert "noise" not in text and "2 shared cores" not in text


def test_replicas_section():
    document = _document(
        [
            _result("PREFIX_AWARE", [50] * 4, 0.8),
            _result("PREFIX_AWARE-two-replicas", [50] * 4, 0.7),
        ]
    )
    text = fleet_render.render_report(document)
    assert "over 2\nrouter processes" in text
    assert "Hit rate 70.0% against 80.0% for one replica: -10.0\npoints." in text


def test_a_document_of_another_kind_or_format_is_refused():
    document = _document([_result("RANDOM", [100] * 4, 0.4)])
    with pytest.raises(ValueError, match="format"):
        fleet_render.render_report(document | {"format": 2})
    with pytest.raises(ValueError, match="kind"):
        fleet_render.render_report({k: v for k, v in document.items() if k != "kind"})


def test_render_plots_writes_both_plots(tmp_path):
    document = _document([_result("RANDOM", [100, 200, 300], 0.4), _skipped("smg-cache-aware")])
    paths = fleet_render.render_plots(document, tmp_path)
    assert paths == [tmp_path / "synthetic-ttft.png", tmp_path / "synthetic-share.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerender_writes_the_report_beside_the_json(tmp_path):
    json_path = tmp_path / "synthetic.json"
    document = _document([_result("RANDOM", [100, 200], 0.4)])
    json_path.write_text(json.dumps(document))
    assert fleet.rerender(json_path) == tmp_path / "synthetic.md"
    assert (tmp_path / "synthetic.md").read_text() == fleet_render.render_report(document)
    assert (tmp_path / "synthetic-ttft.png").exists()
    assert (tmp_path / "synthetic-share.png").exists()


def _outcome(ttft_s, served_by):
    return RequestOutcome("doc-0", 200, ttft_s, ttft_s + 1, 8, served_by)


def test_write_report_stores_the_run_then_renders_what_it_stored(tmp_path):
    results = [
        PathResult("RANDOM", [_outcome(0.2, "a:1"), _outcome(0.3, "b:1")], 2.0, 1.0, 0.4,
                   overflow_rate=0.0, shares={"a:1": 0.5, "b:1": 0.5}),
        PathResult("PREFIX_AWARE", [_outcome(0.1, "a:1")], 2.0, 1.0, 0.9, overflow_rate=0.0,
                   shares={"a:1": 1.0, "b:1": 0.0}, overhead_ms=0.5,
                   overhead_pairs_ms=[0.4, 0.5, 0.6],
                   closed_loop=ClosedLoopResult(4, 8, 0, 2.0, 16.0, 0.8, 120.0)),
    ]  # fmt: skip
    options = fleet.FleetBenchOptions(
        workload=WorkloadSpec(name="hot-spot", rate_per_s=4.0, duration_s=2.0),
        instances=2,
        sim_args=fleet.default_sim_args("hot-spot"),
        paths=("RANDOM", "PREFIX_AWARE"),
        out_dir=tmp_path,
        command="prefix-router bench hot-spot",
        overhead_probes=3,
        closed_loop_concurrency=4,
        report_name="stored",
    )
    path = fleet.write_report(options, results, 3)
    document = json.loads((tmp_path / "stored.json").read_text())
    assert document["kind"] == "fleet" and document["format"] == 1
    assert document["machine"] == report.machine_description()
    defaults = RouterConfig()
    assert document["router"] == {
        "concurrency_threshold": options.concurrency_threshold,
        "prefix_length": options.prefix_length,
        "balance_factor": defaults.balance_factor,
        "balance_min_in_flight": defaults.balance_min_in_flight,
        "overload_cost": defaults.overload_cost,
        "kv_events": defaults.kv_events,
    }
    assert document["simulator"]["args"][-2:] == ["--max-num-seqs", "16"]
    assert document["closed_loop"]["concurrency"] == 4 and document["overhead_probes"] == 3
    assert document["our_paths"]["PREFIX_AWARE"] == {
        "settings": {"routing_strategy": "PREFIX_AWARE"},
        "replicas": 1,
        "body_mode": "buffered-partial",
        "completion_log": False,
    }
    assert [path_result(r) for r in document["results"]] == results
    assert path.read_text() == fleet_render.render_report(document)
    assert (tmp_path / "stored-ttft.png").exists() and (tmp_path / "stored-share.png").exists()


def test_the_simulators_cache_size_can_be_set_below_the_working_set():
    assert fleet.default_sim_args("long-context") == ("--capacity-blocks", "4000")
    assert fleet.default_sim_args("long-context", 1500) == ("--capacity-blocks", "1500")
    # The hot spot keeps its own arguments beside a smaller cache.
    assert fleet.default_sim_args("hot-spot", 1500)[:2] == ("--capacity-blocks", "1500")
    assert "--max-num-seqs" in fleet.default_sim_args("hot-spot", 1500)
    with pytest.raises(ValueError, match="capacity_blocks"):
        fleet.default_sim_args("long-context", 0)
