"""docs/benchmarks/README.md: the headline table, rendered from the stored runs.

Each row names a measure, its target, and how to read ours and the best peer's value from
the stored runs (the JSON beside each report). Whether a target is met is computed here
from those values; nothing on the page is typed by hand.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extproc.bench import real_vllm
from extproc.bench.ceiling import SHARE_CAP, stored_ceiling
from extproc.bench.fleet_paths import (
    APPROXIMATE,
    FOUR_REPLICAS,
    FOUR_REPLICAS_APPROXIMATE,
    TWO_REPLICAS,
    TWO_REPLICAS_APPROXIMATE,
)
from extproc.bench.kv_events import TARGET_BLOCKS_PER_S, TARGET_CORE_SHARE
from extproc.bench.prefix_index import lookup_insert_us

PAGE = "README.md"
OURS = "PREFIX_AWARE"
FIXED = "PREFIX_AWARE-fixed"
# bench replicas: each replica count with the engines' KV events, and its approximate twin.
REPLICAS_REPORTS = (
    ("replicas-long-context", "long-context"),
    ("replicas-conversations", "conversations"),
    ("replicas-long-context-small-caches", "long-context, caches smaller than the working set"),
)
REPLICA_PATHS = (
    (TWO_REPLICAS, TWO_REPLICAS_APPROXIMATE),
    (FOUR_REPLICAS, FOUR_REPLICAS_APPROXIMATE),
)
RING = "envoy-ring-hash"
# The peers that route by the prompt or by the client's session id.
PEERS = ("envoy-ring-hash", "vllm-router-consistent-hash", "vllm-router-cache-aware",
         "smg-cache-aware")  # fmt: skip
SHORT = {
    "envoy-ring-hash": "ring_hash",
    "vllm-router-consistent-hash": "consistent_hash",
    "vllm-router-cache-aware": "vllm-router cache_aware",
    "smg-cache-aware": "smg",
}

Runs = Mapping[str, dict[str, Any]]


# --- reading a fleet run ----------------------------------------------------------------


def _result(run: dict[str, Any], path: str) -> dict[str, Any] | None:
    results: list[dict[str, Any]] = run["results"]
    for result in results:
        if result["path"] == path and not result.get("skipped"):
            return result
    return None


def _ttft_percentile(result: dict[str, Any], q: float) -> float:
    # As the fleet report computes it: model-time TTFTs of the requests that succeeded.
    scale = result.get("time_scale") or 1.0
    values = sorted(
        o["ttft_s"] * 1000 / scale
        for o in result["outcomes"]
        if o["status"] == 200 and not o.get("error") and o.get("ttft_s")
    )
    return float(values[min(len(values) - 1, int(q * len(values)))]) if values else math.nan


def _max_share(result: dict[str, Any]) -> float:
    return float(max(result["shares"].values()))


def _best(
    run: dict[str, Any], measure: Callable[[dict[str, Any]], float], lowest: bool
) -> tuple[str, float] | None:
    found = [(p, measure(r)) for p in PEERS if (r := _result(run, p)) is not None]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda item: item[1])


@dataclass(frozen=True)
class Row:
    measure: str
    target: str
    ours: str
    peer: str
    met: bool | None  # None: reported, no target
    reports: tuple[str, ...]
    ceiling: str = ""  # hit-rate rows: the run's computed hit-rate ceilings


def _ceiling_cell(run: dict[str, Any]) -> str:
    """The run's hit-rate ceilings (``extproc.bench.ceiling``), or nothing if not computed."""
    found = stored_ceiling(run)
    if found is None:
        return ""
    cap = f"{found.share_cap:.0%}"
    if not found.over_cap:
        return f"{found.hit_rate:.1%} (the same with no instance above {cap})"
    return f"{found.hit_rate:.1%}; at most {found.capped_hit_rate:.1%} with no instance above {cap}"


def _percent(value: float) -> str:
    return f"{value:.1%}"


