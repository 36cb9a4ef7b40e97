"""The real-vLLM report's arithmetic on made-up runs: worker paths, their bound against one
router process, the run order, and the restart section (tests/vllm runs the real thing)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from extproc.bench import headline, real_vllm
from extproc.bench.real_vllm import (
    SINGLE,
    PathResult,
    RealVllmOptions,
    path_workers,
    paths_of,
    run_order,
    shares_decisions,
    unshared_path,
    workers_allowance,
    workers_difference,
    workers_path,
)
from extproc.bench.real_vllm_peers import SMG_CACHE_AWARE, VLLM_ROUTER_KV_AWARE
from extproc.bench.real_vllm_restart import RestartResult

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
HOSTS = ("127.0.0.21:8200", "127.0.0.22:8200", "127.0.0.23:8200")


def path(name: str, hit_rate: float, scenario: str = "rag", **moved: int) -> PathResult:
    return PathResult(
        scenario=scenario,
        path=name,
        requests=45,
        hit_rate=hit_rate,
        served=dict.fromkeys(HOSTS, 15),
        hosts_per_group={"doc-0": [HOSTS[0]]},
        ttft_ms=[100.0],
        seconds=10.0,
        **moved,
    )


def test_a_workers_path_names_its_worker_count():
    for workers in (2, 4, 16):
        assert path_workers(workers_path(workers)) == workers
    assert path_workers("PREFIX_AWARE") == path_workers("RANDOM-shadowing") == 1


def test_an_unshared_path_names_its_worker_count_and_shares_nothing():
    for workers in (2, 4):
        assert path_workers(unshared_path(workers)) == workers
        assert not shares_decisions(unshared_path(workers))
        assert shares_decisions(workers_path(workers))
    assert unshared_path(4) == "PREFIX_AWARE, 4 workers, unshared"
    options = RealVllmOptions(scenarios=("rag",), router_workers=(2, 4), unshared_workers=(4,))
    assert paths_of("rag", options, peers=())[-3:] == (
        workers_path(2),
        workers_path(4),
        unshared_path(4),
    )
    assert unshared_path(4) not in paths_of("rag", RealVllmOptions(), peers=())


def test_the_unshared_comparison_is_reported_but_is_no_target():
    results = [
        path(SINGLE, 0.5),
        path("PREFIX_AWARE", 0.60),
        path(workers_path(4), 0.60),
        path(unshared_path(4), 0.50),
    ]
    data = {
        "kind": "real-vllm",
        "options": asdict(RealVllmOptions(out_dir=None, unshared_workers=(4,))),
        "machine": "test",
        "results": [asdict(r) for r in results],
    }
    text = real_vllm.render(data)
    assert "| rag | PREFIX_AWARE, 4 workers, unshared | 45 | 50.0% | 100% | -10.0 |" in text
    assert "The workers share their decisions" in text
    rows = list(headline._real_vllm_rows({"real-vllm-cpu": data}))
    assert [r.measure for r in rows if "workers" in r.measure] == [
        "real vLLM (CPU), rag: 4 workers vs one router process"
    ]


def test_workers_are_held_to_two_points_plus_a_request_per_request_moved_by_load():
    one = path("PREFIX_AWARE", 0.60)
    results = [one, path(workers_path(2), 0.63), path(workers_path(4), 0.60, failed_open=1)]
    assert workers_difference(results, "rag", workers_path(2)) == pytest.approx(3.0)
    assert workers_difference(results, "rag", "PREFIX_AWARE") is None
    assert workers_allowance(results, "rag", workers_path(2)) == 2.0
    # One request failed open: one request's share (100 / 45 points) more.
    assert workers_allowance(results, "rag", workers_path(4)) == pytest.approx(2 + 100 / 45)


def test_routed_paths_run_first_and_the_single_instance_paths_last():
    options = RealVllmOptions(scenarios=("documents", "rag"), router_workers=(2,))
    order = run_order(options)
    singles = [pair for pair in order if pair[1] == SINGLE]
    assert order[-2:] == singles == [("documents", SINGLE), ("rag", SINGLE)]
    assert ("documents", workers_path(2)) in order and ("rag", "RANDOM") in order
    # Every path of every scenario, once.
    assert (
        len(order)
        == len(set(order))
        == sum(len(real_vllm.paths_of(s, options)) for s in options.scenarios)
    )


def restart(after: float, served_after: int) -> RestartResult:
    return RestartResult(
        workers=2,
        victim=HOSTS[2],
        blocks_before=[120, 120],
        cleared_s=6.4,
        rejoined_s=41.0,
        hit_rate_before=0.81,
        hit_rate_after=after,
        served_before=dict.fromkeys(HOSTS, 12),
        served_after={**dict.fromkeys(HOSTS, 12), HOSTS[2]: served_after},
    )


def test_the_routing_recovered_only_if_the_hit_rate_came_back_and_the_instance_serves():
    assert restart(0.9, 12).recovered
    assert not restart(0.7, 12).recovered
    assert not restart(0.9, 0).recovered


def test_the_report_and_the_headline_show_workers_and_the_restart():
    results = [
        path(SINGLE, 0.5),
        path("RANDOM", 0.3),
        path("PREFIX_AWARE", 0.60),
        path(workers_path(2), 0.605),
    ]
    data = {
        "kind": "real-vllm",
        "options": asdict(RealVllmOptions(out_dir=None)),
        "machine": "test",
        "results": [asdict(r) for r in results],
        "restart": asdict(restart(0.9, 12)),
    }
    text = real_vllm.render(data)
    assert "| rag | PREFIX_AWARE, 2 workers | 45 | 60.5% | 121% | +0.5 | 0 |" in text
    assert "One instance restarted under 2 router workers" in text
    assert "**6.40 s** after the kill" in text and "**yes**" in text
    rows = list(headline._real_vllm_rows({"real-vllm-cpu": data}))
    (workers_row,) = [r for r in rows if "2 workers" in r.measure]
    assert workers_row.met and "+0.5" in workers_row.ours
    (restart_row,) = [r for r in rows if "restarted" in r.measure]
    assert restart_row.met and restart_row.ours.startswith("6.4 s; 90.0% vs 81.0%")


def test_the_peers_are_set_against_one_router_process():
    results = [
        path(SINGLE, 0.5),
        path("PREFIX_AWARE", 0.60),
        path(workers_path(2), 0.60),
        path(SMG_CACHE_AWARE, 0.55),
        replace(path(VLLM_ROUTER_KV_AWARE, 0.62), hosts_per_group={}),
        path("PREFIX_AWARE", 0.70, scenario="documents"),
        path(SINGLE, 0.7, scenario="documents"),
    ]
    assert real_vllm.peer_difference(results, "rag") == (VLLM_ROUTER_KV_AWARE, pytest.approx(-2.0))
    assert real_vllm.peer_difference(results, "documents") is None
    data = {
        "kind": "real-vllm",
        "options": asdict(RealVllmOptions(out_dir=None)),
        "machine": "test",
        "results": [asdict(r) for r in results],
        "restart": None,
    }
    text = real_vllm.render(data)
    assert "| rag | 60.0% | 60.0% | 55.0% | 62.0% | -2.0 (vllm-router kv_aware) |" in text
    # A peer's groups are not known (no header names its choice), and the table says so.
    (kv_row,) = [
        ln for ln in text.splitlines() if ln.startswith(f"| rag | {VLLM_ROUTER_KV_AWARE} |")
    ]
    assert "not known" in kv_row
    (row,) = [r for r in headline._real_vllm_rows({"real-vllm-cpu": data}) if "peers" in r.measure]
    assert not row.met and row.peer == "62.0% (vllm-router kv_aware)" and "-2.0" in row.ours


def test_peers_run_on_every_scenario_before_the_single_instance_paths():
    options = RealVllmOptions(scenarios=("documents", "rag"), router_workers=(2,))
    order = run_order(options, (SMG_CACHE_AWARE,))
    assert ("rag", SMG_CACHE_AWARE) in order and ("documents", SMG_CACHE_AWARE) in order
    assert ("rag", VLLM_ROUTER_KV_AWARE) not in order  # not installed, say
    assert order.index(("rag", SMG_CACHE_AWARE)) < order.index(("documents", SINGLE))


def test_views_that_never_cleared_are_reported_as_such():
    never = RestartResult(**{**asdict(restart(0.9, 12)), "cleared_s": None})
    assert not never.recovered
    text = real_vllm._restart_section(asdict(never))
    assert "**not** within 120 s after the kill" in text and "**no**" in text


def test_the_stored_report_has_random_lose_part_of_one_instances_hit_rate():
    """The CI tier runs RANDOM on documents alone (tests/vllm/tier.py); on the scenarios
    it checks without it, the stored report is the comparison's evidence."""
    stored = json.loads((REPORTS / "real-vllm-cpu.json").read_text())
    rates = {(r["scenario"], r["path"]): r["hit_rate"] for r in stored["results"]}
    for scenario in ("rag", "conversations"):
        assert rates[scenario, "RANDOM"] < rates[scenario, SINGLE] - 0.05, scenario


def test_random_runs_only_on_the_scenarios_asked_for():
    options = RealVllmOptions(router_workers=(), peers=(), random_scenarios=("documents",))
    assert "RANDOM" in paths_of("documents", options)
    assert "RANDOM" not in paths_of("rag", options)
    assert "RANDOM" in paths_of("rag", replace(options, random_scenarios=None))
