"""Long streams: the ext_proc streams Envoy holds while LLM responses stream for 30 s.

For each body mode, one stack (the router at its defaults, simulated backends whose replies
stream for ``stream_s``) takes ``requests`` streaming chat completions started together.
``buffered-partial`` keeps each ext_proc stream open to the end of its response (the
default ``stream_end: response``); ``streamed`` ends it with the decision and learns of
the response's end from Envoy's access log. Every ``sample_every_s``: Envoy's open
streams to the router (``cluster.prefix_router.upstream_rq_active``) and to the backends
(``cluster.vllm.upstream_rq_active``), the router's requests in flight
(``prefix_router_in_flight_requests``) and its resident memory. The run is stored as
``long-streams.json``; the markdown and the plot are rendered from it alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from extproc.bench import probes, report
from extproc.stack.bootstrap import BODY_MODES
from extproc.stack.local import LocalStack, StackSpec, envoy_binary, envoy_counters

log = structlog.get_logger("bench")


@dataclass(frozen=True)
class LongStreamOptions:
    requests: int = 500
    stream_s: float = 30.0
    # Seconds between the tokens of a reply: stream_s / itl tokens each.
    itl_s: float = 0.5
    sample_every_s: float = 1.0
    backends: int = 3
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = "prefix-router bench long-streams"

    @property
    def tokens(self) -> int:
        return reply_tokens(self.stream_s, self.itl_s)


def reply_tokens(stream_s: float, itl_s: float) -> int:
    """Tokens in each reply: one every ``itl_s`` for about ``stream_s``."""
    return max(1, round(stream_s / itl_s))


def _sample(stack: LocalStack, started: float) -> dict[str, float]:
    assert stack.router is not None and stack.router.popen is not None
    router = probes.scrape(stack.router_metrics_url)
    return {
        "t": round(time.monotonic() - started, 2),
        "ext_proc_streams": envoy_counters(stack.admin_url, "cluster.prefix_router.").get(
            "upstream_rq_active", 0.0
        ),
        "backend_requests": envoy_counters(stack.admin_url, "cluster.vllm.").get(
            "upstream_rq_active", 0.0
        ),
        "router_in_flight": probes.total(router, "prefix_router_in_flight_requests"),
        "router_rss": probes.rss_bytes(stack.router.popen.pid),
    }


def _warm(stack: LocalStack) -> None:
    """One request first, and in streamed mode one on every Envoy worker: each opens its
    access log stream to the router with its first entry, and until then the router
    counts a streamed request by the load feed instead (docs/architecture.md); the run
    measures the steady state."""
    body = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "w"}]}
    httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()
    if stack.spec.body_mode == "streamed":
        stack.open_completion_logs()


async def _drive(stack: LocalStack, options: LongStreamOptions) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=options.requests, max_keepalive_connections=0)
    timeout = httpx.Timeout(options.stream_s * 3 + 30)
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=stack.url, limits=limits, timeout=timeout) as http:

        async def one(n: int) -> tuple[int, int]:
            body = {
                "model": "sim-model",
                "max_tokens": options.tokens,
                "stream": True,
                "messages": [{"role": "user", "content": f"long stream {n} " + "x " * 200}],
            }
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line]
                return response.status_code, len(lines)

        tasks = [asyncio.create_task(one(n)) for n in range(options.requests)]
        deadline = started + options.stream_s * 3 + 60  # bounded whatever happens
        while not all(t.done() for t in tasks) and time.monotonic() < deadline:
            samples.append(await asyncio.to_thread(_sample, stack, started))
            await asyncio.sleep(options.sample_every_s)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    finished = time.monotonic() - started
    # Every completion reported: the router's count returns to zero.
    for _ in range(20):
        last = await asyncio.to_thread(_sample, stack, started)
        samples.append(last)
        if last["router_in_flight"] == 0 and last["ext_proc_streams"] == 0:
            break
        await asyncio.sleep(0.25)
    ok = [o for o in outcomes if isinstance(o, tuple) and o[0] == 200 and o[1] > options.tokens]
    return {
        "completed": len(ok),
        "failed": options.requests - len(ok),
        "seconds": round(finished, 2),
        "samples": samples,
    }


def measure(options: LongStreamOptions) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for body_mode in BODY_MODES:
        spec = StackSpec.ephemeral(
            options.backends,
            body_mode=body_mode,
            sim_args=("--ttft-ms", "0", "--itl-ms", f"{options.itl_s * 1000:g}"),
        )
        with LocalStack(spec) as stack:
            _warm(stack)
            runs[body_mode] = asyncio.run(_drive(stack, options))
        log.info("long_streams.mode", body_mode=body_mode, completed=runs[body_mode]["completed"])
    return runs


def middle(run: dict[str, Any], options: dict[str, Any], name: str) -> float:
    """The median of ``name`` over the middle half of the responses' life: every request
    decided, every response still streaming."""
    low, high = options["stream_s"] * 0.25, options["stream_s"] * 0.75
    values = [s[name] for s in run["samples"] if low <= s["t"] <= high]
    return statistics.median(values) if values else float("nan")


def run(options: LongStreamOptions) -> dict[str, Any]:
    data = {
        "kind": "long-streams",
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "machine": report.machine_description(),
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "runs": measure(options),
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "long-streams", data)
    return data


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    rows = []
    for body_mode, run_ in data["runs"].items():
        rows.append(
            [
                body_mode,
                options["requests"],
                run_["completed"],
                f"{middle(run_, options, 'ext_proc_streams'):.0f}",
                f"{middle(run_, options, 'router_in_flight'):.0f}",
                f"{middle(run_, options, 'backend_requests'):.0f}",
                f"{max(s['router_rss'] for s in run_['samples']) / 2**20:.0f}",
                f"{run_['seconds']:.1f}",
            ]
        )
    table = report.markdown_table(
        ["body mode", "requests", "completed", "ext_proc streams held", "router in flight",
         "backend requests", "router peak RSS (MiB)", "seconds"],
        rows,
    )  # fmt: skip
    verdicts = []
    for body_mode, run_ in data["runs"].items():
        held = middle(run_, options, "ext_proc_streams")
        streaming = middle(run_, options, "backend_requests")
        verdicts.append(
            f"- `{body_mode}`: Envoy held {held:.0f} ext_proc streams while {streaming:.0f} "
            f"responses were streaming ({held / streaming if streaming else 0:.0%} of them)."
        )
    return f"""# Long streams: what Envoy holds while responses stream