def _fleet_row(
    runs: Runs,
    report: str,
    measure: str,
    read: Callable[[dict[str, Any]], float],
    fmt: Callable[[float], str],
    lowest: bool,
    target: str,
    bound: float | None = None,
    peer_by_hit_rate: bool = False,
    with_ceiling: bool = False,
) -> Row | None:
    """One measure of our path against the best peer's in the same run (or, with
    ``peer_by_hit_rate``, against the peer with the best hit rate: a balance measure is
    only worth comparing with a peer that also keeps the cache); ``with_ceiling`` adds the
    run's hit-rate ceilings, for a hit-rate measure."""
    run = runs.get(report)
    ours = _result(run, OURS) if run else None
    if run is None or ours is None:
        return None
    value = read(ours)
    if peer_by_hit_rate:
        top = _best(run, lambda r: r["hit_rate"], lowest=False)
        peer_result = _result(run, top[0]) if top else None
        best = (top[0], read(peer_result)) if top and peer_result else None
    else:
        best = _best(run, read, lowest)
    peer = f"{SHORT[best[0]]} {fmt(best[1])}" if best else ""
    if bound is not None:
        met = value <= bound if lowest else value >= bound
    elif best is None:
        met = None
    else:
        met = value <= best[1] if lowest else value >= best[1]
    ceiling = _ceiling_cell(run) if with_ceiling else ""
    return Row(measure, target, fmt(value), peer, met, (report,), ceiling)


def _fleet_rows(runs: Runs, report: str, label: str) -> Iterable[Row | None]:
    yield _fleet_row(runs, report, f"{label} hit rate", lambda r: r["hit_rate"], _percent,
                     False, "≥ best peer", with_ceiling=True)  # fmt: skip
    yield _fleet_row(runs, report, f"{label} busiest instance", _max_share, _percent, True,
                     "≤ 20%", bound=0.20, peer_by_hit_rate=True)  # fmt: skip
    yield _fleet_row(runs, report, f"{label} P90 TTFT", lambda r: _ttft_percentile(r, 0.9),
                     lambda v: f"{v:.0f} ms", True, "≤ best peer")  # fmt: skip


def _saturation_row(runs: Runs) -> Row | None:
    run = runs.get("long-context-rate-16")
    if run is None:
        return None
    rates = {
        r["path"]: r["closed_loop"]["requests_per_s"]
        for r in run["results"]
        if r.get("closed_loop") and not r.get("skipped")
    }
    if OURS not in rates or "RANDOM" not in rates:
        return None
    gain = rates[OURS] / rates["RANDOM"] - 1
    peers = [(p, rates[p] / rates["RANDOM"] - 1) for p in PEERS if p in rates]
    best = max(peers, key=lambda item: item[1]) if peers else None
    return Row(
        "long-context throughput at saturation vs RANDOM (closed loop)",
        "≥ +15%",
        f"{gain:+.0%}",
        f"{SHORT[best[0]]} {best[1]:+.0%}" if best else "",
        gain >= 0.15,
        ("long-context-rate-16",),
    )


def _replicas_row(runs: Runs, report: str, label: str) -> Row | None:
    run = runs.get(report)
    one = _result(run, OURS) if run else None
    two = _result(run, TWO_REPLICAS) if run else None
    if one is None or two is None:
        return None
    points = (two["hit_rate"] - one["hit_rate"]) * 100
    return Row(
        f"two router replicas vs one, {label}",
        "within 3 points",
        f"{points:+.1f} points ({two['hit_rate']:.1%} vs {one['hit_rate']:.1%})",
        "",
        points >= -3,
        (report,),
    )


def _prefix_index_row(runs: Runs) -> Row | None:
    run = runs.get("prefix-index")
    if run is None:
        return None
    default = run["default_block_bytes"]
    fewest = min(c["hosts"] for c in run["costs"])
    (cost,) = [c for c in run["costs"] if c["block_bytes"] == default and c["hosts"] == fewest]
    total = lookup_insert_us(cost)
    chars = run["options"]["prompt_chars"]
    return Row(
        f"prefix index lookup + insert, {chars:,}-character prompt, p50",
        "≤ 50 µs",
        f"{total:.1f} µs ({default}-byte blocks, {fewest} hosts)",
        "",
        total <= 50,
        ("prefix-index",),
    )


