"""The fleet benchmark's report, rendered from its stored run alone: the markdown
(``render_report``) and two plots (``render_plots``) take the document that ``fleet.document``
stores as <name>.json and read nothing else (no clock, no machine, no code defaults), so a
committed report can be rendered again from its JSON (``rerender``) and compared."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from extproc.bench import ceiling, report
from extproc.bench.fleet_paths import (
    APPROXIMATE,
    FOUR_REPLICAS,
    FOUR_REPLICAS_APPROXIMATE,
    NO_OVERFLOW,
    REPLICA_PATHS,
    STREAMED,
    TWO_REPLICAS,
    TWO_REPLICAS_APPROXIMATE,
)
from extproc.bench.fleet_results import PathResult, path_result
from extproc.bench.workloads import WorkloadSpec, describe

KIND = "fleet"
FORMAT = 1
Document = dict[str, Any]


def _check(document: Document) -> None:
    kind, version = document.get("kind"), document.get("format")
    if kind != KIND or version != FORMAT:
        raise ValueError(
            f"not a stored fleet run of format {FORMAT}: kind {kind!r}, format {version!r}"
        )


def _results(document: Document) -> list[PathResult]:
    return [path_result(r) for r in document["results"]]


def _ran(results: list[PathResult]) -> dict[str, PathResult]:
    return {r.path: r for r in results if not r.skipped}


def _ratio(value: float, base: float) -> str:
    if not base or math.isnan(value) or math.isnan(base):
        return "n/a"
    return f"{(value / base - 1) * 100:+.0f}%"


def _setting(value: object) -> str:
    return "null" if value is None else str(value)


def _main_table(results: list[PathResult]) -> str:
    base = _ran(results).get("RANDOM")
    rows: list[list[object]] = []
    for r in results:
        if r.skipped:
            rows.append([r.path, f"skipped: {r.skipped}", *[""] * 13])
            continue
        shares = list(r.shares.values())
        rows.append(
            [
                r.path,
                f"{r.percentile(0.5):.0f}",
                f"{r.percentile(0.9):.0f}",
                f"{r.percentile(0.99):.0f}",
                f"{r.requests_per_s:.2f}",
                f"{r.tokens_per_s:.0f}",
                f"{r.hit_rate:.1%}",
                "" if r.index_estimate is None else f"{r.index_estimate:.1%}",
                f"{min(shares):.1%} to {max(shares):.1%}" if shares else "",
                "" if r.overflow_rate is None else f"{r.overflow_rate:.1%}",
                r.failures,
                _ratio(r.percentile(0.5), base.percentile(0.5)) if base else "",
                _ratio(r.percentile(0.9), base.percentile(0.9)) if base else "",
                _ratio(r.requests_per_s, base.requests_per_s) if base else "",
                "" if r.overhead_ms is None else f"{r.overhead_ms:+.2f}",
            ]
        )
    return report.markdown_table(
        ["path", "TTFT p50 (ms)", "p90", "p99", "req/s", "output tok/s", "hit rate",
         "index estimate",
         "per-instance share", "overflow", "failed", "p50 vs RANDOM", "p90 vs RANDOM",
         "req/s vs RANDOM", "routing overhead p50 (ms)"],
        rows,
    )  # fmt: skip


def render_report(document: Document) -> str:
    """The markdown report of a stored fleet run."""
    _check(document)
    name, count, instances = document["name"], document["requests"], document["instances"]
    workload = document["workload"]
    results = _results(document)
    sections = (
        _replicas_section(document, results)
        + _hot_spot_section(document, results)
        + _streamed_section(results)
        + _overhead_section(document, results)
        + _closed_loop_section(document, results)
    )
    return f"""# Fleet benchmark: {name}

<!-- Rendered from {name}.json by extproc/bench/fleet_render.py. -->

{count} requests of the `{workload["name"]}` workload, open loop, sent through each
routing path in turn to the same {instances} simulated vLLM instances (prefix caches
reset before each path; before each of ours, the routers restart with an empty index and the
run waits until no cache pressure is left from the path before). Times are model time (see
below).

{_main_table(results)}

{_ceiling_line(document)}

