"""Concurrency: thousands of streaming requests in flight at once through one Envoy and the
router, and the highest count that still holds on this machine.

For each level of a ladder, a fresh stack (the router at its defaults, Envoy from the
generated bootstrap, ``backends`` simulated vLLM instances whose replies stream for
``stream_s``) takes ``level`` streaming chat completions, started evenly over ``ramp_s``
and each held to the end of its reply, so all of them are in flight together for most of
a reply. A level holds when every request gets its whole reply, the router decides every
one (its decisions counter rises by exactly ``level``: none failed open), Envoy's breaker,
timeout and fail-open counters stay at 0, and in flight is back to 0 at the end. Every
``sample_every_s``: Envoy's requests to the backends in flight, the router's requests in
flight, its resident memory and its CPU (share of one core since the last sample). The
ladder stops at the first level that does not hold. The run is stored as
``concurrency.json``; the markdown and the plot are rendered from it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import structlog

from extproc.bench import probes, report
from extproc.stack.epp_gateway import EppGateway
from extproc.stack.gateways import EPP_CLUSTER, MESSAGE_TIMEOUT, POOL_CLUSTER, Gateway
from extproc.stack.local import LocalStack, StackSpec, envoy_binary, envoy_counters
from extproc.stack.processes import ManagedProcess

log = structlog.get_logger("bench")

# What Envoy counts when a breaker trips, a message times out or ext_proc fails open.
FAILURE_COUNTERS: dict[str, tuple[str, ...]] = {
    "cluster.vllm.": (
        "upstream_rq_pending_overflow",
        "upstream_cx_overflow",
        "upstream_rq_retry_overflow",
    ),
    "cluster.prefix_router.": (
        "upstream_rq_pending_overflow",
        "upstream_cx_overflow",
        "upstream_rq_active_overflow",
    ),
    "http.ingress.ext_proc.": ("failure_mode_allowed", "message_timeouts", "streams_failed"),
}
# The same, for an Envoy configured as an Inference Extension gateway (``gateways.py``).
GATEWAY_FAILURE_COUNTERS: dict[str, tuple[str, ...]] = {
    f"cluster.{POOL_CLUSTER}.": FAILURE_COUNTERS["cluster.vllm."],
    f"cluster.{EPP_CLUSTER}.": FAILURE_COUNTERS["cluster.prefix_router."],
    "http.inference_gateway.ext_proc.": FAILURE_COUNTERS["http.ingress.ext_proc."],
}


@dataclass(frozen=True)
class ConcurrencyOptions:
    levels: tuple[int, ...] = (1000, 2000, 3000, 4000, 5000, 6000)
    stream_s: float = 20.0
    # Seconds between the tokens of a reply: stream_s / itl_s tokens each.
    itl_s: float = 0.5
    ramp_s: float = 5.0
    sample_every_s: float = 1.0
    backends: int = 3
    # None: the router behind the generated bootstrap. A gateway name: ``prefix-router
    # epp`` behind an Envoy configured as that gateway configures it (FULL_DUPLEX_STREAMED,
    # every response chunk passing through the picker), on a pool of four endpoints.
    gateway: Gateway | None = None
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = "prefix-router bench concurrency"

    @property
    def report_name(self) -> str:
        return "concurrency" if self.gateway is None else f"concurrency-epp-{self.gateway}"

    @property
    def tokens(self) -> int:
        return max(1, round(self.stream_s / self.itl_s))


def failure_counts(
    admin_url: str, counters: dict[str, tuple[str, ...]] = FAILURE_COUNTERS
) -> dict[str, float]:
    counts = {}
    for prefix, names in counters.items():
        seen = envoy_counters(admin_url, prefix)
        for name in names:
            counts[f"{prefix}{name}"] = seen.get(name, 0.0)
    return counts


class Stack(Protocol):
    """What a level drives and samples: a LocalStack, or an EppGateway."""

    router: ManagedProcess | None

    @property
    def url(self) -> str: ...

    @property
    def admin_url(self) -> str: ...

    @property
    def router_metrics_url(self) -> str: ...

    def router_metric(self, name: str) -> float | None: ...


def decisions(stack: Stack) -> float:
    return probes.total(probes.scrape(stack.router_metrics_url), "prefix_router_decisions_total")


class _Sampler:
    def __init__(self, stack: Stack, backend_prefix: str) -> None:
        assert stack.router is not None and stack.router.popen is not None
        self.stack = stack
        self.pid = stack.router.popen.pid
        self.started = time.monotonic()
        self._cpu = probes.cpu_seconds(self.pid)
        self._at = self.started
        self._backend_prefix = backend_prefix

    def sample(self, client_in_flight: int) -> dict[str, float]:
        now = time.monotonic()
        cpu = probes.cpu_seconds(self.pid)
        share = (cpu - self._cpu) / max(1e-6, now - self._at)
        self._cpu, self._at = cpu, now
        router = probes.scrape(self.stack.router_metrics_url)
        return {
            "t": round(now - self.started, 2),
            "client_in_flight": client_in_flight,
            "backend_requests": envoy_counters(self.stack.admin_url, self._backend_prefix).get(
                "upstream_rq_active", 0.0
            ),
            "router_in_flight": probes.total(router, "prefix_router_in_flight_requests"),
            "router_cpu": round(share, 3),
            "router_rss": probes.rss_bytes(self.pid),
        }


async def _drive(stack: Stack, level: int, options: ConcurrencyOptions) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=options.stream_s * 3 + options.ramp_s + 60)
    backend_prefix = "cluster.vllm." if options.gateway is None else f"cluster.{POOL_CLUSTER}."
    sampler = _Sampler(stack, backend_prefix)
    samples: list[dict[str, float]] = []
    in_flight = peak = 0
    url = f"{stack.url}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(n: int) -> tuple[int, int]:
            nonlocal in_flight, peak
            await asyncio.sleep(options.ramp_s * n / level)
            body = {
                "model": "sim-model",
                "max_tokens": options.tokens,
                "stream": True,
                "messages": [{"role": "user", "content": f"document {n % 64} " * 60}],
            }
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                async with session.post(url, json=body) as response:
                    events = 0
                    async for line in response.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            events += 1
                    return response.status, events
            except (aiohttp.ClientError, TimeoutError):
                return 0, 0
            finally:
                in_flight -= 1

        tasks = [asyncio.create_task(one(n)) for n in range(level)]
        deadline = time.monotonic() + options.ramp_s + options.stream_s * 3 + 60
        while not all(t.done() for t in tasks) and time.monotonic() < deadline:
            samples.append(await asyncio.to_thread(sampler.sample, in_flight))
            await asyncio.sleep(options.sample_every_s)
        outcomes = await asyncio.gather(*tasks)
    # Every stream ended: the router's count returns to 0 (bounded wait).
    for _ in range(40):
        last = await asyncio.to_thread(sampler.sample, 0)
        samples.append(last)
        if last["router_in_flight"] == 0:
            break
        await asyncio.sleep(0.25)
    statuses: dict[str, int] = {}
    for status, _ in outcomes:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "completed": sum(1 for s, events in outcomes if s == 200 and events >= options.tokens),
        "statuses": statuses,
        "peak_client_in_flight": peak,
        "samples": samples,
    }


def _stack(options: ConcurrencyOptions) -> contextlib.AbstractContextManager[Stack]:
    sim_args = ("--ttft-ms", "0", "--itl-ms", f"{options.itl_s * 1000:g}")
    if options.gateway is not None:
        return EppGateway(
            options.gateway, sim_args=sim_args, conformance_hooks=False, upstream_host_header=False
        )
    spec = StackSpec.ephemeral(options.backends, sim_args=sim_args, upstream_host_header=False)
    return LocalStack(spec)


def measure_level(level: int, options: ConcurrencyOptions) -> dict[str, Any]:
    counters = FAILURE_COUNTERS if options.gateway is None else GATEWAY_FAILURE_COUNTERS
    with _stack(options) as stack:
        before = decisions(stack)
        started = time.monotonic()
        result = asyncio.run(_drive(stack, level, options))
        result["seconds"] = round(time.monotonic() - started, 2)
        result["decided"] = decisions(stack) - before
        result["failures"] = failure_counts(stack.admin_url, counters)
        result["open_streams_end"] = stack.router_metric("prefix_router_open_streams")
    result["level"] = level
    result["held"] = holds(result)
    log.info("concurrency.level", level=level, held=result["held"], completed=result["completed"])
    return result


def holds(result: dict[str, Any]) -> bool:
    last = result["samples"][-1] if result["samples"] else {"router_in_flight": -1}
    return (
        result["completed"] == result["level"]
        and result["decided"] == result["level"]
        and all(value == 0 for value in result["failures"].values())
        and last["router_in_flight"] == 0
        and result["open_streams_end"] == 0
    )


def run(options: ConcurrencyOptions) -> dict[str, Any]:
    levels: list[dict[str, Any]] = []
    for level in options.levels:
        levels.append(measure_level(level, options))
        if not levels[-1]["held"]:
            break  # the next level would fail too, only slower
    data = {
        "kind": "concurrency",
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "machine": report.machine_description(),
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "levels": levels,
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, options.report_name, data)
    return data


def highest_held(data: dict[str, Any]) -> int | None:
    held = [level["level"] for level in data["levels"] if level["held"]]
    return max(held) if held else None


def _peak(level: dict[str, Any], name: str) -> float:
    return max((s[name] for s in level["samples"]), default=0.0)


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    rows = []
    for level in data["levels"]:
        failed_counters = {k: v for k, v in level["failures"].items() if v}
        rows.append(
            [
                level["level"],
                level["completed"],
                ", ".join(
                    f"{'none' if code == '0' else code}: {count}"
                    for code, count in sorted(level["statuses"].items())
                ),
                f"{level['decided']:.0f}",
                f"{level['peak_client_in_flight']}",
                f"{_peak(level, 'backend_requests'):.0f}",
                ", ".join(f"`{k}` {v:.0f}" for k, v in failed_counters.items()) or "all 0",
                f"{level['samples'][-1]['router_in_flight']:.0f}" if level["samples"] else "",
                f"{_peak(level, 'router_cpu'):.0%}",
                f"{_peak(level, 'router_rss') / 2**20:.0f}",
                "**yes**" if level["held"] else "no",
            ]
        )
    table = report.markdown_table(
        ["requests", "completed", "answers (status: requests)", "decided by the router",
         "peak in flight (client)",
         "peak in flight (Envoy to backends)", "breaker, timeout and fail-open counters",
         "router in flight at the end", "router peak CPU (one core)", "router peak RSS (MiB)",
         "held"],
        rows,
    )  # fmt: skip
    best = highest_held(data)
    verdict = (
        f"The highest level that held on this machine: **{best:,}** requests in flight at once."
        if best is not None
        else "No level held on this machine."
    )
    if data["levels"] and not data["levels"][-1]["held"]:
        verdict += (
            f" The ladder stopped at {data['levels'][-1]['level']:,}, the first that did not."
        )
    gateway = options.get("gateway")
    counted = FAILURE_COUNTERS if gateway is None else GATEWAY_FAILURE_COUNTERS
    counters = ", ".join(f"`{p}{n}`" for p, names in counted.items() for n in names)
    if gateway is None:
        title = "Concurrency: thousands of streaming requests in flight at once"
        plot = "concurrency.png"
        through = (
            "one Envoy and one router at its defaults (the generated bootstrap, "
            f"buffered-partial bodies), to {options['backends']} simulated vLLM instances"
        )
    else:
        title = f"Concurrency through an endpoint picker, Envoy configured as {gateway}"
        plot = f"concurrency-epp-{gateway}.png"
        through = (
            f"one Envoy configured as {gateway} configures it for an InferencePool "
            f"({MESSAGE_TIMEOUT[gateway].removesuffix('s')} s message timeout, "
            "FULL_DUPLEX_STREAMED bodies both ways, so every chunk of every reply passes "
            "through the picker) and one "
            "`prefix-router epp` at its defaults, to a pool of 4 simulated vLLM endpoints"
        )
    answers = "Answers: the HTTP status each client got (none: a connection error)."
    if gateway is not None:
        answers += (
            " A 429 is the picker shedding: its event loop ran later than `shed_lag_s`, "
            "and it answered at once, as the endpoint-picker protocol asks, instead of "
            "letting Envoy's message timeout fail the request open unpicked."
        )
    return f"""# {title}

