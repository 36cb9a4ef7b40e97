"""Routing overhead: the same requests straight to a backend, through plain Envoy, and
through Envoy with the router, side by side in one run.

The backends are simulators that answer at once (one output token), so the differences
between paths are the proxy's and the router's cost. Paths run interleaved, round after
round, and the report quotes the median of the rounds, because this machine is noisy.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from extproc.bench import report, wrk
from extproc.stack.local import LocalStack, StackSpec, envoy_binary, start_envoy
from extproc.stack.processes import free_ports

log = structlog.get_logger("bench")

PATHS = ("direct", "envoy", "envoy+router")


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
            listen, admin = free_ports(2)
            baseline_params = replace(
                stack.bootstrap_params(),
                ext_proc=False,
                listen=("127.0.0.1", listen),
                admin=("127.0.0.1", admin),
            )
            baseline = start_envoy("envoy-baseline", baseline_params, work)
            try:
                host, port = spec.backends[0]
                urls = {
                    "direct": f"http://{host}:{port}",
                    "envoy": f"http://127.0.0.1:{listen}",
                    "envoy+router": stack.url,
                }
                script = wrk.post_script(
                    work / "post.lua",
                    "/v1/chat/completions",
                    chat_bodies(options.distinct_prompts, options.body_bytes),
                )
                for round_number in range(options.rounds):
                    # Rotate the order each round so no path always runs first.
                    order = PATHS[round_number % 3 :] + PATHS[: round_number % 3]
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
                baseline.stop()
    return results


def write_report(
    options: OverheadOptions, results: dict[tuple[str, int], list[wrk.WrkResult]]
) -> Path:
    options.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for connections in options.concurrencies:
        for path in PATHS:
            samples = results[(path, connections)]
            med = {
                "p50": report.median(s.p50_ms for s in samples),
                "p90": report.median(s.p90_ms for s in samples),
                "p99": report.median(s.p99_ms for s in samples),
                "rps": report.median(s.requests_per_s for s in samples),
                "errors": sum(s.errors for s in samples),
            }
            summary[(path, connections)] = med
            rows.append(
                [f"c={connections}", path, f"{med['p50']:.2f}", f"{med['p90']:.2f}",
                 f"{med['p99']:.2f}", f"{med['rps']:.0f}", int(med["errors"])]
            )  # fmt: skip
    added_rows = []
    for connections in options.concurrencies:
        envoy, routed = summary[("envoy", connections)], summary[("envoy+router", connections)]
        added_rows.append(
            [f"c={connections}", f"{routed['p50'] - envoy['p50']:+.2f}",
             f"{routed['p99'] - envoy['p99']:+.2f}", f"{routed['rps'] / envoy['rps']:.2f}"]
        )  # fmt: skip
    added_table = report.markdown_table(
        ["load", "p50 added (ms)", "p99 added (ms)", "throughput ratio"], added_rows
    )
    paths_table = report.markdown_table(
        ["load", "path", "p50 (ms)", "p90 (ms)", "p99 (ms)", "req/s", "errors"], rows
    )
    command = "prefix-router bench --workload overhead " + shlex.join(
        ["--duration", f"{options.duration_s:g}", "--rounds", str(options.rounds)]
    )
    text = f"""# Routing overhead

What the router adds to a request, measured as the same {options.body_bytes}-byte chat
requests ({options.distinct_prompts} distinct prompts in rotation) sent three ways in one
run: straight to a simulated backend (`direct`), through Envoy with no ext_proc (`envoy`),
and through Envoy with the router deciding every request (`envoy+router`, PREFIX_AWARE,
override-host mode). The backends answer at once, so the differences are the proxy's and
the router's cost. Client ([wrk](https://github.com/wg/wrk), one thread), Envoy, router and
backends all share this machine's cores. Each cell is the median of {options.rounds} rounds
of {options.duration_s:g} s; the paths run interleaved, in a rotating order.

## Added by the router (envoy+router minus envoy)

{added_table}

SageMaker publishes 1.3 to 1.9 ms of routing overhead; our target is at most 1.0 ms at p50.

## All paths

{paths_table}

![latency by path](overhead.png)

## Reproduce

```
{command}
```

- Machine: {report.machine_description()}
- Envoy: {report.tool_version([envoy_binary(), "--version"])}
- wrk: {report.tool_version(["wrk", "-v"])}
"""
    path = options.out_dir / "overhead.md"
    path.write_text(text)
    _plot(options, summary, options.out_dir / "overhead.png")
    return path


def _plot(
    options: OverheadOptions, summary: dict[tuple[str, int], dict[str, float]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(options.concurrencies), figsize=(5 * len(options.concurrencies), 4)
    )
    for axis, connections in zip(
        axes if len(options.concurrencies) > 1 else [axes], options.concurrencies, strict=True
    ):
        positions = range(len(PATHS))
        p50 = [summary[(p, connections)]["p50"] for p in PATHS]
        p99 = [summary[(p, connections)]["p99"] for p in PATHS]
        axis.bar([x - 0.2 for x in positions], p50, width=0.4, label="p50")
        axis.bar([x + 0.2 for x in positions], p99, width=0.4, label="p99")
        axis.set_xticks(list(positions), PATHS)
        axis.set_ylabel("latency (ms)")
        axis.set_title(f"concurrency {connections}")
        axis.legend()
    figure.suptitle(f"Routing overhead, {options.body_bytes}-byte chat bodies (median of rounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(options: OverheadOptions) -> Path:
    results = measure(options)
    path = write_report(options, results)
    print(path.read_text().split("## All paths")[0], file=sys.stdout)
    return path
