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
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
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
from extproc.bench.loadgen import RequestOutcome, run_open_loop
from extproc.bench.workloads import BenchRequest, WorkloadSpec, describe, generate
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


def _envoy_hosts(admin_url: str) -> set[str]:
    text = httpx.get(f"{admin_url}/clusters", timeout=2).text
    return {
        line.split("::")[1]
        for line in text.splitlines()
        if line.startswith("vllm::") and line.split("::")[2] == "cx_active"
    }


def _path_hosts(fleet: Fleet, path: str) -> set[str] | int:
    """What the path routes over now: Envoy's host set, or the router's host count."""
    stack = fleet.stack
    assert stack is not None
    if path == RING_HASH:
        assert fleet.ring_hash_admin_url is not None
        return _envoy_hosts(fleet.ring_hash_admin_url)
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
            and _envoy_hosts(admin) == set(hosts)
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
    reset_caches(fleet.all_addresses)
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


def write_report(options: ScaleEventOptions, results: list[ScalePathResult], count: int) -> Path:
    assert options.out_dir is not None
    options.out_dir.mkdir(parents=True, exist_ok=True)
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
         "dip", "recovery (s)", "prefixes moved", "documents", "keys moved by hash"],
        rows,
    )  # fmt: skip
    totals = report.markdown_table(
        ["path", "hit rate, whole run", "requests", "failed"],
        [[r.path, f"{r.hit_rate:.1%}", len(r.outcomes), r.failures] for r in results],
    )
    text = f"""# Scale event: long-context while the fleet grows 7 → 8 and shrinks to 6

{count} requests of the long-context workload, open loop, through each path in turn (one
run, side by side, on this 2-core machine shared with other work). At
{options.grow_at_s:g} s an 8th instance is added to the control plane's config file; at
{options.shrink_at_s:g} s that instance and one of the first seven are removed (6 left).
Nothing else is touched: the control plane health-checks the new host, publishes the new
set over xDS, and the router (and the ring_hash Envoy, on the same EDS) follow. Every
simulator's prefix cache is reset before each path; the new instance starts cold.

{table}

![hit rate over time](scale-event.png)

- **applied after**: model seconds from the config edit to the path's host set changing
  (the router's `prefix_router_hosts`, or the ring_hash Envoy's `/clusters`); the control
  plane admits a new host after 2 passing health checks, 1 s apart.
- **hit rate before**: fleet-wide prefix-cache hit rate (`vllm:prefix_cache_hits_total /
  vllm:prefix_cache_queries_total`, summed over the instances) in the
  {options.window_s:g}-s windows of the 10 s before the edit. One window holds a few dozen
  requests, each miss a whole 8k-token document, so single windows are noisy (see the
  plot); **lowest after** is the lowest rolling mean of two windows
  ({2 * options.window_s:g} s) from the window the change falls in to
  {DIP_HORIZON_S:g} s after it, and **recovery** runs
  from the change to the end of the first such mean, after the lowest, that is back within
  {options.recovered_within * 100:.0f} points of the hit rate before (0: no dip beyond
  that; n/a: not back before the next event).
- **prefixes moved**: among documents with at least 3 requests on each side, the fraction
  whose home (the instance that served most of their requests) differs before and after the
  event. Rendezvous hashing should move about 1/8 on 7 → 8 (the keys the new instance wins)
  and about 2/8 on 8 → 6 (the keys of the two that leave), and nothing else; documents that
  overflow often can have a noisy home. RANDOM has no homes. **keys moved by hash**: the
  same question answered exactly for our router, from its rendezvous placement of every
  document's key over the two host sets (no overflow, no traffic noise).
- The peers (vllm-router, smg) take a static worker list and are not part of this run.

{totals}

## Workload

{describe(options.workload)}

```
{options.command}
```

- Simulator: `prefix-router sim --timing model` (see the long-context report), KV capacity
  `{" ".join(options.sim_args)}`; time_scale {options.time_scale:g}.
- Machine: {report.machine_description()}
"""
    path = options.out_dir / "scale-event.md"
    path.write_text(text)
    _plot(options, results, options.out_dir / "scale-event.png")
    return path


def _plot(options: ScaleEventOptions, results: list[ScalePathResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    for r in results:
        if r.windows:
            ends, rates = zip(*r.windows, strict=True)
            axis.plot(ends, rates, marker=".", label=r.path)
    markers = [(options.grow_at_s, "7 → 8"), (options.shrink_at_s, "8 → 6")]
    for at_s, label in markers:
        axis.axvline(at_s, color="black", linestyle="--")
        axis.text(at_s, 0.02, f" {label}", rotation=90, va="bottom")
    axis.set_ylim(0, 1)
    axis.set_xlabel(f"model time (s); hit rate per {options.window_s:g}-s window")
    axis.set_ylabel("fleet prefix-cache hit rate")
    axis.set_title("Scale event during long-context: hit rate over time")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def quick(options: ScaleEventOptions) -> ScaleEventOptions:
    """The smoke size: shorter, fewer documents, PREFIX_AWARE only."""
    workload = replace(options.workload, duration_s=24.0, documents=12, rate_per_s=10.0)
    return replace(
        options, workload=workload, grow_at_s=8.0, shrink_at_s=16.0, paths=("PREFIX_AWARE",)
    )