def _real_vllm_rows(runs: Runs) -> Iterable[Row]:
    run = runs.get("real-vllm-cpu")
    if run is None:
        return
    by = {(r["scenario"], r["path"]): r for r in run["results"]}
    for scenario in ("rag", "conversations"):
        ours, alone = by.get((scenario, OURS)), by.get((scenario, "single-instance"))
        if ours is None or alone is None:
            continue
        ratio = ours["hit_rate"] / alone["hit_rate"] if alone["hit_rate"] else math.nan
        served = ours["served"]
        shares = [count / ours["requests"] for count in served.values()]
        yield Row(
            f"real vLLM (CPU), {scenario}: hit rate vs one instance alone; smallest share",
            "≥ 90%; every instance ≥ 20%",
            f"{ours['hit_rate']:.1%} vs {alone['hit_rate']:.1%} ({ratio:.0%}); {min(shares):.0%}",
            "",
            ratio >= 0.9 and min(shares) >= 0.2,
            ("real-vllm-cpu",),
        )
    restart = run.get("restart")
    if restart is not None:
        from extproc.bench.real_vllm_restart import RestartResult

        result = RestartResult(**restart)
        yield Row(
            f"real vLLM (CPU), one instance killed and restarted under {result.workers} "
            "router workers: its entries out of every view; hit rate after vs before",
            "measured; recovers",
            f"{'not cleared' if result.cleared_s is None else f'{result.cleared_s:.1f} s'}; "
            f"{result.hit_rate_after:.1%} vs "
            f"{result.hit_rate_before:.1%} (back in every view {result.rejoined_s:.0f} s "
            "after its start)",
            "",
            result.recovered,
            ("real-vllm-cpu",),
        )
    # Router workers against one router process (issue 26): every worker count run.
    results = [real_vllm.PathResult(**r) for r in run["results"]]
    # The peers on the same requests (issue 26): ours against the best of them.
    for scenario in dict.fromkeys(r.scenario for r in results):
        found = real_vllm.peer_difference(results, scenario)
        if found is None:
            continue
        best, points = found
        peer = by[scenario, best]
        yield Row(
            f"real vLLM (CPU), {scenario}: hit rate vs the peers (one router process)",
            "≥ the best peer",
            f"{by[scenario, OURS]['hit_rate']:.1%} ({points:+.1f})",
            f"{peer['hit_rate']:.1%} ({best})",
            points >= 0,
            ("real-vllm-cpu",),
        )
    for scenario, path in by:
        ours, many = by.get((scenario, OURS)), by[scenario, path]
        if ours is None or not path.startswith(OURS + ", ") or not real_vllm.shares_decisions(path):
            continue
        points = 100 * (many["hit_rate"] - ours["hit_rate"])
        allowed = real_vllm.workers_allowance(results, scenario, path)
        moved = f"; {allowed:.1f} allowed for requests moved by load" if allowed > 2 else ""
        yield Row(
            f"real vLLM (CPU), {scenario}: {path.removeprefix(OURS + ', ')} vs one router process",
            f"within {real_vllm.WORKERS_POINTS:g} points",
            f"{many['hit_rate']:.1%} vs {ours['hit_rate']:.1%} ({points:+.1f}{moved})",
            "",
            abs(points) <= allowed,
            ("real-vllm-cpu",),
        )


def _sim_vs_vllm_row(runs: Runs) -> Row | None:
    run = runs.get("sim-vs-vllm")
    if run is None:
        return None
    same = all(c["vllm"] == c["simulator"] for c in run["comparisons"])
    names = ", ".join(c["name"] for c in run["comparisons"])
    return Row(
        f"simulator vs real vLLM prefix-cache accounting ({names})",
        "same counts, request by request",
        "identical" if same else "different",
        "",
        same,
        ("sim-vs-vllm",),
    )


def _fleet_events_row(runs: Runs) -> Row | None:
    run = runs.get("fleet-events")
    if run is None:
        return None
    rounds = run["rounds"]
    moved = max(r["cached_moved_3_to_4"] for r in rounds)
    taken = min(r["new_on_4th"] for r in rounds)
    return Row(
        "fleet events: cached prefixes moved when a 4th instance joins; new prefixes it takes",
        "0; ≥ 1/4",
        f"{moved:.3f}; {taken:.3f} (worst of {len(rounds)} rounds)",
        "",
        moved == 0 and taken >= 0.25,
        ("fleet-events",),
    )


