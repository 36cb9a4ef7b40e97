"""Scale event: a long-context run during which the fleet grows from 7 to 8 instances and
then shrinks to 6, through the control plane's config file, as an operator would.

The simulators' prefix-cache counters are read every ``window_s`` (model time) while the
load runs, so the hit rate is known window by window: the report shows how far it dips
after each event and how long it takes to come back. The fraction of prefixes moved is
measured from the traffic: a document's home is the instance that served most of its
requests, before and after the event.

Paths whose host set follows the control plane (our router; Envoy's ring_hash, which reads
the same EDS) take part; the peers are given a static worker list, so they do not.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import report
from extproc.bench.counters import prefix_counters
from extproc.bench.fleet import (
    OUR_PATHS,
    RING_HASH,
    Fleet,
    FleetBenchOptions,
    path_url,
    reset_caches,
)
from extproc.bench.fleet_paths import reads_events
from extproc.bench.loadgen import RequestOutcome, run_open_loop
from extproc.bench.workloads import BenchRequest, WorkloadSpec, describe, generate
from extproc.control.config import ControlPlaneConfig
from extproc.picker.hosts import HostSet
from extproc.picker.keys import KeyMode, extract_key
from extproc.picker.placement import key_digest, placement_order
from extproc.stack.processes import wait_until

log = structlog.get_logger("bench")

SCALE_PATHS = ("RANDOM", "PREFIX_AWARE", RING_HASH)
PREFIX_LENGTH = FleetBenchOptions.prefix_length
DIP_HORIZON_S = 10.0  # model seconds after a change in which its dip is looked for


@dataclass(frozen=True)
class ScaleEventOptions:
    workload: WorkloadSpec = field(
        default_factory=lambda: WorkloadSpec(name="long-context", rate_per_s=16.0, duration_s=75.0)
    )
    instances: int = 7
    grow_at_s: float = 25.0  # model time: 7 -> 8
    shrink_at_s: float = 50.0  # 8 -> 6: the new instance and one of the first 7 leave
    window_s: float = 2.5
    recovered_within: float = 0.05  # back within 5 points of the hit rate before the event
    paths: tuple[str, ...] = SCALE_PATHS
    time_scale: float = 1.0
    sim_args: tuple[str, ...] = FleetBenchOptions.sim_args
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = ""


@dataclass(frozen=True)
class EventResult:
    """One fleet change as one path saw it (times in model seconds from the start)."""

    name: str
    written_at_s: float  # the control plane's config file edited
    applied_at_s: float | None  # the path's host set changed
    baseline: float  # hit rate in the windows before the event
    lowest: float  # lowest window hit rate after it
    recovery_s: float | None  # from applied to the end of the first window back near baseline
    moved: float | None  # fraction of documents whose home instance changed
    documents: int  # documents seen often enough on both sides to have a home
    moved_by_hash: float | None = None  # our router's placement of every document's key


@dataclass
class ScalePathResult:
    path: str
    outcomes: list[RequestOutcome]
    windows: list[tuple[float, float]]  # (window end, model s; hit rate in the window)
    hit_rate: float
    events: list[EventResult] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes)


def _path_hosts(fleet: Fleet, path: str) -> set[str] | int:
    """What the path routes over now: Envoy's host set, or the router's host count."""
    stack = fleet.stack
    assert stack is not None
    if path == RING_HASH:
        assert fleet.ring_hash_admin_url is not None
        return stack.envoy_hosts(admin_url=fleet.ring_hash_admin_url)
    return int(stack.router_metric("prefix_router_hosts") or 0)


def _publish(fleet: Fleet, hosts: Sequence[str]) -> None:
    assert fleet.stack is not None
    fleet.stack.write_control_plane_config(hosts=list(hosts))


def _wait_for_fleet(fleet: Fleet, hosts: Sequence[str]) -> None:
    stack = fleet.stack
    assert stack is not None and fleet.ring_hash_admin_url is not None
    admin = fleet.ring_hash_admin_url

    def settled() -> bool:
        return (
            stack.router_metric("prefix_router_hosts") == len(hosts)
            and stack.envoy_hosts() == set(hosts)
            and stack.envoy_hosts(admin_url=admin) == set(hosts)
        )

    wait_until(settled, 60, f"{len(hosts)} hosts everywhere")


def _homes(outcomes: Sequence[tuple[float, RequestOutcome]], start: float, end: float) -> dict:  # type: ignore[type-arg]
    """Each group's most frequent instance among its requests sent in [start, end)."""
    served: dict[str, Counter[str]] = defaultdict(Counter)
    for sent, outcome in outcomes:
        if start <= sent < end and outcome.ok and outcome.served_by:
            served[outcome.group][outcome.served_by] += 1
    return {g: c.most_common(1)[0][0] for g, c in served.items() if sum(c.values()) >= 3}


