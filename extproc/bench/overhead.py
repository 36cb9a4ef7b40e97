"""Routing overhead: the same requests straight to a backend, through plain Envoy, and
through Envoy with the router in each body mode, side by side in one run.

The backends are simulators that answer at once (one output token), so the differences
between paths are the proxy's and the router's cost. Paths run interleaved, round after
round, and the report quotes the median of the rounds, because this machine is noisy.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import report, wrk
from extproc.picker.keys import READ_HEADERS
from extproc.stack.local import (
    LocalStack,
    StackSpec,
    envoy_binary,
    envoy_counters,
    start_router,
)
from extproc.stack.processes import ManagedProcess, free_port_run, free_ports, wait_until

log = structlog.get_logger("bench")

# envoy+router: BUFFERED_PARTIAL, two round trips; envoy+router streamed: the body sent
# without waiting, one answer carrying the decision, and the stream ends there;
# envoy+router 2 workers: BUFFERED_PARTIAL to `router --workers 2`, two endpoints;
# envoy+router asyncio: BUFFERED_PARTIAL to a router with event_loop: asyncio; envoy+router
# unix: to a router on a Unix socket; envoy+router fewer headers: Envoy forwards only the
# headers the router reads (forward_rules).
ROUTER_PATHS = (
    "envoy+router",
    "envoy+router streamed",
    "envoy+router 2 workers",
    "envoy+router asyncio",
    "envoy+router unix",
    "envoy+router fewer headers",
)
# A grpc.aio ext_proc server that answers every message with "go on" and decides nothing
# (extproc/bench/noop_processor.py): the floor under any Python processor.
FLOOR_PATH = "envoy+noop ext_proc"
# The same service as a static native binary (Go, grpc-go; ../shared/tools/native-noop/,
# given with --native-noop): the floor under any processor, whatever its language.
NATIVE_FLOOR_PATH = "envoy+native noop ext_proc"
PATHS = ("direct", "envoy", NATIVE_FLOOR_PATH, FLOOR_PATH, *ROUTER_PATHS)
# The router's cost against the floors (issue 27), measured in one run: p50 added at c=1
# at most the Python noop's + this, and at most this many times the native noop's; at
# c=16, at least this share of the native noop's throughput.
TARGET_OVER_PYTHON_FLOOR_MS = 0.1
TARGET_OVER_NATIVE_FLOOR = 1.8
TARGET_NATIVE_THROUGHPUT = 0.75
# Envoy's ext_proc counters read after the run, per path: the streams the processor served,
# and those that failed or timed out (each failed open and was placed by Envoy alone).
EXT_PROC_STATS = ("streams_started", "streams_failed", "message_timeouts", "failure_mode_allowed")
# One change each from `envoy+router`, measured against it in the same run.
LEVERS = {
    "envoy+router asyncio": "event_loop: asyncio's own loop instead of uvloop",
    "envoy+router unix": "the ext_proc link over a Unix socket instead of TCP loopback",
    "envoy+router fewer headers": "forward_rules: Envoy forwards only the "
    f"{len(READ_HEADERS)} headers the router reads, not every request header",
}
# A lever pays when it adds this much less at p50 at c=1, or gives this much more
# throughput at the highest concurrency, and is no worse than this on the other.
LEVER_P50_GAIN_MS = 0.1
LEVER_THROUGHPUT_GAIN = 1.05
LEVER_TOLERANCE = 0.03


@dataclass(frozen=True)
class OverheadOptions:
    duration_s: float = 10.0
    rounds: int = 3
    concurrencies: tuple[int, ...] = (1, 16)
    body_bytes: int = 8192
    distinct_prompts: int = 16
    out_dir: Path = Path("docs/benchmarks")
    # The native noop processor's binary; None: that path is not run.
    native_noop: Path | None = None


# What the OpenAI Python SDK sends with each request (besides Host and Content-Length), so
# the headers Envoy forwards to the router are as many as in production.
SDK_HEADERS = {
    "Accept": "application/json",
    "Accept-Encoding": "gzip, deflate",
    "Authorization": "Bearer sk-proj-" + "x" * 156,
    "Content-Type": "application/json",
    "User-Agent": "OpenAI/Python 1.54.4",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Async": "false",
    "X-Stainless-Lang": "python",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Package-Version": "1.54.4",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.11.7",
}


def chat_bodies(count: int, size: int) -> list[bytes]:
    """``count`` chat bodies of exactly ``size`` bytes with different prompts."""
    bodies = []
    for n in range(count):
        head = (
            '{"model":"sim-model","max_tokens":1,'
            f'"messages":[{{"role":"user","content":"prompt {n} '
        )
        tail = '"}]}'
        filler = "lorem ipsum " * (size // 12 + 1)
        bodies.append((head + filler[: size - len(head) - len(tail)] + tail).encode())
    return bodies


def measure(options: OverheadOptions) -> Measured:
    results: dict[tuple[str, int], list[wrk.WrkResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        work = Path(tmp)
        spec = StackSpec.ephemeral(
            3, sim_args=("--ttft-ms", "0", "--itl-ms", "0"), upstream_host_header=False
        )
        # Whatever fails, a start or the run, every process started is stopped, the last
        # started first, and then the stack.
        with LocalStack(spec) as stack, contextlib.ExitStack() as started:
            urls, admins, floors = _start_paths(stack, work, started, options.native_noop)
            for path, floor in floors.items():
                wait_until(functools.partial(_ext_proc_host_healthy, admins[path]), 30, path, floor)
            paths = tuple(p for p in PATHS if p in urls)
            script = wrk.post_script(
                work / "post.lua",
                "/v1/chat/completions",
                chat_bodies(options.distinct_prompts, options.body_bytes),
                SDK_HEADERS,
            )
            for round_number in range(options.rounds):
                # Rotate the order each round so no path always runs first.
                turn = round_number % len(paths)
                order = paths[turn:] + paths[:turn]
                for connections in options.concurrencies:
                    for path in order:
                        result = wrk.run(urls[path], script, connections, options.duration_s)
                        log.info(
                            "bench.sample",
                            path=path,
                            c=connections,
                            round=round_number,
                            p50_ms=result.p50_ms,
                            p99_ms=result.p99_ms,
                            rps=result.requests_per_s,
                        )
                        results.setdefault((path, connections), []).append(result)
            stats = {
                path: _only(envoy_counters(admin, EXT_PROC_PREFIX), EXT_PROC_STATS)
                for path, admin in admins.items()
            }
    return Measured(results, stats)


def _start_paths(
    stack: LocalStack, work: Path, started: contextlib.ExitStack, native_noop: Path | None = None
) -> tuple[dict[str, str], dict[str, str], dict[str, ManagedProcess]]:
    """Start every path's processes beside ``stack``, each stopped when ``started`` closes;
    return each path's URL, each ext_proc path's Envoy admin URL, and the noop processor."""

    def held(process: ManagedProcess) -> ManagedProcess:
        started.callback(process.stop)
        return process

    def beside(name: str, **changes: Any) -> tuple[str, str]:
        """Another Envoy like the stack's, with ``changes``: its URL and admin URL."""
        envoy, url, admin = stack.start_envoy_beside(name, work, **changes)
        held(envoy)
        return url, admin

    control_plane = stack.spec.control_plane
    assert control_plane is not None
    baseline_url, _ = beside("envoy-baseline", ext_proc=False)
    # The same router behind a second Envoy that streams the body: the router reads the
    # mode from each stream's first message.
    streamed_url, streamed_admin = beside("envoy-streamed", body_mode="streamed")
    # A router of two workers, fed by the same control plane, behind a third Envoy.
    workers_grpc = free_port_run(4)
    held(
        start_router(
            "router-2-workers",
            work,
            ("127.0.0.1", workers_grpc),
            ("127.0.0.1", workers_grpc + 2),
            control_plane,
            workers=2,
        )
    )
    workers_url, workers_admin = beside(
        "envoy-2-workers",
        routers=(("127.0.0.1", workers_grpc), ("127.0.0.1", workers_grpc + 1)),
    )
    # The one-process router on asyncio's loop, behind a fourth Envoy.
    asyncio_grpc, asyncio_metrics = free_ports(2)
    held(
        start_router(
            "router-asyncio",
            work,
            ("127.0.0.1", asyncio_grpc),
            ("127.0.0.1", asyncio_metrics),
            control_plane,
            settings={"event_loop": "asyncio"},
        )
    )
    asyncio_url, asyncio_admin = beside("envoy-asyncio", routers=(("127.0.0.1", asyncio_grpc),))
    # The one-process router on a Unix socket, behind a fifth Envoy.
    socket_path = str(work / "router.sock")
    (unix_metrics,) = free_ports(1)
    held(start_router("router-unix", work, socket_path, ("127.0.0.1", unix_metrics), control_plane))
    unix_url, unix_admin = beside("envoy-unix", routers=(socket_path,))
    # The stack's router again, behind a sixth Envoy that forwards fewer headers.
    headers_url, headers_admin = beside("envoy-fewer-headers", forward_headers=READ_HEADERS)
    # The floor: the noop processor behind a seventh Envoy.
    (noop_grpc,) = free_ports(1)
    noop = held(
        ManagedProcess(
            "noop-processor",
            [sys.executable, "-m", "extproc.bench.noop_processor",
             "--listen", f"127.0.0.1:{noop_grpc}"],
            work / "noop-processor.log",
        ).start()
    )  # fmt: skip
    noop_url, noop_admin = beside("envoy-noop", routers=(("127.0.0.1", noop_grpc),))
    host, port = stack.spec.backends[0]
    urls = {
        "direct": f"http://{host}:{port}",
        "envoy": baseline_url,
        "envoy+router": stack.url,
        "envoy+router streamed": streamed_url,
        "envoy+router 2 workers": workers_url,
        "envoy+router asyncio": asyncio_url,
        "envoy+router unix": unix_url,
        "envoy+router fewer headers": headers_url,
        FLOOR_PATH: noop_url,
    }
    admins = {
        FLOOR_PATH: noop_admin,
        "envoy+router": stack.admin_url,
        "envoy+router streamed": streamed_admin,
        "envoy+router 2 workers": workers_admin,
        "envoy+router asyncio": asyncio_admin,
        "envoy+router unix": unix_admin,
        "envoy+router fewer headers": headers_admin,
    }
    floors = {FLOOR_PATH: noop}
    if native_noop is not None:
        # The native floor behind an eighth Envoy.
        (native_grpc,) = free_ports(1)
        floors[NATIVE_FLOOR_PATH] = held(
            ManagedProcess(
                "native-noop",
                [str(native_noop), "--listen", f"127.0.0.1:{native_grpc}"],
                work / "native-noop.log",
            ).start()
        )
        urls[NATIVE_FLOOR_PATH], admins[NATIVE_FLOOR_PATH] = beside(
            "envoy-native-noop", routers=(("127.0.0.1", native_grpc),)
        )
    return urls, admins, floors