def _kv_events_replica_rows(runs: Runs, report: str, label: str) -> Iterable[Row | None]:
    """Router replicas reading the engines' KV events against one replica (the KV-events
    issue: within 1 point, and the routers' own estimate within 1 point of the engines')."""
    run = runs.get(report)
    one = _result(run, OURS) if run else None
    if run is None or one is None:
        return
    # The approximate paths are compared with one approximate replica, as in the report.
    one_approximate = _result(run, APPROXIMATE) or one
    for path, approximate in REPLICA_PATHS:
        ours, theirs = _result(run, path), _result(run, approximate)
        if ours is None:
            continue
        replicas = run["our_paths"][path]["replicas"]
        points = (ours["hit_rate"] - one["hit_rate"]) * 100
        without = (
            ""
            if theirs is None
            else f"; without events {(theirs['hit_rate'] - one_approximate['hit_rate']) * 100:+.1f}"
        )
        yield Row(
            f"{replicas} router replicas with KV events vs one, {label}",
            "within 1 point",
            f"{points:+.1f} points ({ours['hit_rate']:.1%} vs {one['hit_rate']:.1%}){without}",
            "",
            points >= -1,
            (report,),
        )
        estimate = ours.get("index_estimate")
        if estimate is None:
            continue
        error = (estimate - ours["hit_rate"]) * 100
        guessed = theirs.get("index_estimate") if theirs else None
        without = (
            ""
            if theirs is None or guessed is None
            else f"; without events {(guessed - theirs['hit_rate']) * 100:+.1f}"
        )
        yield Row(
            f"{replicas} router replicas with KV events, {label}: their estimate - measured "
            "hit rate",
            "within 1 point",
            f"{error:+.1f} points{without}",
            "",
            abs(error) <= 1,
            (report,),
        )


def _kv_events_cost_rows(runs: Runs) -> Iterable[Row | None]:
    run = runs.get("kv-events")
    if run is None:
        return
    totals = {c["mode"]: c["lookup_us"] + c["record_us"] for c in run["request_path"]}
    added = totals["kv-events"] - totals["approximate"]
    chars = run["options"]["prompt_chars"]
    yield Row(
        f"KV events on the request path, {chars:,}-character prompt, p50",
        "≤ 100 µs added",
        f"{added:+.1f} µs",
        "",
        added <= 100,
        ("kv-events",),
    )
    worst = max(run["ingest"], key=lambda r: statistics.median(r["cpu_us_per_block"]))
    share = TARGET_BLOCKS_PER_S * statistics.median(worst["cpu_us_per_block"]) / 1e6
    yield Row(
        f"KV-event ingestion at {TARGET_BLOCKS_PER_S:,} engine blocks/s, per router",
        f"≤ {TARGET_CORE_SHARE} core",
        f"{share:.2f} core ({worst['decoder']})",
        "",
        share <= TARGET_CORE_SHARE,
        ("kv-events",),
    )


def _overhead_row(runs: Runs) -> Row | None:
    run = runs.get("overhead")
    if run is None:
        return None
    from extproc.bench.overhead import TARGET_P50_MS, best_router_path, summarise

    summary = summarise(run)
    if ("envoy", 1) not in summary:
        return None
    added = summary[(best_router_path(summary), 1)]["p50"] - summary[("envoy", 1)]["p50"]
    return Row(
        "routing overhead added to Envoy, p50 at c=1",
        f"≤ {TARGET_P50_MS} ms",
        f"{added:+.2f} ms",
        "",
        added <= TARGET_P50_MS,
        ("overhead",),
    )


def _overhead_floor_rows(runs: Runs) -> list[Row | None]:
    """The router's cost against both ext_proc floors, where a run measured them."""
    run = runs.get("overhead")
    if run is None:
        return []
    from extproc.bench.overhead import floor_ratios, summarise

    ratios = floor_ratios(summarise(run), run["options"]["concurrencies"])
    if ratios is None:
        return []
    return [
        Row(f"routing overhead: {measure}", target, ours, "", met, ("overhead",))
        for measure, target, ours, met in ratios.targets()
    ]


