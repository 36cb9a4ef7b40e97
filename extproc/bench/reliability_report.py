"""docs/benchmarks/reliability.md: the soak and saturation results on one page.

Each benchmark saves its result as JSON beside the page (``reliability-<name>.json``) and
the page is re-rendered from whichever results are there, so running one benchmark keeps
the other's section.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from extproc.bench import report
from extproc.index.popularity import PrefixPopularity
from extproc.stack.local import envoy_binary

PAGE = "reliability.md"
POPULARITY_MAX_KEYS = PrefixPopularity().max_keys
MIB = 2**20


def environment() -> dict[str, Any]:
    """Where and when a run happened; the load average shows whether the machine was shared."""
    return {
        "machine": report.machine_description(),
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "wrk": report.tool_version(["wrk", "-v"]),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def save(out_dir: Path, name: str, data: dict[str, Any], env: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**data, "environment": env}
    (out_dir / f"reliability-{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return render(out_dir)


def _load(out_dir: Path, name: str) -> dict[str, Any] | None:
    path = out_dir / f"reliability-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# The saturation ladder's main body size; a run at another size is stored and rendered
# beside it (reliability-saturation-32768.json, its own section and plot).
MAIN_BODY_BYTES = 8192


def saturation_name(body_bytes: int) -> str:
    return "saturation" if body_bytes == MAIN_BODY_BYTES else f"saturation-{body_bytes}"


def render_text(soak: dict[str, Any] | None, *saturations: dict[str, Any] | None) -> str:
    """The page, from the stored runs alone: the soak, then each saturation ladder."""
    envoy = next((d["environment"]["envoy"] for d in (soak, *saturations) if d), "")
    version = envoy.split("/")[1] if envoy.count("/") >= 1 else envoy
    sections = ["# Reliability: soak and saturation\n"]
    sections.append(
        f"Two long-run checks of the full stack (Envoy {version}, the router, the control "
        "plane and simulated vLLM backends that answer at once), all on this one machine. The "
        "failure modes and the metrics to watch in production are in "
        "[../operations.md](../operations.md).\n"
    )
    if soak is not None:
        sections.append(_soak_section(soak))
    for saturation in saturations:
        if saturation is not None:
            sections.append(_saturation_section(saturation))
    return "\n".join(sections)


def saturations(out_dir: Path) -> list[dict[str, Any]]:
    """The main ladder first, then the other body sizes, smallest first."""
    runs = [json.loads(path.read_text()) for path in out_dir.glob("reliability-saturation*.json")]
    return sorted(runs, key=lambda run: (_body_bytes(run) != MAIN_BODY_BYTES, _body_bytes(run)))


def _body_bytes(run: dict[str, Any]) -> int:
    return int(run["options"]["body_bytes"])


def render(out_dir: Path) -> Path:
    """Render the page and its plots from the stored runs in ``out_dir``."""
    soak, ladders = _load(out_dir, "soak"), saturations(out_dir)
    path = out_dir / PAGE
    path.write_text(render_text(soak, *ladders))
    if soak is not None:
        _plot_soak(soak, out_dir / "reliability-soak.png")
    for saturation in ladders:
        name = saturation_name(_body_bytes(saturation))
        _plot_saturation(saturation, out_dir / f"reliability-{name}.png")
    return path


def _state_is_idle(state: dict[str, Any], backends: int) -> bool:
    """Nothing in flight, per-host state no larger than the fleet, and the per-prefix
    state within its bounds."""
    index_ok = state.get("index_blocks", 0) <= state.get("index_capacity_blocks", 0)
    popularity_ok = state.get("popularity_keys", 0) <= 2 * POPULARITY_MAX_KEYS
    return bool(
        state["open_streams"] == 0
        and state["in_flight_total"] == 0
        and state["in_flight_series"] == 0
        and state["router_hosts"] <= backends
        and state["cp_hosts_discovered"] <= backends
        and index_ok
        and popularity_ok
    )


def _mib(value: float) -> str:
    return f"{value / MIB:.1f}"


def _environment(env: dict[str, Any]) -> str:
    load = ", ".join(str(x) for x in env["load_average_before"])
    return (
        f"- Machine: {env['machine']}; load average before the run {load}\n"
        f"- Envoy: {env['envoy']}\n- wrk: {env['wrk']}\n- Run: {env['date']}\n"
    )


def _soak_section(soak: dict[str, Any]) -> str:
    options = soak["options"]
    bound = options["max_rss_growth"]
    rss_rows = [
        [name, _mib(soak["warm"][key]), _mib(soak["end"][key]), f"{soak['growth'][key]:+.1%}",
         f"≤ {bound:.0%}" if key != "envoy" else "(not bounded)",
         ("pass" if soak["growth"][key] <= bound else "FAIL") if key != "envoy" else ""]
        for name, key in (("router", "router"), ("control plane", "control_plane"),
                          ("Envoy", "envoy"))
    ]  # fmt: skip
    state = soak["final_state"]
    state_rows = [
        ["router: open ext_proc streams (one per request in flight)",
         "`prefix_router_open_streams`", "requests in flight", f"{state['open_streams']:g}"],
        ["router: in-flight count, all hosts", "sum of `prefix_router_in_flight_requests`",
         "requests in flight", f"{state['in_flight_total']:g}"],
        ["router: in-flight map entries (hosts with a request in flight)",
         "`prefix_router_in_flight_requests` > 0", "hosts", f"{state['in_flight_hosts_nonzero']}"],
        ["router: in-flight gauge series (one per host with a request in flight)",
         "`prefix_router_in_flight_requests` series", "hosts in flight",
         f"{state['in_flight_series']}"],
        ["router: prefix index blocks (its bound: each engine's cache, within index_max_blocks)",
         "`prefix_router_index_blocks`",
         f"{state.get('index_capacity_blocks', 0):g} (`prefix_router_index_capacity_blocks`)",
         f"{state.get('index_blocks', 0):g} ({state.get('index_evicted_blocks', 0):g} evicted)"],
        *([["router: views of the engines' caches from their KV events (router blocks)",
            "sum of `prefix_router_kv_events_blocks`",
            f"each engine's cache; hosts with a view: {state['kv_events_hosts_precise']:g}",
            f"{state['kv_events_blocks']:g} ({state['kv_events_events']:,.0f} events read)"]]
          if "kv_events_blocks" in state else []),
        ["router: prefix popularity counters (two windows of at most max_keys blocks each)",
         "`prefix_router_popularity_keys`", f"{2 * POPULARITY_MAX_KEYS:,} (2 x max_keys)",
         f"{state['popularity_keys']:g}" if "popularity_keys" in state else "not measured"],
        ["router: host set and load feed (one entry per host)", "`prefix_router_hosts`",
         "hosts", f"{state['router_hosts']:g}"],
        ["control plane: xDS streams", "`prefix_router_cp_xds_streams`",
         "Envoys + routers", f"{state['cp_xds_streams']:g}"],
        ["control plane: health states, load feed, snapshots",
         "`prefix_router_cp_hosts{state=discovered}`", "hosts",
         f"{state['cp_hosts_discovered']:g}"],
    ]  # fmt: skip
    checkpoint_rows = [
        [s["segment"], s["requests"], f"{s['t_s']:.0f}", f"{s['rps']:.0f}", f"{s['p99_ms']:.1f}",
         s["errors"], _mib(s["router_rss"]), _mib(s["cp_rss"]), f"{s['open_streams']:g}",
         s["in_flight_series"]]
        for s in soak["segments"]
    ]  # fmt: skip
    checkpoints = report.markdown_table(
        ["segment", "requests so far", "t (s)", "req/s", "p99 (ms)", "errors",
         "router RSS (MiB)", "control plane RSS (MiB)", "open streams", "in-flight series"],
        checkpoint_rows,
    )  # fmt: skip
    rss_table = report.markdown_table(
        ["process", "after warm-up (MiB)", "end (MiB)", "growth", "bound", ""], rss_rows
    )
    verdict = "passed" if soak["passed"] else "FAILED"
    state_verdict = (
        "nothing is left in flight and every entry is within its bound"
        if _state_is_idle(state, soak["options"]["backends"])
        else "something is left in flight, or an entry is over its bound"
    )
    leak = soak.get("stream_leak") or {}
    finding = ""
    if leak:
        finding = f"""