def placement_moved(
    requests: Sequence[BenchRequest], before: Sequence[str], after: Sequence[str], length: int
) -> float:
    """Fraction of the workload's distinct keys whose first host (rendezvous hashing, as our
    router places them) differs between the two host sets: what moves without overflow."""
    digests = {}
    for request in requests:
        if request.group not in digests:
            headers = {name.lower(): value for name, value in request.headers.items()}
            body = json.dumps(request.body).encode()
            key = extract_key(body, headers, KeyMode.OPENAI, length)
            digests[request.group] = key_digest(key.key, key.salt)
    old, new = HostSet.of(before), HostSet.of(after)
    moved = sum(placement_order(d, old)[0] != placement_order(d, new)[0] for d in digests.values())
    return moved / len(digests)


def moved_fraction(before: dict, after: dict) -> tuple[float | None, int]:  # type: ignore[type-arg]
    common = [g for g in before if g in after]
    if not common:
        return None, 0
    return sum(before[g] != after[g] for g in common) / len(common), len(common)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def analyse_event(
    name: str,
    windows: Sequence[tuple[float, float]],
    written_at: float,
    applied_at: float | None,
    previous_event: float,
    next_event: float,
    sent: Sequence[tuple[float, RequestOutcome]],
    window_s: float,
    tolerance: float,
) -> EventResult:
    """Dip and recovery from the windowed hit rates; prefixes moved from the homes.

    One window's hit rate is noisy (a few dozen requests, each miss an 8k-token document),
    so the dip and the recovery read a rolling mean of two windows."""
    start = applied_at if applied_at is not None else written_at
    # Baseline: the windows of the 10 s before the config edit, after the previous event.
    since = max(previous_event, written_at - 10)
    before = [h for end, h in windows if end - window_s >= since and end <= written_at]
    baseline = _mean(before)
    # From the window the change falls in to the next event; the dip is looked for in the
    # first DIP_HORIZON_S, where the change can cause it, not in later noise.
    after = [(end, h) for end, h in windows if end > start and end <= next_event]
    rolling = [(after[i][0], (after[i - 1][1] + after[i][1]) / 2) for i in range(1, len(after))]
    early = [h for end, h in rolling if end <= start + DIP_HORIZON_S + window_s]
    lowest = min(early, default=float("nan"))
    recovery: float | None = None
    if not rolling or baseline != baseline:
        pass  # too short to tell
    elif lowest >= baseline - tolerance:
        recovery = 0.0  # no dip beyond the tolerance
    else:
        low_at = next(end for end, h in rolling if h == lowest)
        recovery = next(
            (end - start for end, h in rolling if end > low_at and h >= baseline - tolerance),
            None,  # not back before the next event
        )
    moved, documents = moved_fraction(
        _homes(sent, previous_event, written_at), _homes(sent, start + window_s, next_event)
    )
    return EventResult(name, written_at, applied_at, baseline, lowest, recovery, moved, documents)


