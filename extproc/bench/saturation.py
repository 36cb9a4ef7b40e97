"""Saturation: the highest request rate the router sustains at a p99 no more than a budget
above plain Envoy's, for one router and for ``router --workers 2``, and where its time
goes.

Load is wrk driven at fixed arrival rates (see ``lua.paced_script``), stepped up a ladder.
At each rate, plain Envoy (no ext_proc, same backends), Envoy with one router and Envoy
with one router of two workers run interleaved in a rotating
order, ``rounds`` times; each cell is the median. Each worker is an endpoint of the
ext_proc cluster. A configuration sustains a rate when it
served every request, kept up with the schedule, and its p99 exceeded Envoy's by at most
the budget. The ladder goes on past that to find each configuration's capacity (the
highest rate it keeps up with, whatever the latency); a configuration drops out after
``failures_to_stop`` rates in a row that it could not keep up with. Then py-spy samples
the single router at its capacity.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import lua, probes, reliability_report, report, wrk
from extproc.bench.overhead import chat_bodies
from extproc.sim.options import DEFAULT_CAPACITY_BLOCKS, SimOptions
from extproc.stack.local import LocalStack, StackSpec, start_envoy, start_router
from extproc.stack.processes import ManagedProcess, free_port_run, free_ports, wait_until

log = structlog.get_logger("bench")

BASELINE = "envoy"
CONFIGS = ("1 worker", "2 workers")
WORKERS = {"1 worker": 1, "2 workers": 2}
PATHS = (BASELINE, *CONFIGS)
PY_SPY_MISSING = "py-spy is not installed (pip install py-spy)"
# The simulator's blocks at its defaults (16 tokens of 4 characters), and its default cache.
SIM_BLOCK_CHARS = SimOptions.block_size_tokens * SimOptions.chars_per_token
DEFAULT_SIM_BLOCKS = DEFAULT_CAPACITY_BLOCKS["fixed"]


@dataclass(frozen=True)
class SaturationOptions:
    rates: tuple[int, ...] = (50, 100, 200, 300, 400, 600, 800, 1000, 1300, 1600, 2000)
    duration_s: float = 4.0
    rounds: int = 3
    connections: int = 64
    body_bytes: int = reliability_report.MAIN_BODY_BYTES
    distinct_prompts: int = 16
    backends: int = 3
    added_p99_budget_ms: float = 5.0
    # Achieved over scheduled rate below which the step is not sustained.
    min_achieved: float = 0.95
    # Rates in a row a configuration could not keep up with before it drops out.
    failures_to_stop: int = 2
    profile_s: float = 10.0
    # The ladder stops here whatever is left of it.
    budget_s: float = 480.0
    out_dir: Path = Path("docs/benchmarks")
    command: str = "prefix-router bench --workload saturation"


@dataclass
class SaturationResult:
    options: dict[str, Any]
    # One row per (rate, path): medians over rounds.
    steps: list[dict[str, Any]] = field(default_factory=list)
    max_rate: dict[str, int | None] = field(default_factory=dict)
    # The highest rate each configuration kept up with (no failed request), any latency.
    capacity: dict[str, int | None] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    in_flight_end: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sim_capacity_blocks(options: SaturationOptions) -> int:
    """Each simulator's KV cache holds every prompt of the rotation, with a quarter to
    spare: plain Envoy sends every prompt to every instance, and a cache smaller than that
    would evict and store blocks on every request, so the routers would be charged for
    ingesting a churning cache's KV events (at 32 KiB, up to a core)
    rather than for deciding. A steady fleet's cache stores nothing new for a prompt it
    holds; the cost per stored block is measured apart (docs/benchmarks/kv-events.md)."""
    per_prompt = -(-options.body_bytes // SIM_BLOCK_CHARS)
    return max(DEFAULT_SIM_BLOCKS, math.ceil(1.25 * options.distinct_prompts * per_prompt))


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor's workers), from /proc."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        try:
            with open(f"/proc/{current}/task/{current}/children") as children:
                todo += [int(child) for child in children.read().split()]
        except OSError:
            continue
    return pids


def _tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for member in _process_tree(pid):
        with contextlib.suppress(OSError):
            total += probes.cpu_seconds(member)
    return total


def _whole_seconds(seconds: float) -> float:
    """wrk takes whole seconds."""
    return float(max(1, math.ceil(seconds)))


def _pid(process: ManagedProcess) -> int:
    assert process.popen is not None
    return process.popen.pid


def _knows_hosts(metrics_url: str, count: int) -> bool:
    return probes.total(probes.scrape(metrics_url), "prefix_router_hosts") == count


def _kept_up(row: dict[str, Any], options: SaturationOptions) -> bool:
    return bool(row["errors"] == 0 and row["achieved_rps"] >= options.min_achieved * row["rate"])


def _sustained(row: dict[str, Any], options: SaturationOptions) -> bool:
    return _kept_up(row, options) and row["p99_added_ms"] <= options.added_p99_budget_ms


# Where a sample's time went, by the innermost frame that names a known component
# (first match wins, so the order matters).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("router code (extproc/)", ("extproc/",)),
    ("protobuf (parse, build, serialise)", ("protobuf", "_message", "upb")),
    ("key parsing and hashing (jiter, xxhash)", ("jiter", "xxhash")),
    ("gRPC (grpc.aio, Cython and C core)", ("grpc",)),
    ("Prometheus metrics server thread", ("prometheus_client", "socketserver")),
    ("asyncio event loop", ("asyncio/", "selectors.py")),
)


# Innermost native frames that mean the thread was waiting, not working.
WAITING = ("epoll_wait", "epoll_pwait", "poll (", "select (", "pthread_cond_", "sem_wait")


def _category(frames: list[str]) -> str:
    if any(frames[-1].startswith(marker) for marker in WAITING):
        return "waiting (epoll, poll, condition variables)"
    if not any(".py" in frame for frame in frames):
        # The router's only threads without Python frames are gRPC core's own.
        return "gRPC core threads (native code only)"
    for frame in reversed(frames):
        for name, markers in CATEGORIES:
            if any(marker in frame for marker in markers):
                return name
    return "other (interpreter, libc)"


def top_frames(collapsed: str, limit: int = 12) -> dict[str, list[tuple[str, float]]]:
    """Shares of py-spy's raw (collapsed) samples: by component, by innermost frame
    ("self"), and by router function including what it calls ("router_inclusive")."""
    categories: Counter[str] = Counter()
    own: Counter[str] = Counter()
    router: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # A native frame without a symbol is an address and its library: keep the library.
        frames = [re.sub(r"^0x[0-9a-f]+ ", "[no symbol] ", f.strip()) for f in stack.split(";")]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        categories[_category(frames)] += count
        for frame in {f for f in frames if "extproc/" in f and "extproc/cli" not in f}:
            if "__main__" not in frame:
                router[frame] += count
    if not total:
        return {"categories": [], "self": [], "router_inclusive": [], "samples": []}

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(f, round(c / total, 4)) for f, c in counter.most_common(n)]

    return {
        "categories": shares(categories, len(CATEGORIES) + 1),
        "self": shares(own, limit),
        "router_inclusive": shares(router, limit),
        "samples": [("total", total)],
    }


def find_py_spy() -> str | None:
    """The py-spy binary: on PATH, or beside this interpreter (a virtualenv's bin)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return py_spy if Path(py_spy).exists() else None


def _artifact(options: SaturationOptions, suffix: str) -> str:
    """reliability-profile.txt for the main ladder, reliability-saturation-32768-profile.txt
    for another body size, so one run never overwrites the other's."""
    if options.body_bytes == reliability_report.MAIN_BODY_BYTES:
        return f"reliability-{suffix}"
    return f"reliability-{reliability_report.saturation_name(options.body_bytes)}-{suffix}"


def _profile(options: SaturationOptions, pid: int, url: str, script: Path) -> dict[str, Any]:
    py_spy = find_py_spy()
    if py_spy is None:
        return {"skipped": PY_SPY_MISSING}
    raw = options.out_dir / _artifact(options, "profile.txt")
    svg = options.out_dir / _artifact(options, "flamegraph.svg")
    seconds = str(max(1, round(options.profile_s)))
    common = ["record", "--pid", str(pid), "--duration", seconds, "--rate", "100", "--function"]
    # The table needs native frames (gRPC's work is in Cython and C); the flamegraph
    # samples without pausing the process.
    argvs = [
        [py_spy, *common, "--native", "--format", "raw", "-o", str(raw)],
        [py_spy, *common, "--nonblocking", "--format", "flamegraph", "-o", str(svg)],
    ]
    recorders = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for argv in argvs
    ]
    errors: list[bytes] = []
    try:
        time.sleep(0.5)  # let py-spy attach before the load starts
        load = wrk.run(url, script, options.connections, _whole_seconds(options.profile_s + 1))
        for recorder in recorders:
            errors.append(recorder.communicate(timeout=options.profile_s + 60)[1])
    finally:
        for recorder in recorders:
            if recorder.poll() is None:
                recorder.kill()
            recorder.communicate(timeout=5)  # reaps it and closes its pipe
    if not raw.exists():
        stderr = errors[0].decode(errors="replace") if errors else ""
        return {"skipped": f"py-spy failed: {stderr.strip()[:300]}"}
    frames = top_frames(raw.read_text())
    return {
        "rps": load.requests_per_s,
        "p99_ms": load.p99_ms,
        "seconds": options.profile_s,
        "flamegraph": svg.name if svg.exists() else None,
        "raw": raw.name,
        **frames,
    }


