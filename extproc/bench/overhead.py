"""Routing overhead: the same requests straight to a backend, through plain Envoy, and
through Envoy with the router in each body mode, side by side in one run.

The backends are simulators that answer at once (one output token), so the differences
between paths are the proxy's and the router's cost. Paths run interleaved, round after
round, and the report quotes the median of the rounds, because this machine is noisy.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import report, wrk
from extproc.stack.local import LocalStack, StackSpec, envoy_binary, start_router
from extproc.stack.processes import free_port_run, free_ports

log = structlog.get_logger("bench")

# envoy+router: BUFFERED_PARTIAL, two round trips; envoy+router streamed: the body sent
# without waiting, one answer carrying the decision, and the stream ends there;
# envoy+router 2 workers: BUFFERED_PARTIAL to `router --workers 2`, two endpoints;
# envoy+router uvloop: BUFFERED_PARTIAL to a router with event_loop: uvloop.
ROUTER_PATHS = (
    "envoy+router",
    "envoy+router streamed",
    "envoy+router 2 workers",
    "envoy+router uvloop",
)
PATHS = ("direct", "envoy", *ROUTER_PATHS)


@dataclass(frozen=True)
class OverheadOptions:
    duration_s: float = 10.0
    rounds: int = 3
    concurrencies: tuple[int, ...] = (1, 16)
    body_bytes: int = 8192
    distinct_prompts: int = 16
    out_dir: Path = Path("docs/benchmarks")


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


def measure(options: OverheadOptions) -> dict[tuple[str, int], list[wrk.WrkResult]]:
    results: dict[tuple[str, int], list[wrk.WrkResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        work = Path(tmp)
        spec = StackSpec.ephemeral(
            3, sim_args=("--ttft-ms", "0", "--itl-ms", "0"), upstream_host_header=False
        )
        with LocalStack(spec) as stack:
            baseline, baseline_url, _ = stack.start_envoy_beside(
                "envoy-baseline", work, ext_proc=False
            )
            # The same router behind a second Envoy that streams the body: the router
            # reads the mode from each stream's first message.
            streamed, streamed_url, _ = stack.start_envoy_beside(
                "envoy-streamed", work, body_mode="streamed"
            )
            # A router of two workers, fed by the same control plane, behind a third Envoy.
            assert spec.control_plane is not None
            workers_grpc = free_port_run(4)
            workers_router = start_router(
                "router-2-workers",
                work,
                ("127.0.0.1", workers_grpc),
                ("127.0.0.1", workers_grpc + 2),
                spec.control_plane,
                workers=2,
            )
            workers_envoy, workers_url, _ = stack.start_envoy_beside(
                "envoy-2-workers",
                work,
                routers=(("127.0.0.1", workers_grpc), ("127.0.0.1", workers_grpc + 1)),
            )
            # The one-process router on uvloop, behind a fourth Envoy.
            uvloop_grpc, uvloop_metrics = free_ports(2)
            uvloop_router = start_router(
                "router-uvloop",
                work,
                ("127.0.0.1", uvloop_grpc),
                ("127.0.0.1", uvloop_metrics),
                spec.control_plane,
                settings={"event_loop": "uvloop"},
            )
            uvloop_envoy, uvloop_url, _ = stack.start_envoy_beside(
                "envoy-uvloop", work, routers=(("127.0.0.1", uvloop_grpc),)
            )
            try:
                host, port = spec.backends[0]
                urls = {
                    "direct": f"http://{host}:{port}",
                    "envoy": baseline_url,
                    "envoy+router": stack.url,
                    "envoy+router streamed": streamed_url,
                    "envoy+router 2 workers": workers_url,
                    "envoy+router uvloop": uvloop_url,
                }
                script = wrk.post_script(
                    work / "post.lua",
                    "/v1/chat/completions",
                    chat_bodies(options.distinct_prompts, options.body_bytes),
                )
                for round_number in range(options.rounds):
                    # Rotate the order each round so no path always runs first.
                    turn = round_number % len(PATHS)
                    order = PATHS[turn:] + PATHS[:turn]
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
            finally:
                uvloop_envoy.stop()
                uvloop_router.stop()
                workers_envoy.stop()
                workers_router.stop()
                streamed.stop()
                baseline.stop()
    return results


def document(
    options: OverheadOptions, results: dict[tuple[str, int], list[wrk.WrkResult]]
) -> dict[str, Any]:
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
        },
        "samples": [
            {"path": path, "connections": connections, **asdict(sample)}
            for (path, connections), samples in results.items()
            for sample in samples
        ],
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


def uvloop_verdict(
    summary: dict[tuple[str, int], dict[str, float]], concurrencies: list[int]
) -> str:
    """uvloop against asyncio's loop, the same one-process BUFFERED_PARTIAL router."""
    if not all(("envoy+router uvloop", c) in summary for c in concurrencies):
        return ""
    parts = []
    for connections in concurrencies:
        envoy = summary[("envoy", connections)]
        plain = summary[("envoy+router", connections)]
        uv = summary[("envoy+router uvloop", connections)]
        parts.append(
            f"at c={connections} it adds {uv['p50'] - envoy['p50']:+.2f} ms at p50 against "
            f"{plain['p50'] - envoy['p50']:+.2f} ms, with {uv['rps'] / plain['rps']:.2f}x "
            "the throughput"
        )
    return " On uvloop instead of asyncio's loop, the one-process router: " + "; ".join(parts) + "."


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
    verdict += uvloop_verdict(summary, concurrencies)
    low, high = SAGEMAKER_OVERHEAD_MS
    return f"""# Routing overhead

What the router adds to a request, measured as the same {options["body_bytes"]}-byte chat
requests ({options["distinct_prompts"]} distinct prompts in rotation) sent three ways in one
run: straight to a simulated backend (`direct`), through Envoy with no ext_proc (`envoy`),
and through Envoy with the router deciding every request (PREFIX_AWARE, override-host
mode): `envoy+router` sends the body BUFFERED_PARTIAL after the router has answered the
headers (two round trips per request), and `envoy+router streamed`, where measured, sends
it STREAMED without waiting, so the router's one answer carries the decision and the
stream ends there (one round trip); `envoy+router 2 workers`, where measured, is the
BUFFERED_PARTIAL path to `prefix-router router --workers 2` (two processes, two endpoints
of the ext_proc cluster); `envoy+router uvloop`, where measured, is the BUFFERED_PARTIAL path
to one router process with `event_loop: uvloop`. The backends answer at once, so the differences are
the proxy's and the router's cost. Client ([wrk](https://github.com/wg/wrk), one thread),
Envoy, router and backends all share this machine's cores. Each cell is the median of
{options["rounds"]} rounds of {options["duration_s"]:g} s; the paths run interleaved, in a
rotating order.

## Added by the router (envoy+router minus envoy)

{added_table}

SageMaker publishes {low} to {high} ms of routing overhead; our targets are at most
{TARGET_P50_MS} ms added at p50 and {TARGET_P99_MS} ms at p99 at c=1, and at least
{TARGET_THROUGHPUT_RATIO} of plain Envoy's throughput at c=16.{verdict}

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


def write_report(
    options: OverheadOptions, results: dict[tuple[str, int], list[wrk.WrkResult]]
) -> Path:
    """Store the run as JSON, then render the report and the plot from what was stored."""
    return report.write_rendered(options.out_dir, "overhead", document(options, results))


def run(options: OverheadOptions) -> Path:
    results = measure(options)
    path = write_report(options, results)
    print(path.read_text().split("## All paths")[0], file=sys.stdout)
    return path