def _soak_row(runs: Runs) -> Row | None:
    run = runs.get("reliability-soak")
    if run is None or "router" not in run.get("growth", {}):
        return None
    growth, bound = run["growth"]["router"], run["options"]["max_rss_growth"]
    return Row(
        f"soak: router RSS growth after warm-up, {run['requests']:,} requests",
        f"≤ {bound:.0%} over ≥ 1,000,000",
        f"{growth:+.1%}",
        "",
        growth <= bound and run["requests"] >= 1_000_000,
        ("reliability",),
    )


def _cpu_per_request_rows(runs: Runs) -> list[Row]:
    """Each stored saturation ladder's CPU per request at one worker's capacity: what a
    deployment sizes cores by, at that body size (reported; no target)."""
    from extproc.bench.reliability_report import cpu_per_request_us

    found = []
    for name in sorted(n for n in runs if n.startswith("reliability-saturation")):
        run = runs[name]
        rate = run.get("capacity", {}).get("1 worker")
        step = next(
            (s for s in run["steps"] if s["path"] == "1 worker" and s["rate"] == rate), None
        )
        if step is None or "sim_capacity_blocks" not in run["options"]:
            continue  # a ladder from before the simulators' caches were sized to hold it
        found.append(
            Row(
                f"router CPU per request at one worker's capacity, "
                f"{run['options']['body_bytes']:,}-byte chat bodies",
                "reported",
                f"{cpu_per_request_us(step):,.0f} µs at {rate} req/s "
                f"({step['router_cpu']:.2f} of a core)",
                "",
                None,
                ("reliability",),
            )
        )
    return found


def _concurrency_row(runs: Runs, name: str, measure: str) -> Row | None:
    """A concurrency ladder's row: the highest level held, against 3,000."""
    run = runs.get(name)
    if run is None:
        return None
    from extproc.bench.concurrency import highest_held

    best = highest_held(run)
    return Row(
        measure,
        "≥ 3,000",
        f"{best:,} held" if best is not None else "none held",
        "",
        best is not None and best >= 3000,
        (name,),
    )


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _burst_rows(runs: Runs) -> list[Row | None]:
    """A burst's rows: for each level, at the router's defaults, what Envoy's message
    timeout decided (the issue's target: nothing)."""
    run = runs.get("burst")
    if run is None:
        return []
    from extproc.bench.burst import BREAKER_OVERFLOW, ENVOY_VARIANTS, summaries

    found: list[Row | None] = []
    for result in summaries(run):
        if result["variant"] != "defaults":
            continue
        timeouts = result["failures"].get("http.ingress.ext_proc.message_timeouts", 0.0)
        failed_open = result["failures"].get("http.ingress.ext_proc.failure_mode_allowed", 0.0)
        found.append(
            Row(
                f"{result['level']:,} streaming requests at once (a burst): Envoy's message "
                "timeouts, requests failed open",
                "0, every request decided or shed by the router",
                f"{timeouts:,.0f} timeouts, {failed_open:,.0f} failed open "
                f"({result['shed']:,.0f} shed), median of {result['rounds']}; "
                f"TTFT p99 {_ms(result['ttft_s']['p99'])}",
                "",
                bool(result["held"]),
                ("burst",),
            )
        )
    # The breaker variants: a request past the cap fails open at once, counted by Envoy.
    for result in summaries(run):
        if result["variant"] not in ENVOY_VARIANTS or result.get("no_timeouts") is None:
            continue
        timeouts = result["failures"].get("http.ingress.ext_proc.message_timeouts", 0.0)
        at_once = result["failures"].get(BREAKER_OVERFLOW, 0.0)
        found.append(
            Row(
                f"{result['level']:,} at once, {result['variant']} (Envoy's breaker on the "
                "router cluster): message timeouts",
                "0; the rest failed open at once, counted",
                f"{timeouts:,.0f} timeouts, {at_once:,.0f} failed open at once, "
                f"{result['decided']:,.0f} decided by the router, median of "
                f"{result['rounds']}; TTFT p99 {_ms(result['ttft_s']['p99'])}",
                "",
                bool(result["no_timeouts"]),
                ("burst",),
            )
        )
    return found