![TTFT CDF]({name}-ttft.png)
![hit rate and share]({name}-share.png)
{sections}
## Workload

{describe(WorkloadSpec(**workload))}

{_method_section(document)}"""


def _ceiling_line(document: Document) -> str:
    """The hit-rate ceilings of the run's schedule, computed from its workload."""
    found = ceiling.stored_ceiling(document)
    workload = document["workload"]["name"]
    if found is None:
        return (
            f"Ceiling: not computed, the `{workload}` workload no longer generates this run's "
            f"{document['requests']} requests."
        )
    cap = f"{found.share_cap:.0%}"
    if found.over_cap:
        capped = (
            f"with no instance above {cap} of requests, at most {found.capped_hit_rate:.1%}\n"
            f"({found.busiest_group} carries {found.busiest_share:.1%} of them)."
        )
    else:
        capped = (
            f"no group carries more than {cap} of them (the busiest, {found.busiest_group}, "
            f"{found.busiest_share:.1%}), so the\nbound is the same with no instance above {cap}."
        )
    return f"""**Ceiling** (computed from the workload by `extproc/bench/ceiling.py`): one
instance with an unlimited cache would hit {found.hit_rate:.1%} of these requests' prompt
tokens (cold misses only), an upper bound for any routing;
{capped}"""


render = render_report  # the name extproc.bench.report's registry of renderers calls


def _replicas_section(document: Document, results: list[PathResult]) -> str:
    ran = _ran(results)
    if any(path in ran for path in REPLICA_PATHS if path not in ("PREFIX_AWARE", TWO_REPLICAS)):
        return _replica_table(document, ran)
    one, two = ran.get("PREFIX_AWARE"), ran.get(TWO_REPLICAS)
    if one is None or two is None:
        return ""
    replicas = document["our_paths"][TWO_REPLICAS]["replicas"]
    points = (two.hit_rate - one.hit_rate) * 100
    # Runs stored before the router read KV events say nothing of them: no events then.
    if document["router"].get("kv_events", False):
        link = "each reading every simulator's KV events"
    else:
        link = "each with its own prefix index and no link between\nthem"
    rates = f"Hit rate {two.hit_rate:.1%} against {one.hit_rate:.1%} for one replica: {points:+.1f}"
    return f"""
**Two router replicas** (`{TWO_REPLICAS}`): Envoy spreads the ext_proc streams over {replicas}
router processes (least-request), {link}. {rates}
points.
"""


def _replica_table(document: Document, ran: dict[str, PathResult]) -> str:
    """1, 2 and 4 replicas, reading the engines' KV events and without them."""
    modes = {
        "KV events": ("PREFIX_AWARE", TWO_REPLICAS, FOUR_REPLICAS),
        "approximate": (APPROXIMATE, TWO_REPLICAS_APPROXIMATE, FOUR_REPLICAS_APPROXIMATE),
    }
    rows = []
    for mode, paths in modes.items():
        base = ran.get(paths[0])
        for path in paths:
            result = ran.get(path)
            if result is None:
                continue
            replicas = document["our_paths"][path]["replicas"]
            estimate = result.index_estimate
            vs_one = (
                ""
                if base is None or path == paths[0]
                else (
                    f"{(result.hit_rate - base.hit_rate) * 100:+.1f} points, P90 "
                    f"{_ratio(result.percentile(0.9), base.percentile(0.9))}"
                )
            )
            rows.append(
                [
                    mode,
                    replicas,
                    f"{result.hit_rate:.1%}",
                    "" if estimate is None else f"{estimate:.1%}",
                    "" if estimate is None else f"{(estimate - result.hit_rate) * 100:+.1f}",
                    f"{result.percentile(0.9):.0f}",
                    vs_one,
                ]
            )
    table = report.markdown_table(
        ["index", "replicas", "hit rate (vLLM's counters)", "routers' estimate",
         "estimate - measured (points)", "TTFT p90 (ms)", "vs one replica"],
        rows,
    )  # fmt: skip
    return f"""
## Router replicas: one view of the caches, or each its own

Envoy spreads the ext_proc streams over the replicas (least-request). With `kv_events` (the
default) every replica reads each simulator's KV events, as it would vLLM's; `approximate`
paths turn them off, so each replica knows only its own decisions.

{table}
"""


