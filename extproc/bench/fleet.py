"""The fleet benchmark: one workload, one fleet of simulated vLLM instances, every routing
path side by side in one run.

Paths: our Envoy + router with RANDOM, LEAST_OUTSTANDING_REQUESTS and PREFIX_AWARE (longest
match, the default), PREFIX_AWARE with SageMaker's fixed-length key, and PREFIX_AWARE with two
router replicas behind the one Envoy; Envoy's own ring_hash on a session header (no
ext_proc); and, when installed (`pip install envoy-prefix-router[bench]`), the peers
vllm-router (cache_aware, consistent_hash) and smg (cache_aware). Before each path every
instance's prefix cache is reset, and before each of ours the routers restart with the
path's settings, so each path starts cold, prefix index included.

Two optional measurements per path: the routing overhead (the simulators set to answer at
once, the same request sent alternately straight to an instance and through the path,
median of N each) and a closed-loop saturation run (fixed concurrency, the simulators'
model slowed by ``closed_loop_time_scale`` so the fleet, not this machine's CPU, is the
bottleneck), whose completions per second are the capacity of path and fleet together.

Time is compressed by ``time_scale``: the simulators' modelled durations and the arrival
times are both multiplied by it, and measured times are divided by it, so results are in
model time. Fixed costs that do not scale (Envoy, the router, Python) are inflated by
1/time_scale in the results; the report says so.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import httpx
import structlog

from extproc.bench import report
from extproc.bench.counters import prefix_counters
from extproc.bench.loadgen import RequestOutcome, run_closed_loop, run_open_loop
from extproc.bench.probes import wait_for_idle_pressure
from extproc.bench.workloads import BenchRequest, WorkloadSpec, describe, generate
from extproc.config import RouterConfig
from extproc.control.loadfeed import parse_vllm_metrics
from extproc.stack.local import LocalStack, StackSpec, start_envoy
from extproc.stack.processes import ManagedProcess, free_port, free_ports, http_ok, wait_until

log = structlog.get_logger("bench")

OUR_STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE")
# PREFIX_AWARE with overflow switched off: no concurrency limit worth the name, no balance
# bound. The hot-spot workload compares it with the default.
NO_OVERFLOW = "PREFIX_AWARE-no-overflow"
# SageMaker's behaviour: a hash of the first prefix_length characters.
FIXED = "PREFIX_AWARE-fixed"
# The default, with two router replicas that Envoy spreads the ext_proc streams over.
TWO_REPLICAS = "PREFIX_AWARE-two-replicas"
OUR_PATHS = {
    **{strategy: {"routing_strategy": strategy} for strategy in OUR_STRATEGIES},
    FIXED: {"routing_strategy": "PREFIX_AWARE", "prefix_match": "fixed"},
    TWO_REPLICAS: {"routing_strategy": "PREFIX_AWARE"},
    NO_OVERFLOW: {
        "routing_strategy": "PREFIX_AWARE",
        "concurrency_threshold": 1024,
        "balance_factor": None,
    },
}
REPLICAS = {TWO_REPLICAS: 2}
RING_HASH = "envoy-ring-hash"
PEERS = {
    "vllm-router-cache-aware": ("vllm-router", "cache_aware"),
    "vllm-router-consistent-hash": ("vllm-router", "consistent_hash"),
    "smg-cache-aware": ("smg", "cache_aware"),
}
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class FleetBenchOptions:
    workload: WorkloadSpec
    instances: int = 7
    time_scale: float = 1.0
    # About 7.8 documents of 8k tokens per instance: the fleet holds the working set only
    # if placement keeps each document on few instances (as in the reference setup, where
    # RANDOM's hit rate was ~25%).
    sim_args: tuple[str, ...] = ("--capacity-blocks", "4000")
    concurrency_threshold: int = 32
    prefix_length: int = 8192
    paths: tuple[str, ...] = (*OUR_STRATEGIES, FIXED, TWO_REPLICAS, RING_HASH, *PEERS)
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = ""
    # Instances started but not published at first (the scale-event benchmark adds them).
    spare_instances: int = 0
    # Routing overhead: this many probes per path and per direct call; 0 skips it.
    overhead_probes: int = 0
    # Closed-loop saturation run after the open loop, for these paths; 0 clients skips it.
    closed_loop_concurrency: int = 0
    closed_loop_requests: int = 300
    closed_loop_time_scale: float = 4.0
    closed_loop_time_limit_s: float = 90.0
    # Not every path: each saturation run takes about a minute of wall time.
    closed_loop_paths: tuple[str, ...] = ("RANDOM", "PREFIX_AWARE", RING_HASH)
    # The report's file name (without .md); None: the workload's name.
    report_name: str | None = None


def default_paths(workload: str) -> tuple[str, ...]:
    """Every path; the hot spot adds PREFIX_AWARE without overflow, to show what it buys."""
    paths = FleetBenchOptions.paths
    if workload == "hot-spot":
        at = paths.index("PREFIX_AWARE") + 1
        paths = (*paths[:at], NO_OVERFLOW, *paths[at:])
    return paths


# The hot spot sends ~8 requests/s of one cached document to one instance. A 70B instance
# with vLLM's default of 256 sequences serves that easily (see engine.py), so no instance
# would be overloaded at this machine's request rates; with at most 16 sequences at once
# (a memory-tight long-context deployment) one instance decodes ~7.5 such requests/s, and
# the hot one queues unless its traffic overflows.
HOT_SPOT_SIM_ARGS = ("--max-num-seqs", "16")


def default_sim_args(workload: str) -> tuple[str, ...]:
    extra = HOT_SPOT_SIM_ARGS if workload == "hot-spot" else ()
    return (*FleetBenchOptions.sim_args, *extra)


@dataclass
class ClosedLoopResult:
    """A saturation run: requests completed per second of model time."""

    concurrency: int
    completed: int
    failed: int
    requests_per_s: float
    tokens_per_s: float
    hit_rate: float
    ttft_p50_ms: float


@dataclass
class PathResult:
    path: str
    outcomes: list[RequestOutcome]
    wall_s: float
    time_scale: float
    hit_rate: float
    overflow_rate: float | None = None
    skipped: str | None = None
    shares: dict[str, float] = field(default_factory=dict)
    overhead_ms: float | None = None  # p50 added over the direct call, zero-latency backend
    # The prefix index's own estimate of the hit rate (matched / prompt bytes), ours only.
    index_estimate: float | None = None
    closed_loop: ClosedLoopResult | None = None

    def ttfts_ms(self) -> list[float]:
        return sorted(o.ttft_s * 1000 / self.time_scale for o in self.outcomes if o.ok and o.ttft_s)

    def percentile(self, q: float) -> float:
        values = self.ttfts_ms()
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    @property
    def requests_per_s(self) -> float:
        done = sum(o.ok for o in self.outcomes)
        return done / (self.wall_s / self.time_scale) if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(o.output_tokens for o in self.outcomes if o.ok)
        return tokens / (self.wall_s / self.time_scale) if self.wall_s else 0.0


def reset_caches(addresses: Sequence[str]) -> None:
    """Wait for the instances to go idle, then empty their prefix caches."""

    def idle() -> bool:
        loads = [parse_vllm_metrics(httpx.get(f"http://{a}/metrics").text, 0.0) for a in addresses]
        return all(load.running == 0 and load.waiting == 0 for load in loads)

    wait_until(idle, 120, "the simulators to go idle")
    for address in addresses:
        httpx.post(f"http://{address}/reset_prefix_cache").raise_for_status()


def _router_counter(stack: LocalStack, name: str) -> float:
    """``name`` summed over its label sets and over the running router replicas."""
    total = 0.0
    for replica, process in enumerate(stack.routers):
        if process is None:
            continue
        text = httpx.get(stack.replica_metrics_url(replica)).text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )
    return total


def _answers_chat(url: str) -> bool:
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Fleet:
    """The simulated instances (one process, one aiohttp app each) and our stack."""

    def __init__(self, options: FleetBenchOptions, work: Path) -> None:
        self.options = options
        self.work = work
        hosts = [f"127.0.0.{31 + i}" for i in range(options.instances + options.spare_instances)]
        port = free_port(hosts[0])
        self.all_addresses = [f"{h}:{port}" for h in hosts]  # every simulator started
        self.addresses = self.all_addresses[: options.instances]  # the fleet at first
        self.sim: ManagedProcess | None = None
        self.stack: LocalStack | None = None
        self.ring_hash_url: str | None = None
        self.ring_hash_admin_url: str | None = None
        self._extra: list[ManagedProcess] = []

    def start(self) -> None:
        args = ["sim", "--timing", "model", "--time-scale", str(self.options.time_scale)]
        for address in self.all_addresses:
            args += ["--address", address]

        self.sim = ManagedProcess(
            "sims",
            [sys.executable, "-m", "extproc", *args, *self.options.sim_args],
            self.work / "sims.log",
        ).start()
        for address in self.all_addresses:
            wait_until(lambda a=address: http_ok(f"http://{a}/health"), 60, address, self.sim)
        backends = tuple((a.split(":")[0], int(a.split(":")[1])) for a in self.addresses)
        spec = StackSpec.ephemeral(
            0,
            external_backends=backends,
            router_settings={
                "concurrency_threshold": self.options.concurrency_threshold,
                "prefix_length": self.options.prefix_length,
            },
            upstream_host_header=False,
            router_replicas=max([1, *(REPLICAS.get(p, 1) for p in self.options.paths)]),
            work_dir=self.work / "stack",
        )
        self.stack = LocalStack(spec).start()
        listen, admin = free_ports(2)
        ring_hash = replace(
            self.stack.bootstrap_params(),
            ext_proc=False,
            ring_hash_header=SESSION_HEADER,
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
        )
        self._extra.append(start_envoy("envoy-ring-hash", ring_hash, self.work / "stack"))
        wait_until(
            lambda: self.stack is not None and self.stack.envoy_hosts() == set(self.addresses),
            30,
            "the fleet in the baseline Envoy",
        )
        self.ring_hash_url = f"http://127.0.0.1:{listen}"
        self.ring_hash_admin_url = f"http://127.0.0.1:{admin}"

    def set_time_scale(self, value: float) -> None:
        """Every simulator's time_scale, changed at run time (sim-only endpoint)."""
        for address in self.all_addresses:
            response = httpx.post(f"http://{address}/sim/time_scale", json={"time_scale": value})
            response.raise_for_status()

    def start_peer(self, name: str) -> str | None:
        binary, policy = PEERS[name]
        # Installed beside this Python (the bench extra), or anywhere on PATH.
        beside = Path(sys.executable).parent / binary
        path = str(beside) if beside.exists() else shutil.which(binary)
        if path is None:
            return None
        port, metrics_port = free_ports(2)
        argv = [path, *(["launch"] if binary == "smg" else [])]
        argv += [
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *[f"http://{a}" for a in self.addresses],
            "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        process = ManagedProcess(name, argv, self.work / f"{name}.log").start()
        self._extra.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers_chat(url), 60, name, process)
        return url

    def stop(self) -> None:
        for process in reversed(self._extra):
            process.stop()
        if self.stack is not None:
            self.stack.stop()
        if self.sim is not None:
            self.sim.stop()