def _bodies_row(runs: Runs) -> Row | None:
    run = runs.get("bodies")
    if run is None:
        return None
    from extproc.bench.bodies import holds

    total = sum(len(cell["results"]) for cell in run["cells"])
    hung = sum(r["outcome"] == "hung" for cell in run["cells"] for r in cell["results"])
    sizes = [cell["size"] for cell in run["cells"]]
    return Row(
        f"request bodies 0 B to {max(sizes) / 2**20:.0f} MiB, every mode and upload",
        "whole, or 413 at once; none hangs",
        f"{total:,} requests, {hung} hung, " + ("all as they should" if holds(run) else "not all"),
        "",
        holds(run),
        ("bodies",),
    )


def _replay_rows(runs: Runs) -> Iterable[Row]:
    """The replay's accuracy (its worst bounded configuration, over the workloads) and
    its speed, from the accuracy run and its grid."""
    run = runs.get("replay")
    if run is not None and run.get("kind") == "replay-accuracy":
        from extproc.bench.replay_accuracy import compared

        bounded = [row for workload in run["workloads"] for row in compared(workload)]
        hit = max(row["hit_rate_error"] for row in bounded)
        share = max(row["share_error"] for row in bounded)
        bounds = run["bounds"]
        names = ", ".join(w["workload"]["name"] for w in run["workloads"])
        yield Row(
            f"replay's prediction against the real run ({names}; "
            f"{len(bounded)} configurations): worst hit-rate error, worst instance's share",
            f"≤ {bounds['hit_rate_points']:g} pts, ≤ {bounds['share_points']:g} pts",
            f"{hit:.1f} pts, {share:.1f} pts",
            "no peer predicts",
            hit <= bounds["hit_rate_points"] and share <= bounds["share_points"],
            ("replay",),
        )
    grid = runs.get("replay-grid")
    if grid is not None:
        speed = grid["decisions_per_cpu_s"]
        yield Row(
            f"replay speed, {len(grid['results'])} configurations in one pass",
            "≥ 50,000 requests/s on one core",
            f"{speed:,.0f} requests a CPU second",
            "",
            speed >= 50_000,
            ("replay-grid",),
        )


def _shadow_rows(runs: Runs) -> Iterable[Row]:
    run = runs.get("shadow")
    if run is None:
        return
    from extproc.bench.shadow import worst_costs

    bounds = run["bounds"]
    worst = max(w["hit_rate_error"] for w in run["workloads"])
    names = ", ".join(w["workload"]["name"] for w in run["workloads"])
    yield Row(
        f"shadow mode's predicted hit rate against PREFIX_AWARE's, measured ({names}): worst error",
        f"≤ {bounds['hit_rate_points']:g} pts",
        f"{worst:.1f} pts",
        "no peer predicts",
        worst <= bounds["hit_rate_points"],
        ("shadow",),
    )
    shadow_us, log_us = worst_costs(run)
    yield Row(
        "added per request, median: shadow mode; the traffic log",
        f"≤ {bounds['shadow_us']:g} µs; ≤ {bounds['log_us']:g} µs",
        f"{shadow_us:.1f} µs; {log_us:.1f} µs",
        "",
        shadow_us <= bounds["shadow_us"] and log_us <= bounds["log_us"],
        ("shadow",),
    )