EXT_PROC_PREFIX = "http.ingress.ext_proc."


def _only(values: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    return {name: values.get(name, 0.0) for name in names}


def _ext_proc_host_healthy(admin_url: str) -> bool:
    healthy = envoy_counters(admin_url, "cluster.prefix_router.").get("membership_healthy", 0)
    return healthy >= 1


@dataclass(frozen=True)
class Measured:
    # wrk's samples by (path, connections), one per round.
    results: dict[tuple[str, int], list[wrk.WrkResult]]
    # Envoy's ext_proc counters after the run, per ext_proc path (see EXT_PROC_STATS).
    ext_proc: dict[str, dict[str, float]]


def document(options: OverheadOptions, measured: Measured) -> dict[str, Any]:
    """The stored run: every wrk sample, the options and the machine, all the report needs."""
    return {
        "kind": "overhead",
        "format": 1,
        "command": "prefix-router bench overhead "
        + shlex.join(
            [
                "--duration",
                f"{options.duration_s:g}",
                "--rounds",
                str(options.rounds),
                *(["--native-noop", str(options.native_noop)] if options.native_noop else []),
                "--out",
                str(options.out_dir),
            ]
        ),
        "options": {
            "duration_s": options.duration_s,
            "rounds": options.rounds,
            "concurrencies": list(options.concurrencies),
            "body_bytes": options.body_bytes,
            "distinct_prompts": options.distinct_prompts,
            # Names only: the values are the SDK's, the API key a dummy.
            "request_headers": list(SDK_HEADERS),
        },
        "samples": [
            {"path": path, "connections": connections, **asdict(sample)}
            for (path, connections), samples in measured.results.items()
            for sample in samples
        ],
        "ext_proc": measured.ext_proc,
        "machine": report.machine_description(),
        # Taken after the run: a load well above the client's one core means other work
        # shared the machine, and the latencies say so.
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "wrk": report.tool_version(["wrk", "-v"]),
    }


def summarise(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, float]]:
    """The median over rounds of each path at each concurrency."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for sample in data["samples"]:
        grouped.setdefault((sample["path"], sample["connections"]), []).append(sample)
    return {
        key: {
            "p50": report.median(s["p50_ms"] for s in samples),
            "p90": report.median(s["p90_ms"] for s in samples),
            "p99": report.median(s["p99_ms"] for s in samples),
            "rps": report.median(s["requests_per_s"] for s in samples),
            "errors": sum(s["errors"] for s in samples),
        }
        for key, samples in grouped.items()
    }


# SageMaker's published routing overhead, and ours to meet: added at c=1 (p50, p99), and
# the share of plain Envoy's throughput kept at c=16.
SAGEMAKER_OVERHEAD_MS = (1.3, 1.9)
TARGET_P50_MS = 0.6
TARGET_P99_MS = 1.5
TARGET_THROUGHPUT_RATIO = 0.6


def router_paths(summary: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    """The router paths a run measured (older runs lack the later ones)."""
    return [p for p in ROUTER_PATHS if any(key[0] == p for key in summary)]


def measured_paths(summary: dict[tuple[str, int], dict[str, float]]) -> list[str]:
    return [p for p in PATHS if any(key[0] == p for key in summary)]


def best_router_path(summary: dict[tuple[str, int], dict[str, float]]) -> str:
    """The router path with the least p50 added at c=1 (the first one without c=1)."""
    paths = router_paths(summary)
    if ("envoy", 1) not in summary:
        return paths[0]
    return min(paths, key=lambda p: summary[(p, 1)]["p50"])


def rounds(data: dict[str, Any], path: str, connections: int) -> list[dict[str, Any]]:
    """The samples of ``path`` at ``connections``, one per round, in round order."""
    return [s for s in data["samples"] if s["path"] == path and s["connections"] == connections]


@dataclass(frozen=True)
class LeverEffect:
    # Per round (paired with envoy+router's sample of the same round): p50 saved at the
    # lowest concurrency (ms), and the throughput ratio at the highest.
    saved_ms: tuple[float, ...]
    throughput: tuple[float, ...]
    base_p50_ms: float

    @property
    def verdict(self) -> str:
        """``pays`` only where the median clears its threshold and every round agrees: on
        a shared 2-core machine one round's noise is as large as any lever here."""
        saved, ratio = report.median(self.saved_ms), report.median(self.throughput)
        not_slower = saved >= -LEVER_TOLERANCE * self.base_p50_ms
        faster = saved >= LEVER_P50_GAIN_MS and ratio >= 1 - LEVER_TOLERANCE
        more = ratio >= LEVER_THROUGHPUT_GAIN and not_slower
        if faster and all(g > 0 for g in self.saved_ms):
            return "pays"
        if more and all(r > 1 for r in self.throughput):
            return "pays"
        if faster or more:
            return "mixed across rounds"
        return "does not pay"