class _Sampler:
    """Reads the fleet's counters every window and watches the path's host set, in a
    thread beside the load (which owns the event loop)."""

    def __init__(self, fleet: Fleet, path: str, window_s: float, started: float) -> None:
        self.fleet = fleet
        self.path = path
        self.window_s = window_s
        self.started = started
        self.windows: list[tuple[float, float]] = []
        self.changes: list[tuple[float, set[str] | int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def model_now(self) -> float:
        return (time.monotonic() - self.started) / self.fleet.options.time_scale

    def _run(self) -> None:
        queries0, hits0 = prefix_counters(self.fleet.all_addresses)
        hosts = _path_hosts(self.fleet, self.path)
        next_window = self.window_s
        while not self.stop.is_set():
            if self.stop.wait(0.2 * self.fleet.options.time_scale):
                break
            now = self.model_now()
            current = _path_hosts(self.fleet, self.path)
            if current != hosts:
                hosts = current
                self.changes.append((now, current))
            if now >= next_window:
                queries, hits = prefix_counters(self.fleet.all_addresses)
                rate = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
                self.windows.append((next_window, rate))
                queries0, hits0 = queries, hits
                next_window += self.window_s


def run_path(
    fleet: Fleet, options: ScaleEventOptions, path: str, requests: list[BenchRequest]
) -> ScalePathResult:
    initial = fleet.addresses
    spare = fleet.all_addresses[len(initial)]
    grown = [*initial, spare]
    shrunk = initial[1:]  # the new instance and the first of the original ones leave
    _publish(fleet, initial)
    _wait_for_fleet(fleet, initial)
    url = path_url(fleet, path)
    assert url is not None
    stack = fleet.stack if reads_events(path) else None
    reset_caches(fleet.all_addresses, stack, followed=len(initial))
    queries_before, hits_before = prefix_counters(fleet.all_addresses)
    scale = options.time_scale
    started = time.monotonic()
    sampler = _Sampler(fleet, path, options.window_s, started)
    written: dict[str, float] = {}

    async def events() -> None:
        size = len(initial)
        for name, at_s, hosts in (
            (f"grow {size} to {size + 1}", options.grow_at_s, grown),
            (f"shrink {size + 1} to {size - 1}", options.shrink_at_s, shrunk),
        ):
            await asyncio.sleep(max(0.0, started + at_s * scale - time.monotonic()))
            _publish(fleet, hosts)
            written[name] = sampler.model_now()
            log.info("bench.scale_event", path=path, change=name, at_s=round(written[name], 2))

    async def load() -> list[RequestOutcome]:
        run, _ = await asyncio.gather(
            run_open_loop(f"{url}/v1/chat/completions", requests, scale), events()
        )
        return run[0]

    sampler.thread.start()
    try:
        outcomes = asyncio.run(load())
    finally:
        sampler.stop.set()
        sampler.thread.join(30)
    queries, hits = prefix_counters(fleet.all_addresses)
    result = ScalePathResult(
        path,
        outcomes,
        sampler.windows,
        (hits - hits_before) / max(1.0, queries - queries_before),
    )
    sent = [(r.at_s, o) for r, o in zip(requests, outcomes, strict=True)]
    names = list(written)
    bounds = [0.0, *written.values(), float("inf")]
    fleets = [initial, grown, shrunk]
    for index, name in enumerate(names):
        applied = next((t for t, _ in sampler.changes if t >= written[name]), None)
        event = analyse_event(
            name,
            sampler.windows,
            written[name],
            applied,
            bounds[index],
            bounds[index + 2],
            sent,
            options.window_s,
            options.recovered_within,
        )
        if path in OUR_PATHS and path != "RANDOM":
            by_hash = placement_moved(requests, fleets[index], fleets[index + 1], PREFIX_LENGTH)
            event = replace(event, moved_by_hash=by_hash)
        result.events.append(event)
    log.info("bench.scale_path", path=path, hit_rate=round(result.hit_rate, 3))
    return result


def run(options: ScaleEventOptions) -> list[ScalePathResult]:
    unknown = [p for p in options.paths if p not in OUR_PATHS and p != RING_HASH]
    if unknown:
        raise ValueError(f"scale-event runs our paths and {RING_HASH} only, not {unknown}")
    requests = generate(options.workload)
    fleet_options = FleetBenchOptions(
        workload=options.workload,
        instances=options.instances,
        spare_instances=1,
        time_scale=options.time_scale,
        sim_args=options.sim_args,
        paths=options.paths,
        out_dir=None,
    )
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        fleet = Fleet(fleet_options, Path(tmp))
        try:
            fleet.start()
            results = [run_path(fleet, options, path, requests) for path in options.paths]
        finally:
            fleet.stop()
    if options.out_dir is not None:
        write_report(options, results, len(requests))
    return results


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None or value != value else f"{value:{spec}}{suffix}"


def document(
    options: ScaleEventOptions, results: list[ScalePathResult], count: int
) -> dict[str, Any]:
    """The stored run: the options, every path's windows, events and outcomes, the machine."""
    return {
        "kind": "scale-event",
        "format": 1,
        "command": options.command,
        "workload": asdict(options.workload),
        "description": describe(options.workload),
        "requests": count,
        "instances": options.instances,
        "grow_at_s": options.grow_at_s,
        "shrink_at_s": options.shrink_at_s,
        "window_s": options.window_s,
        "recovered_within": options.recovered_within,
        "dip_horizon_s": DIP_HORIZON_S,
        "time_scale": options.time_scale,
        "sim_args": list(options.sim_args),
        "health": ControlPlaneConfig().health.model_dump(),
        "results": [asdict(r) for r in results],
        "machine": report.machine_description(),
    }


def render(data: dict[str, Any]) -> str:
    """The report, from the stored run alone."""
    results = [
        ScalePathResult(
            r["path"],
            [RequestOutcome(**o) for o in r["outcomes"]],
            [tuple(w) for w in r["windows"]],
            r["hit_rate"],
            [EventResult(**e) for e in r["events"]],
        )
        for r in data["results"]
    ]
    rows = []
    for r in results:
        for e in r.events:
            delay = None if e.applied_at_s is None else e.applied_at_s - e.written_at_s
            rows.append(
                [
                    r.path,
                    e.name,
                    _fmt(delay, ".1f"),
                    _fmt(e.baseline, ".1%"),
                    _fmt(e.lowest, ".1%"),
                    _fmt(None if e.lowest != e.lowest else e.baseline - e.lowest, ".1%"),
                    _fmt(e.recovery_s, ".1f"),
                    "n/a" if r.path == "RANDOM" else _fmt(e.moved, ".3f"),
                    e.documents,
                    _fmt(e.moved_by_hash, ".3f"),
                ]
            )
    table = report.markdown_table(
        ["path", "event", "applied after (s)", "hit rate before", "lowest after",
         "dip", "recovery (s)", "prefixes moved", "documents", "fixed key would move"],
        rows,
    )  # fmt: skip
    totals = report.markdown_table(
        ["path", "hit rate, whole run", "requests", "failed"],
        [[r.path, f"{r.hit_rate:.1%}", len(r.outcomes), r.failures] for r in results],
    )
    window = data["window_s"]
    health = data["health"]
    instances = data["instances"]
    return f"""# Scale event: long-context while the fleet grows {instances} → {instances + 1} and \
shrinks to {instances - 1}

<!-- Rendered from scale-event.json by extproc/bench/scale_event.py. -->

{data["requests"]} requests of the long-context workload, open loop, through each path in
turn (one run, side by side). At {data["grow_at_s"]:g} s an extra instance is added to the
control plane's config file; at {data["shrink_at_s"]:g} s that instance and one of the first
{instances} are removed ({instances - 1} left). Nothing else is touched: the control plane
health-checks the new host, publishes the new set over xDS, and the router (and the
ring_hash Envoy, on the same EDS) follow. Every simulator's prefix cache is reset before
each path; the new instance starts cold.

{table}

![hit rate over time](scale-event.png)

- **applied after**: model seconds from the config edit to the path's host set changing
  (the router's `prefix_router_hosts`, or the ring_hash Envoy's `/clusters`); the control
  plane admits a new host after {health["healthy_threshold"]} passing health checks,
  {health["interval_s"]:g} s apart.
- **hit rate before**: fleet-wide prefix-cache hit rate (`vllm:prefix_cache_hits_total /
  vllm:prefix_cache_queries_total`, summed over the instances) in the {window:g}-s windows
  of the 10 s before the edit; **lowest after** is the lowest rolling mean of two windows
  ({2 * window:g} s) from the window the change falls in to {data["dip_horizon_s"]:g} s after
  it, and **recovery** runs from the change to the end of the first such mean, after the
  lowest, that is back within {data["recovered_within"] * 100:.0f} points of the hit rate
  before (0: no dip beyond that; n/a: not back before the next event). The plot shows the
  single windows.
- **prefixes moved**: among documents with at least 3 requests on each side, the fraction
  whose home (the instance that served most of their requests) differs before and after the
  event. RANDOM has no homes. **fixed key would move**: the same question answered exactly
  for `prefix_match: fixed`, from the rendezvous placement of every document's fixed-length
  key over the two host sets (no overflow, no traffic noise): what a router that ignores
  where prefixes are cached would move.
- The peers (vllm-router, smg) take a static worker list and are not part of this run.

{totals}

## Workload

{data["description"]}

```
{data["command"]}
```

- Simulator: `prefix-router sim --timing model` (see the long-context report), KV capacity
  `{" ".join(data["sim_args"])}`; time_scale {data["time_scale"]:g}.
- Machine: {data["machine"]}
"""


def render_plots(data: dict[str, Any], out_dir: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    instances = data["instances"]
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for r in data["results"]:
        if r["windows"]:
            ends, rates = zip(*r["windows"], strict=True)
            axis.plot(ends, rates, marker=".", label=r["path"])
    markers = [
        (data["grow_at_s"], f"{instances} → {instances + 1}"),
        (data["shrink_at_s"], f"{instances + 1} → {instances - 1}"),
    ]
    for at_s, label in markers:
        axis.axvline(at_s, color="black", linestyle="--")
        axis.text(at_s, 0.02, f" {label}", rotation=90, va="bottom")
    axis.set_ylim(0, 1)
    axis.set_xlabel(f"model time (s); hit rate per {data['window_s']:g}-s window")
    axis.set_ylabel("fleet prefix-cache hit rate")
    axis.set_title("Scale event during long-context: hit rate over time")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)


def write_report(options: ScaleEventOptions, results: list[ScalePathResult], count: int) -> Path:
    """Store the run as JSON, then render the report and the plot from what was stored."""
    assert options.out_dir is not None
    return report.write_rendered(options.out_dir, "scale-event", document(options, results, count))


def quick(options: ScaleEventOptions) -> ScaleEventOptions:
    """The smoke size: shorter, fewer documents, PREFIX_AWARE only."""
    workload = replace(options.workload, duration_s=24.0, documents=12, rate_per_s=10.0)
    return replace(
        options, workload=workload, grow_at_s=8.0, shrink_at_s=16.0, paths=("PREFIX_AWARE",)
    )