def path_url(fleet: Fleet, path: str) -> str | None:
    """Switch to ``path`` (our router by config hot reload; a peer by starting it) and
    return its base URL; None when the peer is not installed."""
    stack = fleet.stack
    assert stack is not None
    if path in OUR_PATHS:
        stack.write_router_config(**OUR_PATHS[path])
        stack.restart_routers(REPLICAS.get(path, 1))
        return stack.url
    if path == RING_HASH:
        return fleet.ring_hash_url
    if path in PEERS:
        return fleet.start_peer(path)
    raise ValueError(f"unknown path {path!r}")


def _probe_body(requests: list[BenchRequest]) -> dict:  # type: ignore[type-arg]
    return {**requests[0].body, "max_tokens": 1, "stream": False}


async def _probe_pairs(
    direct: str,
    routed: str,
    body: dict[str, object],
    headers: dict[str, str],
    probes: int,
) -> list[float]:
    """Seconds each back-to-back (direct, routed) pair differs by, after 3 warm-up pairs."""
    added = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for index in range(probes + 3):
            took = []
            for target in (direct, routed):
                started = time.perf_counter()
                async with session.post(target, json=body, headers=headers) as response:
                    await response.read()
                    response.raise_for_status()
                took.append(time.perf_counter() - started)
            if index >= 3:  # the first rounds warm connections up
                added.append(took[1] - took[0])
    return added