def lever_effect(data: dict[str, Any], lever: str, concurrencies: list[int]) -> LeverEffect:
    """A lever path against ``envoy+router`` in the same run, round by round."""
    low, high = min(concurrencies), max(concurrencies)
    base = "envoy+router"
    pairs_low = list(zip(rounds(data, base, low), rounds(data, lever, low), strict=True))
    pairs_high = list(zip(rounds(data, base, high), rounds(data, lever, high), strict=True))
    return LeverEffect(
        saved_ms=tuple(b["p50_ms"] - x["p50_ms"] for b, x in pairs_low),
        throughput=tuple(x["requests_per_s"] / b["requests_per_s"] for b, x in pairs_high),
        base_p50_ms=report.median(b["p50_ms"] for b, _ in pairs_low),
    )


def lever_section(data: dict[str, Any], concurrencies: list[int]) -> str:
    """Each lever measured in the run, against the same router without it."""
    summary = summarise(data)
    levers = [lever for lever in LEVERS if all((lever, c) in summary for c in concurrencies)]
    if not levers:
        return ""
    low, high = min(concurrencies), max(concurrencies)
    rows = []
    for lever in levers:
        effect = lever_effect(data, lever, concurrencies)
        added = [f"{-g:+.2f}" for g in effect.saved_ms]
        ratios = [f"{r:.2f}x" for r in effect.throughput]
        rows.append(
            [f"`{lever}`", LEVERS[lever], f"{-report.median(effect.saved_ms):+.2f}",
             ", ".join(added), f"{report.median(effect.throughput):.2f}x", ", ".join(ratios),
             effect.verdict]
        )  # fmt: skip
    table = report.markdown_table(
        ["path", "lever", f"p50 at c={low} vs envoy+router (ms)", "each round",
         f"throughput at c={high} vs envoy+router", "each round", "verdict"],
        rows,
    )  # fmt: skip
    return f"""
## Levers

Each lever path is `envoy+router` with one change, compared round by round with
`envoy+router` in the same run (the paths of a round run back to back). A lever pays when
the median takes at least {LEVER_P50_GAIN_MS} ms off the p50 at c={low}, or gives at least
{LEVER_THROUGHPUT_GAIN:.2f}x the throughput at c={high}, without being worse by more than
{LEVER_TOLERANCE:.0%} on the other, and every round agrees; where the median clears the bar
but a round does not, the verdict is "mixed across rounds".

{table}
"""