def _hot_spot_table(on: PathResult, off: PathResult) -> str:
    rows: list[list[object]] = [
        [f"TTFT p{round(q * 100)} (ms)", f"{on.percentile(q):.0f}", f"{off.percentile(q):.0f}",
         _ratio(on.percentile(q), off.percentile(q))]
        for q in (0.5, 0.9, 0.99)
    ]  # fmt: skip
    rows.append(
        ["hit rate", f"{on.hit_rate:.1%}", f"{off.hit_rate:.1%}",
         f"{(on.hit_rate - off.hit_rate) * 100:+.1f} points"]
    )  # fmt: skip
    rows.append(
        ["busiest instance's share", f"{max(on.shares.values()):.1%}",
         f"{max(off.shares.values()):.1%}", ""]
    )  # fmt: skip
    rows.append(["overflow", f"{on.overflow_rate or 0:.1%}", f"{off.overflow_rate or 0:.1%}", ""])
    return report.markdown_table(["", "PREFIX_AWARE (overflow on)", NO_OVERFLOW, "on vs off"], rows)


def _hot_spot_section(document: Document, results: list[PathResult]) -> str:
    ran = _ran(results)
    on, off = ran.get("PREFIX_AWARE"), ran.get(NO_OVERFLOW)
    workload = document["workload"]
    if workload["name"] != "hot-spot" or on is None or off is None:
        return ""
    hot_rate = workload["rate_per_s"] * workload["hot_share"]
    router = document["router"]
    switched_off = ", ".join(
        f"`{key}` {_setting(value)}"
        for key, value in document["our_paths"][NO_OVERFLOW]["settings"].items()
        if key != "routing_strategy"
    )
    return f"""
## Overflow against the hot spot

One document takes {workload["hot_share"]:.0%} of the requests (~{hot_rate:g} of the
~{workload["rate_per_s"]:g} requests/s offered). `{NO_OVERFLOW}` is PREFIX_AWARE with its load
terms switched off ({switched_off}). With the run's settings (`concurrency_threshold`
{router["concurrency_threshold"]}, `balance_factor` {_setting(router["balance_factor"])}, never
below {router["balance_min_in_flight"]} in flight), the hot document is spread over a
consistent set of instances in proportion to its share of the traffic, and a host past its
balance bound costs `overload_cost` {router["overload_cost"]} of a prompt per request over it.

{_hot_spot_table(on, off)}

The simulated instances run with `{" ".join(document["simulator"]["args"])}`.
"""


def _streamed_section(results: list[PathResult]) -> str:
    """PREFIX_AWARE behind a streamed-body Envoy against the buffered one (and, where run,
    without overflow): whether load still comes back in time to protect the tail."""
    ran = _ran(results)
    buffered, streamed = ran.get("PREFIX_AWARE"), ran.get(STREAMED)
    if buffered is None or streamed is None:
        return ""
    compared = [("PREFIX_AWARE (buffered)", buffered), (STREAMED, streamed)]
    off = ran.get(NO_OVERFLOW)
    if off is not None:
        compared.append((NO_OVERFLOW, off))
    rows: list[list[object]] = [
        [f"TTFT p{round(q * 100)} (ms)", *(f"{r.percentile(q):.0f}" for _, r in compared)]
        for q in (0.5, 0.9, 0.99)
    ]
    rows.append(["hit rate", *(f"{r.hit_rate:.1%}" for _, r in compared)])
    rows.append(
        ["busiest instance's share", *(f"{max(r.shares.values()):.1%}" for _, r in compared)]
    )
    rows.append(["overflow", *(f"{r.overflow_rate or 0:.1%}" for _, r in compared)])
    table = report.markdown_table(["", *(name for name, _ in compared)], rows)
    p99 = _ratio(streamed.percentile(0.99), buffered.percentile(0.99))
    return f"""
## Streamed bodies

`{STREAMED}` is the same router behind an Envoy that streams the body
(`--body-mode streamed`): one answer per request, the ext_proc stream ends with the
decision, and the router counts a request in flight until Envoy's access log reports it
done. TTFT p99 {p99} against the buffered path.

{table}
"""