def measure_overhead(fleet: Fleet, url: str, body: dict, probes: int) -> float:  # type: ignore[type-arg]
    """Median over pairs of (latency through ``url`` minus latency straight to an instance),
    with the simulators answering at once; each pair is sent back to back, after a warm-up."""
    options = fleet.options
    fleet.set_time_scale(0.0)
    direct = f"http://{fleet.addresses[0]}/v1/chat/completions"
    routed = f"{url}/v1/chat/completions"
    headers = {SESSION_HEADER: "overhead-probe"}
    try:
        added = asyncio.run(_probe_pairs(direct, routed, body, headers, probes))
    finally:
        fleet.set_time_scale(options.time_scale)
    return statistics.median(added) * 1000


def run_closed(fleet: Fleet, url: str, requests: list[BenchRequest]) -> ClosedLoopResult:
    """A saturation run: the model slowed to closed_loop_time_scale, fixed concurrency."""
    options = fleet.options
    scale = options.closed_loop_time_scale
    reset_caches(fleet.addresses)
    fleet.set_time_scale(scale)
    try:
        queries_before, hits_before = prefix_counters(fleet.addresses)
        outcomes, wall = asyncio.run(
            run_closed_loop(
                f"{url}/v1/chat/completions",
                requests[: options.closed_loop_requests],
                options.closed_loop_concurrency,
                options.closed_loop_time_limit_s,
            )
        )
        queries, hits = prefix_counters(fleet.addresses)
    finally:
        reset_caches(fleet.addresses)  # waits for idle first
        fleet.set_time_scale(options.time_scale)
    ok = [o for o in outcomes if o.ok]
    model_s = wall / scale if wall else float("inf")
    ttfts = sorted(o.ttft_s * 1000 / scale for o in ok if o.ttft_s)
    return ClosedLoopResult(
        concurrency=options.closed_loop_concurrency,
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        requests_per_s=len(ok) / model_s,
        tokens_per_s=sum(o.output_tokens for o in ok) / model_s,
        hit_rate=(hits - hits_before) / max(1.0, queries - queries_before),
        ttft_p50_ms=ttfts[len(ttfts) // 2] if ttfts else float("nan"),
    )


def run_path(fleet: Fleet, path: str, requests: list[BenchRequest]) -> PathResult:
    options = fleet.options
    stack = fleet.stack
    assert stack is not None
    decisions_before = overflows_before = prompt_before = matched_before = 0.0
    url = path_url(fleet, path)
    if url is None:
        return PathResult(path, [], 0.0, options.time_scale, 0.0, skipped="not installed")
    overhead_ms = None
    if options.overhead_probes:
        overhead_ms = measure_overhead(fleet, url, _probe_body(requests), options.overhead_probes)
    if path in OUR_PATHS:
        if options.overhead_probes:  # the probes taught the index one prompt: start afresh
            stack.restart_routers(REPLICAS.get(path, 1))
        # Every path starts from an idle fleet, as from cold caches: no cache pressure left
        # from the path (or the probes) before.
        wait_for_idle_pressure(stack)
        decisions_before = _router_counter(stack, "prefix_router_decisions_total")
        overflows_before = _router_counter(stack, "prefix_router_overflows_total")
        prompt_before = _router_counter(stack, "prefix_router_prompt_bytes_total")
        matched_before = _router_counter(stack, "prefix_router_matched_bytes_total")
    reset_caches(fleet.addresses)
    queries_before, hits_before = prefix_counters(fleet.addresses)
    outcomes, wall = asyncio.run(
        run_open_loop(f"{url}/v1/chat/completions", requests, options.time_scale)
    )
    queries, hits = prefix_counters(fleet.addresses)
    result = PathResult(
        path,
        outcomes,
        wall,
        options.time_scale,
        (hits - hits_before) / max(1.0, queries - queries_before),
    )
    served = Counter(o.served_by for o in outcomes if o.ok)
    total = sum(served.values()) or 1
    result.shares = {a: served.get(a, 0) / total for a in fleet.addresses}
    result.overhead_ms = overhead_ms
    if path in OUR_PATHS:
        decisions = _router_counter(stack, "prefix_router_decisions_total") - decisions_before
        overflows = _router_counter(stack, "prefix_router_overflows_total") - overflows_before
        result.overflow_rate = overflows / decisions if decisions else 0.0
        prompt = _router_counter(stack, "prefix_router_prompt_bytes_total") - prompt_before
        matched = _router_counter(stack, "prefix_router_matched_bytes_total") - matched_before
        result.index_estimate = matched / prompt if prompt else None
    if options.closed_loop_concurrency and path in options.closed_loop_paths:
        result.closed_loop = run_closed(fleet, url, requests)
    log.info(
        "bench.path",
        path=path,
        p50_ms=round(result.percentile(0.5), 1),
        hit_rate=round(result.hit_rate, 3),
        failures=result.failures,
    )
    return result


def run(options: FleetBenchOptions) -> list[PathResult]:
    requests = generate(options.workload)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        fleet = Fleet(options, Path(tmp))
        try:
            fleet.start()
            results = [run_path(fleet, path, requests) for path in options.paths]
        finally:
            fleet.stop()
    if options.out_dir is not None:
        write_report(options, results, len(requests))
    return results


def _ratio(value: float, base: float) -> str:
    if not base or value != value or base != base:
        return "n/a"
    return f"{(value / base - 1) * 100:+.0f}%"


def write_report(options: FleetBenchOptions, results: list[PathResult], count: int) -> Path:
    assert options.out_dir is not None
    options.out_dir.mkdir(parents=True, exist_ok=True)
    name = options.report_name or options.workload.name
    base = next((r for r in results if r.path == "RANDOM" and not r.skipped), None)
    rows = []
    for r in results:
        if r.skipped:
            rows.append([r.path, f"skipped: {r.skipped}", *[""] * 13])
            continue
        shares = [s for s in r.shares.values()]
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
    table = report.markdown_table(
        ["path", "TTFT p50 (ms)", "p90", "p99", "req/s", "output tok/s", "hit rate",
         "index estimate",
         "per-instance share", "overflow", "failed", "p50 vs RANDOM", "p90 vs RANDOM",
         "req/s vs RANDOM", "routing overhead p50 (ms)"],
        rows,
    )  # fmt: skip
    text = f"""# Fleet benchmark: {name}

{count} requests of the `{options.workload.name}` workload, open loop, sent through each
routing path in turn to the same {options.instances} simulated vLLM instances (prefix caches
reset before each path; before each of ours, the routers restart with an empty index and the
run waits until no cache pressure is left from the path before). Times are model time (see
below).

{table}

![TTFT CDF]({name}-ttft.png)
![hit rate and share]({name}-share.png)
{_extra_sections(options, results)}
## Workload

{describe(options.workload)}

## How this was measured

- Simulator: `prefix-router sim --timing model`, vLLM's timing shape (prefill cost per
  uncached token, continuous batching, block-level LRU prefix cache that keeps generated
  output too, as vLLM's does); defaults calibrated
  to ~270 ms TTFT for an uncached 8k-token prompt and ~60 ms cached.
- Time compression: time_scale = {options.time_scale}. Simulated durations and arrival times
  are multiplied by it and measured times divided by it. Costs that do not scale (Envoy,
  router, Python: a few ms) appear {1 / options.time_scale:g} times larger than they are.
- Router: default settings but concurrency_threshold {options.concurrency_threshold}
  (`{FIXED}`: prefix_length {options.prefix_length}); before each of our paths the router
  processes restart with its settings, so the prefix index starts empty as the caches do.
- Index estimate: the router's own estimate of the hit rate, the bytes its prefix index
  believed the chosen host held over the bytes routed (`prefix_router_matched_bytes_total /
  prefix_router_prompt_bytes_total`). Its distance from the measured hit rate bounds what
  exact cache events from the engines could add.
- Envoy ring_hash: no ext_proc; consistent hashing on the `{SESSION_HEADER}` header
  (the document, conversation or tenant id), which a client must supply.
- Peers: vllm-router and smg from PyPI (`pip install .[bench]`), pointed at the same
  instances; a path marked skipped was not installed.

```
{options.command}
```

- Machine: {report.machine_description()}
"""
    path = options.out_dir / f"{name}.md"
    path.write_text(text)
    # The raw results beside the report, for re-rendering and later analysis.
    (options.out_dir / f"{name}.json").write_text(
        json.dumps(
            {
                "command": options.command,
                "workload": asdict(options.workload),
                "instances": options.instances,
                "time_scale": options.time_scale,
                "requests": count,
                "results": [asdict(r) for r in results],
            },
            default=str,
        )
        + "\n"
    )
    _plot(results, options, name)
    return path


def _extra_sections(options: FleetBenchOptions, results: list[PathResult]) -> str:
    return (
        _replicas_section(results)
        + _hot_spot_section(options, results)
        + _overhead_section(options, results)
        + _closed_loop_section(options, results)
    )


def _replicas_section(results: list[PathResult]) -> str:
    by_path = {r.path: r for r in results if not r.skipped}
    one, two = by_path.get("PREFIX_AWARE"), by_path.get(TWO_REPLICAS)
    if one is None or two is None:
        return ""
    points = (two.hit_rate - one.hit_rate) * 100
    return f"""
**Two router replicas** (`{TWO_REPLICAS}`): Envoy spreads the ext_proc streams over two
router processes (least-request), each with its own prefix index and no link between
them. Hit rate {two.hit_rate:.1%} against {one.hit_rate:.1%} for one replica: {points:+.1f}
points.
"""


def _hot_spot_section(options: FleetBenchOptions, results: list[PathResult]) -> str:
    by_path = {r.path: r for r in results if not r.skipped}
    on, off = by_path.get("PREFIX_AWARE"), by_path.get(NO_OVERFLOW)
    if options.workload.name != "hot-spot" or on is None or off is None:
        return ""
    rows = [
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
    table = report.markdown_table(
        ["", "PREFIX_AWARE (overflow on)", NO_OVERFLOW, "on vs off"], rows
    )
    hot_rate = options.workload.rate_per_s * options.workload.hot_share
    defaults = RouterConfig()
    return f"""
## Overflow against the hot spot

One document takes {options.workload.hot_share:.0%} of the requests. `{NO_OVERFLOW}` is
PREFIX_AWARE with its load terms switched off (`concurrency_threshold` 1024,
`balance_factor` null). With the defaults (`concurrency_threshold`
{options.concurrency_threshold}, `balance_factor` {defaults.balance_factor}, never below
{defaults.balance_min_in_flight} in flight), the hot document is spread over a consistent
set of instances in proportion to its share of the traffic, and a host past its balance
bound costs `overload_cost` {defaults.overload_cost} of a prompt per request over it.

{table}

The simulated instances run with `{" ".join(HOT_SPOT_SIM_ARGS)}`. A 70B instance with
vLLM's default of 256 sequences decodes far more than the hot document's ~{hot_rate:g}
requests/s (see `extproc/sim/engine.py`), so at the request rates this machine can drive no
instance would be overloaded. With at most 16 sequences at once (a memory-tight
long-context deployment) and decode steps that grow with the batch's context
(`attention_ms_per_kv_token`), one instance serves ~7.5 such requests/s, and the hot
document's home queues unless its traffic overflows.
"""


def _overhead_section(options: FleetBenchOptions, results: list[PathResult]) -> str:
    if not options.overhead_probes:
        return ""
    return f"""
**Routing overhead** (last column): before its run, each path is probed with the simulators
set to answer at once (`POST /sim/time_scale` 0): the workload's first request (one whole
document, `max_tokens` 1, not streamed), {options.overhead_probes} times through the path and
{options.overhead_probes} times straight to one instance, in back-to-back pairs after 3
warm-up pairs; the column is the median over pairs of path minus direct, in wall-clock ms
(not scaled). One client at a time, on the same 2 shared cores as every proxy and the
simulators, beside other work: differences under ~0.5 ms are noise.
"""


def _closed_loop_section(options: FleetBenchOptions, results: list[PathResult]) -> str:
    ran = [r for r in results if r.closed_loop is not None]
    if not ran:
        return ""
    base = next((r.closed_loop for r in ran if r.path == "RANDOM"), None)
    rows = []
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
    table = report.markdown_table(
        ["path", "req/s at saturation", "output tok/s", "req/s vs RANDOM", "hit rate",
         "TTFT p50 (ms)", "completed", "failed"],
        rows,
    )  # fmt: skip
    return f"""
## Throughput at saturation (closed loop)

The open loop above offers a fixed rate, below the fleet's capacity, so its req/s is about
the arrival rate whatever the path. Here {options.closed_loop_concurrency} clients each send
their next request as soon as the last one ends (the first {options.closed_loop_requests}
requests of the same schedule, arrival times ignored, at most
{options.closed_loop_time_limit_s:g} s), so the fleet is saturated and completions per second
are its capacity under each path. To keep the fleet, not this machine's CPU, the bottleneck,
the simulators' model runs {options.closed_loop_time_scale:g} times slower than model time
during these runs (`POST /sim/time_scale`); rates are converted back to model time. Caches
are reset before each run.

{table}
"""


def _plot(results: list[PathResult], options: FleetBenchOptions, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if not r.skipped and r.ttfts_ms()]
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
    assert options.out_dir is not None
    figure.savefig(options.out_dir / f"{name}-ttft.png", dpi=100)
    plt.close(figure)

    figure, (hits, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits.bar([r.path for r in ran], [r.hit_rate for r in ran])
    hits.set_ylabel("prefix-cache hit rate")
    hits.tick_params(axis="x", rotation=60, labelsize=7)
    width = 0.8 / max(1, len(ran))
    for index, r in enumerate(ran):
        xs = [i + index * width for i in range(len(r.shares))]
        shares.bar(xs, list(r.shares.values()), width, label=r.path)
    shares.axhline(1 / options.instances, color="black", linestyle="--")
    shares.set_xlabel("instance")
    shares.set_ylabel("share of requests")
    shares.legend(fontsize=6)
    figure.suptitle(f"{name}: hit rate and per-instance share")
    figure.tight_layout()
    figure.savefig(options.out_dir / f"{name}-share.png", dpi=100)
    plt.close(figure)