def measure(options: SaturationOptions) -> SaturationResult:
    result = SaturationResult(
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}
    )
    result.options["sim_capacity_blocks"] = sim_capacity_blocks(options)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-saturation-") as tmp:
        work = Path(tmp)
        spec = StackSpec.ephemeral(
            options.backends,
            sim_args=(
                *("--ttft-ms", "0", "--itl-ms", "0"),
                *("--capacity-blocks", str(sim_capacity_blocks(options))),
            ),
            upstream_host_header=False,
            work_dir=work / "stack",
        )
        stack = LocalStack(spec)
        processes: list[ManagedProcess] = []
        try:
            stack.start_sims()
            stack.start_control_plane()
            assert spec.control_plane is not None
            # Each router's workers listen on consecutive ports: the 1-worker router on
            # one port, the 2-worker router on a run of two.
            grpc_base, metrics_base = free_port_run(3), free_port_run(3)
            ports = free_ports(6)
            routers = [
                start_router(
                    f"router-{n}",
                    work,
                    ("127.0.0.1", grpc_base + n),
                    ("127.0.0.1", metrics_base + n),
                    spec.control_plane,
                    WORKERS[config],
                )
                for n, config in zip((0, 1), CONFIGS, strict=True)
            ]
            processes += routers
            metrics_urls = [f"http://127.0.0.1:{metrics_base + e}/metrics" for e in range(3)]
            for url in metrics_urls:  # router-0's worker, then router-1's two
                wait_until(
                    functools.partial(_knows_hosts, url, options.backends),
                    30.0,
                    f"the router on {url} to know the fleet",
                )
            base = stack.bootstrap_params()
            router_sets = {
                BASELINE: (),
                "1 worker": (("127.0.0.1", grpc_base),),
                "2 workers": (("127.0.0.1", grpc_base + 1), ("127.0.0.1", grpc_base + 2)),
            }
            urls = {}
            for n, path in enumerate(PATHS):
                listen, admin = ports[2 * n], ports[2 * n + 1]
                params = replace(
                    base,
                    listen=("127.0.0.1", listen),
                    admin=("127.0.0.1", admin),
                    ext_proc=path != BASELINE,
                    routers=router_sets[path] or base.routers,
                )
                processes.append(start_envoy(f"envoy-{n}", params, work))
                urls[path] = f"http://127.0.0.1:{listen}"
            bodies = chat_bodies(options.distinct_prompts, options.body_bytes)
            _ladder(options, result, urls, bodies, routers, work)
            best = result.capacity.get("1 worker") or options.rates[0]
            script = lua.paced_script(work / "profile.lua", "/v1/chat/completions", bodies, best)
            if options.profile_s > 0:
                result.profile = _profile(options, _pid(routers[0]), urls["1 worker"], script)
                result.profile["rate"] = best
            for n, url in enumerate(metrics_urls):
                deadline = time.monotonic() + 10
                while True:
                    samples = probes.scrape(url)
                    in_flight = probes.total(samples, "prefix_router_in_flight_requests")
                    if in_flight == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                result.in_flight_end[f"endpoint-{n}"] = in_flight
        finally:
            for process in reversed(processes):
                process.stop()
            stack.stop()
    return result