def _pairs_table(results: list[PathResult]) -> str:
    rows: list[list[object]] = []
    for r in results:
        pairs = r.overhead_pairs_ms
        if not pairs or len(pairs) < 2:
            continue
        low, middle, high = statistics.quantiles(pairs, n=4, method="inclusive")
        rows.append([r.path, len(pairs), f"{low:+.2f}", f"{middle:+.2f}", f"{high:+.2f}"])
    if not rows:
        return ""
    table = report.markdown_table(["path", "pairs", "p25 (ms)", "median (ms)", "p75 (ms)"], rows)
    return f"\nThe spread of the pairs (path minus direct), per path:\n\n{table}\n"


def _overhead_section(document: Document, results: list[PathResult]) -> str:
    probes = document["overhead_probes"]
    if not probes:
        return ""
    return f"""
**Routing overhead** (last column): before its run, each path is probed with the simulators
set to answer at once (`POST /sim/time_scale` 0): the workload's first request (`max_tokens`
1, not streamed), {probes} times through the path and {probes} times straight to one
instance, in back-to-back pairs after {document["overhead_warm_up_pairs"]} warm-up pairs; the
column is the median over pairs of path minus direct, in wall-clock ms (not scaled). One
client at a time, on the machine below, which every proxy and the simulators share.
{_pairs_table(results)}"""


def _closed_loop_table(ran: list[PathResult]) -> str:
    base = next((r.closed_loop for r in ran if r.path == "RANDOM"), None)
    rows: list[list[object]] = []
    for r in ran:
        c = r.closed_loop
        assert c is not None
        rows.append(
            [
                r.path,
                f"{c.requests_per_s:.2f}",
                f"{c.tokens_per_s:.0f}",
                _ratio(c.requests_per_s, base.requests_per_s) if base else "",
                f"{c.hit_rate:.1%}",
                f"{c.ttft_p50_ms:.0f}",
                c.completed,
                c.failed,
            ]
        )
    return report.markdown_table(
        ["path", "req/s at saturation", "output tok/s", "req/s vs RANDOM", "hit rate",
         "TTFT p50 (ms)", "completed", "failed"],
        rows,
    )  # fmt: skip


def _closed_loop_section(document: Document, results: list[PathResult]) -> str:
    ran = [r for r in results if r.closed_loop is not None]
    if not ran:
        return ""
    loop = document["closed_loop"]
    open_rates = [r.requests_per_s for r in _ran(results).values()]
    return f"""
## Throughput at saturation (closed loop)

The open loop above offers a fixed rate, ~{document["workload"]["rate_per_s"]:g} requests/s;
there the paths completed {min(open_rates):.2f} to {max(open_rates):.2f} req/s. Here
{loop["concurrency"]} clients each send their next request as soon as the last one ends (the
first {loop["requests"]} requests of the same schedule, arrival times ignored, at most
{loop["time_limit_s"]:g} s), to saturate the fleet, so that completions per second measure its
capacity under each path. To keep the fleet, not this machine's CPU, the bottleneck, the
simulators' model runs {loop["time_scale"]:g} times slower than model time during these runs
(`POST /sim/time_scale`); rates are converted back to model time. Caches are reset before
each run.

{_closed_loop_table(ran)}
"""


def _time_line(time_scale: float) -> str:
    if time_scale == 1:
        return """- Time: time_scale = 1, no compression: simulated durations and arrival times are
  as modelled."""
    return f"""- Time compression: time_scale = {time_scale}. Simulated durations and arrival times
  are multiplied by it and measured times divided by it. Costs that do not scale (Envoy,
  router, Python) appear {1 / time_scale:g} times larger than they are."""


def _our_paths_lines(our_paths: dict[str, Any]) -> str:
    lines = []
    for path, spec in our_paths.items():
        settings = ", ".join(f"`{k}` {_setting(v)}" for k, v in spec["settings"].items())
        replicas = f", {spec['replicas']} router replicas" if spec["replicas"] != 1 else ""
        # Runs stored before body modes were recorded all ran buffered-partial.
        body_mode = spec.get("body_mode", "buffered-partial")
        mode = f", Envoy body mode {body_mode}" if body_mode != "buffered-partial" else ""
        # Streamed bodies always come with the log; say so where it was a choice.
        logged = spec.get("completion_log") and body_mode == "buffered-partial"
        mode += ", Envoy reports completions to the router (`completion_log`)" if logged else ""
        lines.append(f"  - `{path}`: {settings}{replicas}{mode}")
    return "\n".join(lines)