def floor_sentence(
    summary: dict[tuple[str, int], dict[str, float]], concurrencies: list[int]
) -> str:
    """The noop processor against plain Envoy and against the router, where measured."""
    if not all((FLOOR_PATH, c) in summary for c in concurrencies):
        return ""
    low, high = min(concurrencies), max(concurrencies)
    envoy, noop, routed = (summary[(p, low)] for p in ("envoy", FLOOR_PATH, "envoy+router"))
    floor_p50, router_p50 = noop["p50"] - envoy["p50"], routed["p50"] - envoy["p50"]
    floor_p99 = noop["p99"] - envoy["p99"]
    throughput = summary[(FLOOR_PATH, high)]["rps"] / summary[("envoy", high)]["rps"]
    routed_throughput = summary[("envoy+router", high)]["rps"] / summary[("envoy", high)]["rps"]
    share = floor_p50 / router_p50 if router_p50 > 0 else float("nan")
    return (
        f"\n\n**The floor.** `{FLOOR_PATH}`, a grpc.aio ext_proc server that answers every "
        f"message at once and decides nothing, in the same mode and behind the same Envoy "
        f"config, adds {floor_p50:+.2f} ms at p50 and {floor_p99:+.2f} ms at p99 at c={low}, "
        f"and keeps {throughput:.2f} of plain Envoy's throughput at c={high}. The router adds "
        f"{router_p50:+.2f} ms at p50 and keeps {routed_throughput:.2f}: {share:.0%} of what "
        f"it adds at c={low} is there before any routing code runs."
    )