def rows(runs: Runs) -> list[Row]:
    found: list[Row | None] = []
    found += _fleet_rows(runs, "long-context", "long-context, default rate:")
    found += _fleet_rows(runs, "long-context-rate-16", "long-context, 16 req/s:")
    found.append(_saturation_row(runs))
    found.append(
        _fleet_row(runs, "long-context-short-prefix", "long-context-short-prefix hit rate",
                   lambda r: r["hit_rate"], _percent, False, "≥ 93%", bound=0.93,
                   with_ceiling=True)
    )  # fmt: skip
    conversations = runs.get("conversations")
    ring = _result(conversations, RING) if conversations else None
    if ring is not None:
        found.append(
            _fleet_row(runs, "conversations", "conversations hit rate", lambda r: r["hit_rate"],
                       _percent, False, "≥ ring_hash", bound=ring["hit_rate"], with_ceiling=True)
        )  # fmt: skip
    hot = runs.get("hot-spot")
    smg = _result(hot, "smg-cache-aware") if hot else None
    if smg is not None:
        found.append(
            _fleet_row(runs, "hot-spot", "hot-spot TTFT p99", lambda r: _ttft_percentile(r, 0.99),
                       lambda v: f"{v:.0f} ms", True, "≤ smg",
                       bound=_ttft_percentile(smg, 0.99))
        )  # fmt: skip
    found.append(
        _fleet_row(runs, "multi-tenant", "multi-tenant hit rate", lambda r: r["hit_rate"],
                   _percent, False, "reported", with_ceiling=True)
    )  # fmt: skip
    found.append(_replicas_row(runs, "long-context", "long-context"))
    found.append(_replicas_row(runs, "conversations", "conversations"))
    for report, label in REPLICAS_REPORTS:
        found += _kv_events_replica_rows(runs, report, label)
    found += _kv_events_cost_rows(runs)
    found.append(_prefix_index_row(runs))
    found += _real_vllm_rows(runs)
    found.append(_sim_vs_vllm_row(runs))
    found.append(_fleet_events_row(runs))
    found.append(_overhead_row(runs))
    found += _overhead_floor_rows(runs)
    found.append(_soak_row(runs))
    found.extend(_cpu_per_request_rows(runs))
    found.append(
        _concurrency_row(
            runs,
            "concurrency",
            "streaming requests in flight at once, every one decided, nothing tripped",
        )
    )
    found.append(
        _concurrency_row(
            runs,
            "concurrency-epp-kgateway",
            "endpoint picker behind kgateway's Envoy (5 s message timeout, every reply chunk "
            "through the picker): streams in flight, every one picked, none timed out",
        )
    )
    found += _burst_rows(runs)
    found.append(_bodies_row(runs))
    found += _shadow_rows(runs)
    found += _replay_rows(runs)
    result = [row for row in found if row is not None]
    # "reported" rows have no target to meet.
    return [replace(r, met=None) if r.target == "reported" else r for r in result]


def render(runs: Runs) -> str:
    from extproc.bench.report import markdown_table

    found = rows(runs)
    table_rows = [
        [
            row.measure,
            row.target,
            row.ours,
            row.peer,
            row.ceiling,
            {True: "yes", False: "**no**", None: ""}[row.met],
            ", ".join(f"[{name}]({name}.md)" for name in row.reports),
        ]
        for row in found
    ]
    table = markdown_table(
        ["measure", "target", "ours (PREFIX_AWARE, defaults)", "best peer", "hit-rate ceiling",
         "target met", "report"],
        table_rows,
    )  # fmt: skip
    judged = [row for row in found if row.met is not None]
    met = sum(bool(row.met) for row in judged)
    reports = sorted({"reliability" if name.startswith("reliability-") else name for name in runs})
    machines = sorted(
        {
            machine
            for run in runs.values()
            if isinstance(
                machine := run.get("machine") or run.get("environment", {}).get("machine"), str
            )
        }
    )
    return f"""# Benchmarks

<!-- Rendered by `prefix-router bench render` from the stored runs (docs/benchmarks/*.json)
by extproc/bench/headline.py; never edit it by hand. -->

Each report below is written by `prefix-router bench <workload> --out docs/benchmarks`
and stores its run as JSON beside its markdown; the markdown, its plots and this page are
renderings of that JSON (`prefix-router bench render` renders them again). Every number on
this page is read from one of those stored runs, one run each; simulated fleets have 7
instances.

The best peer is the best, in the same run, of: {", ".join(SHORT[p] for p in PEERS)}
(for the busiest instance: the one of them with the best hit rate).

The hit-rate ceiling is computed from the run's workload by extproc/bench/ceiling.py, not
measured: the hit rate of one instance with an unlimited cache serving every request in
order (cold misses only), an upper bound for any routing; then an upper bound when no
instance takes more than {SHARE_CAP:.0%} of the requests, as a group sharing a prefix
(a document) that carries more than {SHARE_CAP:.0%} of them must then be prefilled on
several instances.

{table}

Targets met: {met} of {len(judged)}.

All reports: {", ".join(f"[{name}]({name}.md)" for name in reports)}.

Machines of these runs: {"; ".join(machines)}.
"""


def load_runs(directory: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def write(directory: Path) -> Path:
    path = directory / PAGE
    path.write_text(render(load_runs(directory)))
    return path