def _method_section(document: Document) -> str:
    router, args = document["router"], " ".join(document["simulator"]["args"])
    return f"""## How this was measured

- Simulator: every instance runs `prefix-router sim {args}`, the engine model of
  `extproc/sim/engine.py`: vLLM's timing shape (prefill cost per uncached token, continuous
  batching, block-level LRU prefix cache that keeps generated output too, as vLLM's does),
  with that module's default costs where these arguments set none.
{_time_line(document["time_scale"])}
- Router: default settings but `concurrency_threshold` {router["concurrency_threshold"]} and
  `prefix_length` {router["prefix_length"]} (read by `prefix_match` fixed only); among the
  defaults of the run, `balance_factor` {_setting(router["balance_factor"])} (never below
  `balance_min_in_flight` {router["balance_min_in_flight"]}) and `overload_cost`
  {router["overload_cost"]}. Before each of our paths the router processes restart with its
  settings, so the prefix index starts empty as the caches do. Each path's own settings:
{_our_paths_lines(document["our_paths"])}
- Index estimate: the router's own estimate of the hit rate, the bytes its prefix index
  believed the chosen host held over the bytes routed (`prefix_router_matched_bytes_total /
  prefix_router_prompt_bytes_total`). Its distance from the measured hit rate bounds what
  exact cache events from the engines could add.
- Envoy ring_hash: no ext_proc; consistent hashing on the `{document["session_header"]}` header
  (the document, conversation or tenant id), which a client must supply.
- Peers: vllm-router and smg from PyPI (`pip install .[bench]`), pointed at the same
  instances; a path marked skipped was not installed.

```
{document["command"]}
```

- Machine: {document["machine"]}
"""


def render_plots(document: Document, out_dir: Path, name: str | None = None) -> list[Path]:
    """<name>-ttft.png (TTFT CDF per path) and <name>-share.png (hit rate, and each
    instance's share of the requests), in ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check(document)
    name = name or document["name"]
    ran = [r for r in _results(document) if not r.skipped and r.ttfts_ms()]
    ttft_path, share_path = out_dir / f"{name}-ttft.png", out_dir / f"{name}-share.png"
    figure, axis = plt.subplots(figsize=(8, 5))
    for r in ran:
        values = r.ttfts_ms()
        axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=r.path)
    axis.set_xscale("log")
    axis.set_xlabel("TTFT (ms, model time, log scale)")
    axis.set_ylabel("fraction of requests")
    axis.set_title(f"{name}: TTFT CDF by routing path")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(ttft_path, dpi=100)
    plt.close(figure)

    figure, (hits, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits.bar([r.path for r in ran], [r.hit_rate for r in ran])
    hits.set_ylabel("prefix-cache hit rate")
    hits.tick_params(axis="x", rotation=60, labelsize=7)
    width = 0.8 / max(1, len(ran))
    for index, r in enumerate(ran):
        xs = [i + index * width for i in range(len(r.shares))]
        shares.bar(xs, list(r.shares.values()), width, label=r.path)
    shares.axhline(1 / document["instances"], color="black", linestyle="--")
    shares.set_xlabel("instance")
    shares.set_ylabel("share of requests")
    shares.legend(fontsize=6)
    figure.suptitle(f"{name}: hit rate and per-instance share")
    figure.tight_layout()
    figure.savefig(share_path, dpi=100)
    plt.close(figure)
    return [ttft_path, share_path]


def rerender(json_path: Path) -> Path:
    """Render <name>.md and its plots beside a stored fleet run, from the JSON alone;
    returns the markdown's path."""
    document = json.loads(Path(json_path).read_text())
    out_dir = Path(json_path).parent
    path = out_dir / f"{document['name']}.md"
    path.write_text(render_report(document))
    render_plots(document, out_dir)
    return path