@dataclass(frozen=True)
class FloorRatios:
    """The router (``envoy+router``) against both floors, in one run: what each adds to
    plain Envoy at p50 at the lowest concurrency (ms), and each one's throughput at the
    highest."""

    low: int
    high: int
    envoy_rps: float
    added_p50: dict[str, float]
    added_p99: dict[str, float]
    rps: dict[str, float]

    @property
    def over_python_ms(self) -> float:
        return self.added_p50["envoy+router"] - self.added_p50[FLOOR_PATH]

    @property
    def over_native(self) -> float:
        native = self.added_p50[NATIVE_FLOOR_PATH]
        return self.added_p50["envoy+router"] / native if native > 0 else float("nan")

    @property
    def native_throughput(self) -> float:
        return self.rps["envoy+router"] / self.rps[NATIVE_FLOOR_PATH]

    def targets(self) -> list[tuple[str, str, str, bool]]:
        """(measure, target, ours, met) for each of the ratio targets."""
        return [
            (
                f"p50 added at c={self.low}, over the Python noop's",
                f"≤ +{TARGET_OVER_PYTHON_FLOOR_MS:g} ms",
                f"{self.over_python_ms:+.2f} ms",
                self.over_python_ms <= TARGET_OVER_PYTHON_FLOOR_MS,
            ),
            (
                f"p50 added at c={self.low}, against the native noop's",
                f"≤ {TARGET_OVER_NATIVE_FLOOR:g} times",
                f"{self.over_native:.2f} times",
                self.over_native <= TARGET_OVER_NATIVE_FLOOR,
            ),
            (
                f"throughput at c={self.high}, against the native noop's",
                f"≥ {TARGET_NATIVE_THROUGHPUT:g} times",
                f"{self.native_throughput:.2f} times",
                self.native_throughput >= TARGET_NATIVE_THROUGHPUT,
            ),
        ]