{options["requests"]} streaming chat completions started together, each streaming
{reply_tokens(options["stream_s"], options["itl_s"])} tokens over about
{options["stream_s"]:g} s, through Envoy and the router at its defaults, once per body
mode. `buffered-partial` keeps each ext_proc stream open until its response ends;
`streamed` ends it with the decision, and the router learns of each response's end from
Envoy's access log, so its in-flight count stays right (one request before the run opens
that log's stream). Each middle column is the median
of the samples (every {options["sample_every_s"]:g} s) over the middle half of the
responses' life, when every request has been decided and every response is still
streaming.

{table}

{chr(10).join(verdicts)}

![streams over time](long-streams.png)

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

    figure, axes = plt.subplots(1, len(data["runs"]), figsize=(6 * len(data["runs"]), 4))
    for axis, (body_mode, run_) in zip(axes, data["runs"].items(), strict=True):
        times = [s["t"] for s in run_["samples"]]
        for key, label in (
            ("ext_proc_streams", "ext_proc streams Envoy holds"),
            ("backend_requests", "responses streaming (Envoy to backends)"),
            ("router_in_flight", "router's requests in flight"),
        ):
            axis.plot(times, [s[key] for s in run_["samples"]], label=label)
        axis.set_title(body_mode)
        axis.set_xlabel("time (s)")
        axis.set_ylim(bottom=0)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(figure)