Each level of the ladder sends that many streaming chat completions through {through},
whose replies stream
{options["stream_s"]:g} s ({round(options["stream_s"] / options["itl_s"])} tokens, one every
{options["itl_s"]:g} s). The requests start evenly over {options["ramp_s"]:g} s, so all of
them are in flight together for most of a reply; each level runs on a fresh stack. A
level holds when every request gets its whole reply, the router decides every one (its
decisions counter rises by exactly the level: none was placed by Envoy's fallback), the
counters {counters} all stay 0, and the router's requests in flight and open ext_proc
streams are back to 0 at the end. CPU is the router process's share of one core between
samples ({options["sample_every_s"]:g} s), RSS its resident memory; both are the peaks
over the level. {answers}

{table}

{verdict}

![in flight, CPU and memory over time]({plot})

## Reproduce

```
{options["command"]}
```

- Machine: {data["machine"]}
- Envoy: {data["envoy"]}
"""


def render_plots(data: dict[str, Any], out_dir: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (flight, cpu) = plt.subplots(1, 2, figsize=(12, 4))
    for level in data["levels"]:
        times = [s["t"] for s in level["samples"]]
        flight.plot(
            times, [s["backend_requests"] for s in level["samples"]], label=f"{level['level']}"
        )
        cpu.plot(times, [s["router_cpu"] for s in level["samples"]], label=f"{level['level']}")
    flight.set_title("requests in flight (Envoy to backends)")
    cpu.set_title("router CPU (share of one core)")
    for axis in (flight, cpu):
        axis.set_xlabel("time (s)")
        axis.set_ylim(bottom=0)
        axis.legend(title="level", fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)