def floor_ratios(
    summary: dict[tuple[str, int], dict[str, float]], concurrencies: list[int]
) -> FloorRatios | None:
    """The router against both floors; None unless the run measured both at every load."""
    low, high = min(concurrencies), max(concurrencies)
    paths = (NATIVE_FLOOR_PATH, FLOOR_PATH, "envoy+router")
    if not all((p, c) in summary for p in (*paths, "envoy") for c in (low, high)):
        return None
    envoy_low = summary[("envoy", low)]
    return FloorRatios(
        low=low,
        high=high,
        envoy_rps=summary[("envoy", high)]["rps"],
        added_p50={p: summary[(p, low)]["p50"] - envoy_low["p50"] for p in paths},
        added_p99={p: summary[(p, low)]["p99"] - envoy_low["p99"] for p in paths},
        rps={p: summary[(p, high)]["rps"] for p in paths},
    )


def floors_section(
    summary: dict[tuple[str, int], dict[str, float]], concurrencies: list[int]
) -> str:
    ratios = floor_ratios(summary, concurrencies)
    if ratios is None:
        return ""
    rows = [["Envoy alone", "", "", f"{ratios.envoy_rps:,.0f}"]] + [
        [
            f"`{path}`",
            f"{ratios.added_p50[path]:+.2f}",
            f"{ratios.added_p99[path]:+.2f}",
            f"{ratios.rps[path]:,.0f} ({ratios.rps[path] / ratios.envoy_rps:.2f})",
        ]
        for path in (NATIVE_FLOOR_PATH, FLOOR_PATH, "envoy+router")
    ]
    table = report.markdown_table(
        ["path", f"p50 added at c={ratios.low} (ms)", f"p99 added at c={ratios.low} (ms)",
         f"req/s at c={ratios.high} (of Envoy alone's)"],
        rows,
    )  # fmt: skip
    targets = report.markdown_table(
        ["the router's cost", "target", "measured", "met"],
        [[m, t, o, "yes" if met else "**no**"] for m, t, o, met in ratios.targets()],
    )
    return f"""
## Against the floors

Two processors that decide nothing, behind the same Envoy config: `{NATIVE_FLOOR_PATH}`, a
static native binary (Go, grpc-go), and `{FLOOR_PATH}`, the same service on grpc.aio:
what an ext_proc processor costs here before any code of its own runs, natively and on
grpc.aio. The router's path is `envoy+router`, at its defaults.

{table}

{targets}
"""