def _ladder(
    options: SaturationOptions,
    result: SaturationResult,
    urls: dict[str, str],
    bodies: list[bytes],
    routers: list[ManagedProcess],
    work: Path,
) -> None:
    started = time.monotonic()
    seconds = _whole_seconds(options.duration_s)
    # Warm every path (connections, Envoy's health checks, the routers' first decisions).
    warm = lua.paced_script(work / "warm.lua", "/v1/chat/completions", bodies, options.rates[0])
    for path in PATHS:
        wrk.run(urls[path], warm, 8, 1.0)
    failures = dict.fromkeys(CONFIGS, 0)
    capacity: dict[str, int | None] = dict.fromkeys(CONFIGS, None)
    best: dict[str, int | None] = dict.fromkeys(CONFIGS, None)
    for rate in options.rates:
        alive = [c for c in CONFIGS if failures[c] < options.failures_to_stop]
        if not alive or time.monotonic() - started > options.budget_s:
            break
        script = lua.paced_script(work / f"rate-{rate}.lua", "/v1/chat/completions", bodies, rate)
        paths = [BASELINE, *alive]
        samples: dict[str, list[tuple[wrk.WrkResult, float]]] = {p: [] for p in paths}
        for round_number in range(options.rounds):
            shift = round_number % len(paths)
            for path in paths[shift:] + paths[:shift]:
                cpu_before = [_tree_cpu_seconds(_pid(r)) for r in routers]
                sample = wrk.run(urls[path], script, options.connections, seconds)
                cpu = sum(
                    _tree_cpu_seconds(_pid(r)) - before
                    for r, before in zip(routers, cpu_before, strict=True)
                )
                samples[path].append((sample, cpu / seconds))
        baseline_p99 = report.median(s.p99_ms for s, _ in samples[BASELINE])
        for path in paths:
            runs = samples[path]
            row: dict[str, Any] = {
                "rate": rate,
                "path": path,
                "achieved_rps": report.median(s.requests_per_s for s, _ in runs),
                "p50_ms": report.median(s.p50_ms for s, _ in runs),
                "p90_ms": report.median(s.p90_ms for s, _ in runs),
                "p99_ms": report.median(s.p99_ms for s, _ in runs),
                "errors": sum(s.errors for s, _ in runs),
                "router_cpu": round(report.median(c for _, c in runs), 3),
            }
            row["p99_added_ms"] = round(row["p99_ms"] - baseline_p99, 3)
            if path != BASELINE:
                row["sustained"] = _sustained(row, options)
                if row["sustained"]:
                    best[path] = rate
                if _kept_up(row, options):
                    failures[path] = 0
                    capacity[path] = rate
                else:
                    failures[path] += 1
            result.steps.append(row)
            log.info("saturation.step", **row)
    result.max_rate = best
    result.capacity = capacity


def run(options: SaturationOptions) -> SaturationResult:
    env = reliability_report.environment()
    result = measure(options)
    name = reliability_report.saturation_name(options.body_bytes)
    reliability_report.save(options.out_dir, name, result.to_json(), env)
    return result
