"""Soak: hundreds of thousands of requests, every one with a new prompt prefix, through the
full stack (Envoy, router, control plane, simulated backends).

It checks what a long run would expose: memory growth of the router and the control plane
(resident set after warm-up against the end), in-flight accounting that returns to zero,
and the size of every piece of state the router and control plane keep, read from their
metrics at each checkpoint. The load is wrk, closed loop, in time-bounded segments until
the request count is reached or the time budget is spent.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import lua, probes, wrk
from extproc.stack import prometheus
from extproc.stack.local import LocalStack, StackSpec
from extproc.stack.processes import ManagedProcess

log = structlog.get_logger("bench")

# Each segment numbers its prefixes from its own block, so no prefix repeats in a run.
PREFIX_BLOCK = 10_000_000


@dataclass(frozen=True)
class SoakOptions:
    requests: int = 1_000_000
    warmup_s: float = 10.0
    # Measured segments run about this long each (the last is cut to the remaining count).
    segment_s: float = 20.0
    connections: int = 16
    body_bytes: int = 1024
    tenants: int = 1000
    backends: int = 3
    # The whole load phase stops here even if the count was not reached. A million requests
    # took 13 minutes on this 2-core machine before the simulators published KV events
    # (2026-12-02); with them, 30,000-request runs went 300-380 req/s (2026-12-07): about
    # 55 minutes.
    budget_s: float = 4500.0
    # When the router grows past the bound: streams per ending for ``stream_leak``.
    leak_probe_streams: int = 20_000
    sample_interval_s: float = 1.0
    max_rss_growth: float = 0.10
    out_dir: Path = Path("docs/benchmarks")
    command: str = "prefix-router bench --workload soak"


@dataclass
class SoakResult:
    options: dict[str, Any]
    requests: int = 0
    errors: int = 0
    load_s: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)
    # (seconds since start, router RSS, control-plane RSS, Envoy RSS), bytes.
    rss: list[tuple[float, int, int, int]] = field(default_factory=list)
    warm_at_s: float = 0.0
    warm: dict[str, int] = field(default_factory=dict)
    end: dict[str, int] = field(default_factory=dict)
    growth: dict[str, float] = field(default_factory=dict)
    # State sizes read from metrics after the run has drained.
    final_state: dict[str, float] = field(default_factory=dict)
    decisions: float = 0.0
    # Router RSS bytes per ext_proc stream, by how the client ends it (``stream_leak``);
    # measured only when the router grew past the bound.
    stream_leak: dict[str, float] = field(default_factory=dict)

    @property
    def in_flight_end(self) -> float:
        return self.final_state.get("in_flight_total", -1.0)

    @property
    def passed(self) -> bool:
        bound = self.options["max_rss_growth"]
        return (
            self.in_flight_end == 0
            and self.final_state.get("open_streams", -1.0) == 0
            and self.final_state.get("index_blocks", 0.0)
            <= self.final_state.get("index_capacity_blocks", 0.0)
            and all(self.growth[name] <= bound for name in ("router", "control_plane"))
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "in_flight_end": self.in_flight_end, "passed": self.passed}


def _pid(process: ManagedProcess | None) -> int:
    assert process is not None and process.popen is not None
    return process.popen.pid


class _RssSampler(threading.Thread):
    """Samples the resident set of the three long-lived processes every interval."""

    def __init__(self, pids: tuple[int, int, int], interval_s: float) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self._pids = pids
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self.start_time = time.monotonic()
        self.samples: list[tuple[float, int, int, int]] = []

    def sample(self) -> tuple[float, int, int, int]:
        router, control_plane, envoy = (probes.rss_bytes(pid) for pid in self._pids)
        row = (round(time.monotonic() - self.start_time, 2), router, control_plane, envoy)
        self.samples.append(row)
        return row

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            try:
                self.sample()
            except (OSError, ValueError):
                return  # a process went away; the run will fail on its own

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def state_sizes(stack: LocalStack, control_plane_metrics: str) -> dict[str, float]:
    """Every piece of state the router and control plane keep, as their metrics show it.

    The router's per-prefix state is its prefix index, its views of the engines' caches
    from their KV events and its popularity windows, each bounded by configuration (the
    index and the views by each engine's cache size, within ``index_max_blocks``).
    The rest is per host (the in-flight map, the host set, the load feed) or per open
    stream; the control plane's is per host and per xDS stream.
    """
    router = probes.scrape(stack.router_metrics_url)
    control = probes.scrape(control_plane_metrics)
    return {
        "open_streams": probes.total(router, "prefix_router_open_streams"),
        "in_flight_total": probes.total(router, "prefix_router_in_flight_requests"),
        "in_flight_hosts_nonzero": sum(
            1
            for (name, _), value in router.items()
            if name == "prefix_router_in_flight_requests" and value
        ),
        "in_flight_series": probes.series(router, "prefix_router_in_flight_requests"),
        "router_hosts": probes.total(router, "prefix_router_hosts"),
        "feed_age_s": probes.total(router, "prefix_router_load_feed_age_seconds"),
        "index_blocks": probes.total(router, "prefix_router_index_blocks"),
        "index_capacity_blocks": probes.total(router, "prefix_router_index_capacity_blocks"),
        "index_evicted_blocks": probes.total(router, "prefix_router_index_evicted_blocks_total"),
        "popularity_keys": probes.total(router, "prefix_router_popularity_keys"),
        # The engines' KV events (the simulators publish them): hosts whose view they give,
        # the events read, and the router blocks the views hold (each bounded by its
        # engine's cache, as the index is).
        "kv_events_hosts_precise": prometheus.by_label(
            router, "prefix_router_kv_events_hosts", "state"
        ).get("precise", 0.0),
        "kv_events_events": prometheus.by_label(
            router, "prefix_router_kv_events_total", "kind"
        ).get("events", 0.0),
        "kv_events_blocks": probes.total(router, "prefix_router_kv_events_blocks"),
        "decisions": probes.total(router, "prefix_router_decisions_total"),
        "fallbacks": probes.total(router, "prefix_router_fallbacks_total"),
        "protocol_errors": probes.total(router, "prefix_router_protocol_errors_total"),
        "cp_xds_streams": probes.total(control, "prefix_router_cp_xds_streams"),
        "cp_hosts_discovered": control.get(
            ("prefix_router_cp_hosts", (("state", "discovered"),)), 0.0
        ),
        "cp_hosts_healthy": control.get(("prefix_router_cp_hosts", (("state", "healthy"),)), 0.0),
        "cp_xds_nacks": probes.total(control, "prefix_router_cp_xds_nacks_total"),
    }


def _drain(
    stack: LocalStack, control_plane_metrics: str, timeout_s: float = 10.0
) -> dict[str, Any]:
    """State sizes once the last requests have finished (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    state = state_sizes(stack, control_plane_metrics)
    while time.monotonic() < deadline and (state["open_streams"] or state["in_flight_total"]):
        time.sleep(0.2)
        state = state_sizes(stack, control_plane_metrics)
    return state


def measure(options: SoakOptions) -> SoakResult:
    result = SoakResult(options={k: str(v) if isinstance(v, Path) else v
                                 for k, v in asdict(options).items()})  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        work = Path(tmp)
        spec = StackSpec.ephemeral(
            options.backends,
            sim_args=("--ttft-ms", "0", "--itl-ms", "0"),
            upstream_host_header=False,
        )
        with LocalStack(spec) as stack:
            host, port = spec.control_plane_metrics
            cp_metrics = f"http://{host}:{port}/metrics"
            sampler = _RssSampler(
                (_pid(stack.router), _pid(stack.control_plane), _pid(stack.envoy)),
                options.sample_interval_s,
            )
            sampler.sample()
            sampler.start()
            started = time.monotonic()
            rate = 0.0
            try:
                segment = 0
                while result.requests < options.requests:
                    elapsed = time.monotonic() - started
                    if elapsed >= options.budget_s:
                        log.warning("soak.budget_spent", requests=result.requests)
                        break
                    if segment == 0:
                        duration = options.warmup_s
                    else:
                        remaining = (options.requests - result.requests) / max(rate, 1.0)
                        duration = min(options.segment_s, max(remaining, 1.0))
                    # wrk takes whole seconds.
                    duration = float(max(1, math.ceil(min(duration, options.budget_s - elapsed))))
                    script = lua.distinct_prefix_script(
                        work / f"soak-{segment}.lua",
                        segment * PREFIX_BLOCK + 1,
                        options.body_bytes,
                        options.tenants,
                    )
                    sample = wrk.run(stack.url, script, options.connections, duration)
                    rate = sample.requests_per_s
                    result.requests += sample.requests
                    result.errors += sample.errors
                    state = state_sizes(stack, cp_metrics)
                    _, router_rss, cp_rss, envoy_rss = sampler.sample()
                    checkpoint = {
                        "segment": segment,
                        "requests": result.requests,
                        "t_s": round(time.monotonic() - sampler.start_time, 1),
                        "rps": rate,
                        "p50_ms": sample.p50_ms,
                        "p99_ms": sample.p99_ms,
                        "errors": sample.errors,
                        "router_rss": router_rss,
                        "cp_rss": cp_rss,
                        "envoy_rss": envoy_rss,
                        **state,
                    }
                    result.segments.append(checkpoint)
                    log.info("soak.segment", **checkpoint)
                    if segment == 0:
                        result.warm_at_s = checkpoint["t_s"]
                        result.warm = {
                            "router": router_rss,
                            "control_plane": cp_rss,
                            "envoy": envoy_rss,
                        }
                    segment += 1
                result.load_s = round(time.monotonic() - started, 1)
                result.final_state = _drain(stack, cp_metrics)
                _, router_rss, cp_rss, envoy_rss = sampler.sample()
            finally:
                sampler.stop()
            result.end = {"router": router_rss, "control_plane": cp_rss, "envoy": envoy_rss}
            result.growth = {
                name: round(result.end[name] / result.warm[name] - 1.0, 4) for name in result.end
            }
            result.decisions = result.final_state["decisions"]
            result.rss = sampler.samples
    return result


def run(options: SoakOptions) -> SoakResult:
    from extproc.bench import reliability_report

    env = reliability_report.environment()
    result = measure(options)
    if result.growth["router"] > options.max_rss_growth and options.leak_probe_streams:
        from extproc.bench import stream_leak

        result.stream_leak = {
            ending: round(stream_leak.growth_per_stream(ending, options.leak_probe_streams), 1)
            for ending in ("close", "reset")
        }
    reliability_report.save(options.out_dir, "soak", result.to_json(), env)
    return result