def ext_proc_section(data: dict[str, Any]) -> str:
    """Envoy's own count of each ext_proc path's streams, and of those that failed open."""
    stats = data.get("ext_proc")
    if not stats:
        return ""
    rows = []
    failed_open = 0.0
    for path, counts in stats.items():
        failed = counts["streams_failed"] + counts["message_timeouts"]
        failed_open += counts["failure_mode_allowed"]
        rows.append(
            [f"`{path}`", f"{counts['streams_started']:.0f}", f"{failed:.0f}",
             f"{counts['failure_mode_allowed']:.0f}"]
        )  # fmt: skip
    table = report.markdown_table(
        ["path", "ext_proc streams", "failed or timed out", "failed open"], rows
    )
    verdict = (
        "No stream failed open: every request of every ext_proc path was answered by its processor."
        if failed_open == 0
        else f"{failed_open:.0f} streams failed open: Envoy placed those requests alone, "
        "and the latencies of their paths understate the processor's cost."
    )
    return f"""
## What Envoy counted

Envoy's ext_proc counters on each path's Envoy after the run (`{EXT_PROC_PREFIX}*`). {verdict}

{table}
"""


def render(data: dict[str, Any]) -> str:
    """The report, from the stored run alone."""
    options = data["options"]
    summary = summarise(data)
    concurrencies = options["concurrencies"]
    rows = []
    for connections in concurrencies:
        for path in measured_paths(summary):
            med = summary[(path, connections)]
            rows.append(
                [f"c={connections}", path, f"{med['p50']:.2f}", f"{med['p90']:.2f}",
                 f"{med['p99']:.2f}", f"{med['rps']:.0f}", int(med["errors"])]
            )  # fmt: skip
    added_rows = []
    for path in router_paths(summary):
        for connections in concurrencies:
            envoy, routed = summary[("envoy", connections)], summary[(path, connections)]
            added_rows.append(
                [path, f"c={connections}", f"{routed['p50'] - envoy['p50']:+.2f}",
                 f"{routed['p99'] - envoy['p99']:+.2f}", f"{routed['rps'] / envoy['rps']:.2f}"]
            )  # fmt: skip
    added_table = report.markdown_table(
        ["path", "load", "p50 added (ms)", "p99 added (ms)", "throughput ratio"], added_rows
    )
    paths_table = report.markdown_table(
        ["load", "path", "p50 (ms)", "p90 (ms)", "p99 (ms)", "req/s", "errors"], rows
    )
    verdict = ""
    if 1 in concurrencies:
        best = best_router_path(summary)
        added = summary[(best, 1)]["p50"] - summary[("envoy", 1)]["p50"]
        added_p99 = summary[(best, 1)]["p99"] - summary[("envoy", 1)]["p99"]
        met = "meets" if added <= TARGET_P50_MS else "misses"
        met_p99 = "meets" if added_p99 <= TARGET_P99_MS else "misses"
        verdict = (
            f" At c=1 the faster path, `{best}`, adds {added:+.2f} ms at p50: it {met} the "
            f"target; and {added_p99:+.2f} ms at p99: it {met_p99} the target."
        )
        high_load = max(concurrencies)
        if high_load > 1:
            fastest = max(router_paths(summary), key=lambda p: summary[(p, high_load)]["rps"])
            ratio = summary[(fastest, high_load)]["rps"] / summary[("envoy", high_load)]["rps"]
            met_rps = "meets" if ratio >= TARGET_THROUGHPUT_RATIO else "misses"
            verdict += (
                f" At c={high_load} the path with the most throughput, `{fastest}`, keeps "
                f"{ratio:.2f} of plain Envoy's: it {met_rps} the target."
            )
    verdict += floor_sentence(summary, concurrencies)
    floors = floors_section(summary, concurrencies)
    levers = lever_section(data, concurrencies)
    counted = ext_proc_section(data)
    sent = options.get("request_headers")
    headers = (
        f" Requests carry the {len(sent)} headers the OpenAI Python SDK sends "
        f"({', '.join(sent)}), besides Host and Content-Length."
        if sent
        else ""
    )
    low, high = SAGEMAKER_OVERHEAD_MS
    return f"""# Routing overhead

What the router adds to a request, measured as the same {options["body_bytes"]}-byte chat
requests ({options["distinct_prompts"]} distinct prompts in rotation) sent several ways in one
run: straight to a simulated backend (`direct`), through Envoy with no ext_proc (`envoy`),
through Envoy with a processor that decides nothing (`{FLOOR_PATH}` on grpc.aio, and
`{NATIVE_FLOOR_PATH}`, where measured),
and through Envoy with the router deciding every request (PREFIX_AWARE, override-host
mode): `envoy+router` sends the body BUFFERED_PARTIAL after the router has answered the
headers (two round trips per request), and `envoy+router streamed`, where measured, sends
it STREAMED without waiting, so the router's one answer carries the decision and the
stream ends there (one round trip); `envoy+router 2 workers`, where measured, is the
BUFFERED_PARTIAL path to `prefix-router router --workers 2` (two processes, two endpoints
of the ext_proc cluster); the levers, where measured, are the BUFFERED_PARTIAL path with
one change each (see below). The backends answer at once, so the differences are
the proxy's and the router's cost.{headers} Client ([wrk](https://github.com/wg/wrk), one thread),
Envoy, router and backends all share this machine's cores. Each cell is the median of
{options["rounds"]} rounds of {options["duration_s"]:g} s; the paths run interleaved, in a
rotating order.

## Added by the router (envoy+router minus envoy)

{added_table}

SageMaker publishes {low} to {high} ms of routing overhead; our targets are at most
{TARGET_P50_MS} ms added at p50 and {TARGET_P99_MS} ms at p99 at c=1, and at least
{TARGET_THROUGHPUT_RATIO} of plain Envoy's throughput at c=16.{verdict}
{floors}{levers}{counted}
## All paths

{paths_table}

![latency by path](overhead.png)

## Reproduce

```
{data["command"]}
```

- Machine: {data["machine"]}; load average after the run
  {", ".join(str(x) for x in data["load_average_after"])}
- Envoy: {data["envoy"]}
- wrk: {data["wrk"]}
"""