**Where the growth is.** `python -m extproc.bench.stream_leak` runs the router's own
ext_proc service with no Envoy, routing RANDOM (no state per prompt), and ends
{soak["options"]["leak_probe_streams"]:,} streams each way: its resident memory grew by
**{leak["reset"]:.0f} bytes per stream** when the
client half-closed and then cancelled each stream (what Envoy's ext_proc client does when a
request ends: `closeStream()` then `resetStream()`), and by {leak["close"]:.0f} bytes per
stream when the client read the status instead. grpc/grpc#43360 reports a leak in grpc.aio
on that path (a batch's `grpc_op` array, when a batch fails on a cancelled call); this run
does not tell whether it is the same one. The router's own state after the run is in the
table below, against its bounds: {state_verdict}.
"""
    events = ""
    if state.get("kv_events_hosts_precise"):
        events = (
            " The simulators publish their KV-cache events, as vLLM does, and the router"
            " follows every one: each new prefix is a stored block, and each eviction a"
            " removed one."
        )
    return f"""## Soak: {soak["requests"]:,} requests, every one a new prefix ({verdict})

wrk (one thread, {options["connections"]} connections, closed loop) sent
{soak["requests"]:,} chat requests of about {options["body_bytes"]} bytes through Envoy and
the router (PREFIX_AWARE, override-host mode, control plane on) to {options["backends"]}
simulated backends in {soak["load_s"]:.0f} s ({soak["requests"] / soak["load_s"]:.0f} req/s
on average), in segments of about {options["segment_s"]:g} s after a
{options["warmup_s"]:g} s warm-up. Every request's prompt starts with a number used
once in the run, and the tenant salt cycles through {options["tenants"]} values, so
any state kept per prefix or per tenant would grow with the request count.{events}
Errors: {soak["errors"]}. Router decisions: {soak["decisions"]:,.0f} (wrk counts only
completed responses; requests cut off at each segment's end are decided but not counted).

### Memory (resident set, VmRSS)

{rss_table}

![resident memory over the soak](reliability-soak.png)
{finding}
### Accounting and state after the run

The router's state is per host, per open stream, and the prefix index (bounded by each
engine's cache size, within `index_max_blocks`); the control plane's is per host and per
xDS stream. Their sizes after the last request finished:

{report.markdown_table(["state", "metric", "bounded by", "after the run"], state_rows)}

In flight at the end: **{state["in_flight_total"]:g}** (open streams {state["open_streams"]:g});
fallbacks {state["fallbacks"]:g}, protocol errors {state["protocol_errors"]:g}, xDS NACKs
{state["cp_xds_nacks"]:g}.

### Checkpoints

Read right after each segment's wrk exits: the open streams are requests wrk cut off,
still closing; after the run they drained to zero.

{checkpoints}

### Reproduce

```
{options["command"]}
```

{_environment(soak["environment"])}"""


def cpu_per_request_us(step: dict[str, Any]) -> float:
    """The routers' CPU per request achieved at one rate step, in µs."""
    return 1e6 * float(step["router_cpu"]) / float(step["achieved_rps"])


def _saturation_section(data: dict[str, Any]) -> str:
    options = data["options"]
    budget = options["added_p99_budget_ms"]

    def rate_text(rate: int | None) -> str:
        return f"{rate}" if rate is not None else f"below {options['rates'][0]}"

    max_rows = [
        [config, rate_text(rate), rate_text(data.get("capacity", {}).get(config))]
        for config, rate in data["max_rate"].items()
    ]
    step_rows = [
        [s["rate"], s["path"], f"{s['achieved_rps']:.0f}", f"{s['p50_ms']:.2f}",
         f"{s['p99_ms']:.2f}", f"{s['p99_added_ms']:+.2f}" if s["path"] != "envoy" else "",
         s["errors"], f"{s['router_cpu']:.2f}",
         f"{cpu_per_request_us(s):,.0f}" if s["path"] != "envoy" and s["achieved_rps"] else "",
         ("yes" if s["sustained"] else "no") if "sustained" in s else ""]
        for s in data["steps"]
    ]  # fmt: skip
    steps_table = report.markdown_table(
        ["rate (req/s)", "path", "achieved (req/s)", "p50 (ms)", "p99 (ms)", "p99 added (ms)",
         "errors", "router CPU", "router CPU per request (µs)", "sustained"],
        step_rows,
    )  # fmt: skip
    profile = data.get("profile") or {}
    if "self" in profile:
        headings = {
            "categories": "component (innermost frame that names one)",
            "self": "innermost frame",
            "router_inclusive": "router function, with what it calls",
        }
        frames = "\n\n".join(
            report.markdown_table(
                [heading, "share of samples"],
                [[f"`{frame}`" if kind != "categories" else frame, f"{share:.1%}"]
                 for frame, share in profile[kind]],
            )
            for kind, heading in headings.items()
            if profile.get(kind)
        )  # fmt: skip
        flame = (
            f"\n\nFlamegraph (Python frames only): [{profile['flamegraph']}]"
            f"({profile['flamegraph']})."
            if profile.get("flamegraph")
            else ""
        )
        raw = profile.get("raw", "reliability-profile.txt")
        profile_text = (
            f"py-spy (`--native`, so gRPC's Cython and C frames show) sampled the single "
            f"router at 100 Hz for {profile['seconds']:g} s while wrk drove it at "
            f"{profile['rate']} req/s (achieved {profile['rps']:.0f}, p99 "
            f"{profile['p99_ms']:.1f} ms): {profile['samples'][0][1]} thread stacks. With "
            "native frames py-spy also samples threads blocked in the kernel, so waiting "
            "has its own row; stacks with no Python frame at all are gRPC core's threads. "
            "Sampling native stacks pauses the process, so the latency during the profile "
            "says nothing about the router's. "
            f"Raw stacks: [{raw}]({raw}).\n\n"
            f"{frames}{flame}"
        )
    else:
        profile_text = f"Not profiled: {profile.get('skipped', 'profile_s was 0')}."
    pretty_rates = ", ".join(str(r) for r in options["rates"])
    envoy_rows = {s["rate"]: s for s in data["steps"] if s["path"] == "envoy"}
    notes = []
    for config in data["max_rate"]:
        rows = [s for s in data["steps"] if s["path"] == config]
        if not rows:
            continue
        low = rows[0]
        at_capacity = next(
            (s for s in rows if s["rate"] == data.get("capacity", {}).get(config)), None
        )
        note = (
            f"{config}: at {low['rate']} req/s it added "
            f"{low['p50_ms'] - envoy_rows[low['rate']]['p50_ms']:+.2f} ms at p50 and "
            f"{low['p99_added_ms']:+.2f} ms at p99"
        )
        if at_capacity is not None:
            note += (
                f"; at its capacity ({at_capacity['rate']} req/s) the routers used "
                f"{at_capacity['router_cpu']:.2f} of a core, "
                f"{cpu_per_request_us(at_capacity):,.0f} µs of CPU per request"
            )
        on_schedule = [
            step for step in rows if step["achieved_rps"] >= options["min_achieved"] * step["rate"]
        ]
        if len(on_schedule) >= 2:
            slope, intercept = statistics.linear_regression(
                [step["achieved_rps"] for step in on_schedule],
                [step["router_cpu"] for step in on_schedule],
            )
            note += (
                f"; its CPU fits {intercept:.2f} of a core plus {1e6 * slope:,.0f} µs per "
                f"request ({len(on_schedule)} rates)"
            )
        notes.append(f"- {note}.")
    summary = "\n".join(notes)
    max_table = report.markdown_table(
        ["router", f"max rate at p99 ≤ +{budget:g} ms (req/s)", "capacity (req/s)"],
        max_rows,
    )
    body_bytes = _body_bytes(data)
    name = saturation_name(body_bytes)
    size = "" if body_bytes == MAIN_BODY_BYTES else f" ({body_bytes:,}-byte bodies)"
    sim_cache = (
        f" Each simulator's KV cache holds {options['sim_capacity_blocks']:,} blocks, every "
        "prompt of the rotation, so a steady cache stores nothing new and the routers' CPU is "
        "the requests', not KV events from a churning cache (the cost per stored block is in "
        "[kv-events.md](kv-events.md))."
        if "sim_capacity_blocks" in options
        else ""
    )
    return f"""## Saturation{size}: the highest rate at p99 ≤ {budget:g} ms above plain Envoy

{max_table}

{summary}

Method: wrk with a Lua script that sends on a fixed schedule (wrk2-style constant arrival
rate: each free connection takes the next slot; {options["connections"]} connections),
{options["body_bytes"]}-byte chat bodies ({options["distinct_prompts"]} prompts in rotation),
rates {pretty_rates} req/s. At each rate plain Envoy (no ext_proc, same backends), Envoy
with one router (`1 worker`) and Envoy with `prefix-router router --workers 2`
(`2 workers`: two processes, two endpoints of the ext_proc cluster) run
{options["duration_s"]:g} s each, interleaved in a rotating order, {options["rounds"]}
rounds; cells are medians. A configuration sustains a rate when it
failed no request, achieved at least {options["min_achieved"]:.0%} of the scheduled rate
(below that the connections were all busy and queueing went unmeasured) and its p99 was at
most {budget:g} ms above Envoy's at the same rate. The ladder goes on past that rate to
find the capacity (the highest rate served in full and on schedule, whatever the
latency); a configuration stops after {options["failures_to_stop"]} rates in a row that it
could not keep up with. "router CPU" is the routers' CPU
time per second of wall time (1.00 = one core), both processes together, and "per
request" divides it by the requests achieved: what a deployment sizes cores by, at this
body size. It falls as the rate rises: part of the CPU is paid whatever the rate, so the
notes above fit a line (least squares over the rates a configuration served on schedule)
that splits it into a part per second and a part per request. Client, Envoy,
routers and backends share this machine's cores (see the machine line below).{sim_cache}

{steps_table}

![p99 against arrival rate](reliability-{name}.png)

In flight at the end: {", ".join(f"{k} {v:g}" for k, v in data["in_flight_end"].items())}.

### Where the router's time goes

{profile_text}

### Reproduce

```
{options["command"]}
```

{_environment(data["environment"])}"""


def _plot_soak(soak: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    times = [row[0] for row in soak["rss"]]
    for index, label in ((1, "router"), (2, "control plane"), (3, "Envoy")):
        axis.plot(times, [row[index] / MIB for row in soak["rss"]], label=label)
    axis.axvline(soak["warm_at_s"], color="grey", linestyle="--", label="end of warm-up")
    axis.set_xlabel("time (s)")
    axis.set_ylabel("resident memory (MiB)")
    axis.set_ylim(bottom=0)
    axis.set_title(f"Soak: {soak['requests']:,} requests, every one a new prefix")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_saturation(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, achieved) = plt.subplots(1, 2, figsize=(11, 4))
    budget = data["options"]["added_p99_budget_ms"]
    for name in ("envoy", *data["max_rate"]):
        rows = [s for s in data["steps"] if s["path"] == name]
        rates = [s["rate"] for s in rows]
        latency.plot(rates, [s["p99_ms"] for s in rows], marker="o", label=f"{name} p99")
        achieved.plot(rates, [s["achieved_rps"] for s in rows], marker="o", label=name)
    baseline = [s for s in data["steps"] if s["path"] == "envoy"]
    latency.plot(
        [s["rate"] for s in baseline],
        [s["p99_ms"] + budget for s in baseline],
        linestyle="--",
        color="grey",
        label=f"envoy p99 + {budget:g} ms",
    )
    latency.set_yscale("log")
    latency.set_xlabel("scheduled rate (req/s)")
    latency.set_ylabel("p99 latency (ms)")
    latency.legend()
    rates = [s["rate"] for s in baseline]
    achieved.plot(rates, rates, linestyle="--", color="grey", label="scheduled")
    achieved.set_xlabel("scheduled rate (req/s)")
    achieved.set_ylabel("achieved rate (req/s)")
    achieved.legend()
    figure.suptitle("Saturation: fixed-rate load through Envoy, with and without the router")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