def render_plots(data: dict[str, Any], out_dir: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = data["options"]
    concurrencies = options["concurrencies"]
    summary = summarise(data)
    figure, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4))
    for axis, connections in zip(
        axes if len(concurrencies) > 1 else [axes], concurrencies, strict=True
    ):
        paths = measured_paths(summary)
        positions = range(len(paths))
        p50 = [summary[(p, connections)]["p50"] for p in paths]
        p99 = [summary[(p, connections)]["p99"] for p in paths]
        axis.bar([x - 0.2 for x in positions], p50, width=0.4, label="p50")
        axis.bar([x + 0.2 for x in positions], p99, width=0.4, label="p99")
        axis.set_xticks(list(positions), [p.replace(" ", "\n") for p in paths])
        axis.set_ylabel("latency (ms)")
        axis.set_title(f"concurrency {connections}")
        axis.legend()
    figure.suptitle(
        f"Routing overhead, {options['body_bytes']}-byte chat bodies (median of rounds)"
    )
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)


def write_report(options: OverheadOptions, measured: Measured) -> Path:
    """Store the run as JSON, then render the report and the plot from what was stored."""
    return report.write_rendered(options.out_dir, "overhead", document(options, measured))


def run(options: OverheadOptions) -> Path:
    path = write_report(options, measure(options))
    print(path.read_text().split("## All paths")[0], file=sys.stdout)
    return path
