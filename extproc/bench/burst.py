"""Bursts: thousands of streaming requests sent at once, with no ramp, through one Envoy
(the generated bootstrap, its 0.5 s ``message_timeout``) and one router, to simulated vLLM
instances, once for each way the router may answer more streams than it can decide in time.

A burst is what a batch job, a gateway restart or clients retrying after an outage send:
every stream opens in the same instant, and each message Envoy sends the router waits in
the router's one event loop behind all the others. The router must decide each request or
say at once that it did not; Envoy's message timeout must never decide for it.

For each variant (router settings) and each level, a fresh stack takes ``level`` streaming
chat completions started together. Per request: its status, whether its whole reply came,
and its time to first token (send to the first ``data:`` event). Per level: the router's
decisions and sheds (``prefix_router_decisions_total``, ``prefix_router_shed_total``) and
Envoy's breaker, timeout and fail-open counters. A level holds when every request gets its
whole reply, the router decided every one (a shed request is a decision too, counted
apart), and every Envoy counter stayed 0: no ``message_timeouts``, nothing failed open.
The run is stored as ``burst.json``; the markdown is rendered from it alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from extproc.bench import report
from extproc.bench.concurrency import FAILURE_COUNTERS, decisions, failure_counts
from extproc.stack.local import LocalStack, StackSpec, envoy_binary

log = structlog.get_logger("bench")

KIND = "burst"
# The router settings each variant runs with, over its defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "never shed": {"shed_lag_s": None, "shed_backlog": None},
    "shed by the lag alone": {"shed_backlog": None},
    "backlog 128": {"shed_backlog": 128},
    "backlog 64": {"shed_backlog": 64},
    "shed every request": {"shed_lag_s": 0},
    "streams end at decision": {"stream_end": "decision"},
    "decision, at most 256 streams": {"stream_end": "decision"},
    "decision, at most 1024 streams": {"stream_end": "decision"},
}
# Envoy's bootstrap settings (BootstrapParams fields) of the variants that change it: the
# router cluster's breaker, past which a request's stream fails at once and it fails open
# (cluster.prefix_router.upstream_rq_active_overflow) instead of waiting for the timeout.
ENVOY_VARIANTS: dict[str, dict[str, Any]] = {
    "decision, at most 256 streams": {"router_max_streams": 256},
    "decision, at most 1024 streams": {"router_max_streams": 1024},
}
# Envoy's counter of requests whose ext_proc stream the router cluster's breaker refused:
# each failed open at once, without waiting for message_timeout.
BREAKER_OVERFLOW = "cluster.prefix_router.upstream_rq_active_overflow"
# What Envoy's ext_proc filter counts for each of those, too.
BREAKER_ALSO = (
    "http.ingress.ext_proc.streams_failed",
    "http.ingress.ext_proc.failure_mode_allowed",
)


@dataclass(frozen=True)
class BurstOptions:
    levels: tuple[int, ...] = (3000, 6000)
    variants: tuple[str, ...] = (
        "defaults",
        "shed by the lag alone",
        "never shed",
        "shed every request",
        "streams end at decision",
        "decision, at most 256 streams",
        "decision, at most 1024 streams",
    )
    # Each variant and level this many times, interleaved; the report quotes medians.
    rounds: int = 1
    stream_s: float = 20.0
    # Seconds between the tokens of a reply: stream_s / itl_s tokens each.
    itl_s: float = 0.5
    backends: int = 3
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = "prefix-router bench concurrency --burst"

    def __post_init__(self) -> None:
        unknown = [name for name in self.variants if name not in VARIANTS]
        if unknown:
            raise ValueError(f"variants: unknown {unknown}, expected some of {list(VARIANTS)}")
        if self.rounds < 1:
            raise ValueError(f"rounds: expected at least 1, got {self.rounds}")

    @property
    def tokens(self) -> int:
        return max(1, round(self.stream_s / self.itl_s))


async def _send(url: str, level: int, options: BurstOptions) -> list[dict[str, Any]]:
    """``level`` streaming requests started together; each one's status, events and TTFT."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=options.stream_s * 3 + 60)
    start = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(n: int) -> dict[str, Any]:
            body = {
                "model": "sim-model",
                "max_tokens": options.tokens,
                "stream": True,
                "messages": [{"role": "user", "content": f"document {n % 64} " * 60}],
            }
            await start.wait()
            sent = time.monotonic()
            ttft = None
            events = 0
            try:
                async with session.post(url, json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            if ttft is None:
                                ttft = time.monotonic() - sent
                            events += 1
                    return {"status": response.status, "events": events, "ttft_s": ttft}
            except (aiohttp.ClientError, TimeoutError):
                return {"status": 0, "events": events, "ttft_s": ttft}

        tasks = [asyncio.create_task(one(n)) for n in range(level)]
        await asyncio.sleep(0)  # every task is waiting on the start: they go together
        start.set()
        return list(await asyncio.gather(*tasks))


def measure(variant: str, level: int, options: BurstOptions) -> dict[str, Any]:
    sim_args = ("--ttft-ms", "0", "--itl-ms", f"{options.itl_s * 1000:g}")
    spec = StackSpec.ephemeral(
        options.backends,
        sim_args=sim_args,
        upstream_host_header=False,
        router_settings=VARIANTS[variant],
        envoy_settings=ENVOY_VARIANTS.get(variant, {}),
    )
    with LocalStack(spec) as stack:
        before = decisions(stack)
        shed_before = stack.router_metric("prefix_router_shed_total") or 0.0
        started = time.monotonic()
        outcomes = asyncio.run(_send(f"{stack.url}/v1/chat/completions", level, options))
        seconds = time.monotonic() - started
        decided = decisions(stack) - before
        shed = (stack.router_metric("prefix_router_shed_total") or 0.0) - shed_before
        failures = failure_counts(stack.admin_url, FAILURE_COUNTERS)
    ttfts = sorted(o["ttft_s"] for o in outcomes if o["ttft_s"] is not None)
    statuses: dict[str, int] = {}
    for outcome in outcomes:
        statuses[str(outcome["status"])] = statuses.get(str(outcome["status"]), 0) + 1
    result = {
        "variant": variant,
        "level": level,
        "seconds": round(seconds, 2),
        "statuses": statuses,
        "completed": sum(
            1 for o in outcomes if o["status"] == 200 and o["events"] >= options.tokens
        ),
        "decided": decided,
        "shed": shed,
        "failures": failures,
        "ttft_s": {
            "p50": round(statistics.median(ttfts), 4) if ttfts else None,
            "p99": round(_p99(ttfts), 4) if ttfts else None,
            "max": round(ttfts[-1], 4) if ttfts else None,
        },
    }
    result["held"] = holds(result)
    result["no_timeouts"] = waited_for_no_timeout(result)
    log.info("burst.level", variant=variant, level=level, held=result["held"], shed=shed)
    return result


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def holds(result: dict[str, Any]) -> bool:
    return (
        result["completed"] == result["level"]
        and result["decided"] == result["level"]
        and all(value == 0 for value in result["failures"].values())
    )


def waited_for_no_timeout(result: dict[str, Any]) -> bool:
    """Every request got its whole reply and none waited for Envoy's message timeout:
    each was decided by the router, or failed open at once by the router cluster's breaker
    (the issue's other option), never after a timeout or a failed stream."""
    failures = result["failures"]
    moved = {name: value for name, value in failures.items() if value}
    at_once = moved.get(BREAKER_OVERFLOW, 0.0)
    # Each refused stream also counts as a failed stream and a fail-open, and no more.
    return (
        result["completed"] == result["level"]
        and result["decided"] + at_once == result["level"]
        and set(moved) <= {BREAKER_OVERFLOW, *BREAKER_ALSO}
        and all(moved.get(name, 0.0) == at_once for name in BREAKER_ALSO)
    )


def run(options: BurstOptions) -> dict[str, Any]:
    results = [
        measure(variant, level, options) | {"round": round_}
        for level in options.levels
        for round_ in range(options.rounds)
        for variant in options.variants
    ]
    data = {
        "kind": KIND,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "settings": {name: VARIANTS[name] for name in options.variants},
        "envoy_settings": {
            name: ENVOY_VARIANTS[name] for name in options.variants if name in ENVOY_VARIANTS
        },
        "machine": report.machine_description(),
        "envoy": report.tool_version([envoy_binary(), "--version"]),
        "results": results,
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "burst", data)
    return data


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:,.0f}"


def _answers(statuses: dict[str, float]) -> str:
    """Status: requests, medians over rounds; a status whose median is 0 (seen in fewer
    than half the rounds) is left out."""
    return ", ".join(
        f"{'none' if c == '0' else c}: {n:,.0f}" for c, n in sorted(statuses.items()) if n
    )


def summaries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each variant and level over its rounds: the medians of its counts and TTFTs, and
    whether every round held."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for result in data["results"]:
        grouped.setdefault((result["variant"], result["level"]), []).append(result)
    found = []
    for (variant, level), results in grouped.items():
        names = sorted({name for r in results for name in r["failures"]})
        codes = sorted({code for r in results for code in r["statuses"]})
        found.append(
            {
                "variant": variant,
                "level": level,
                "rounds": len(results),
                "completed": _median(r["completed"] for r in results),
                "statuses": {c: _median(r["statuses"].get(c, 0) for r in results) for c in codes},
                "decided": _median(r["decided"] for r in results),
                "shed": _median(r["shed"] for r in results),
                "on_body": _median(r["decided"] - r["shed"] for r in results),
                "failures": {n: _median(r["failures"].get(n, 0.0) for r in results) for n in names},
                "ttft_s": {
                    q: _median_or_none(r["ttft_s"][q] for r in results) for q in ("p50", "p99")
                },
                "held": all(r["held"] for r in results),
                # Runs stored before this was measured say None.
                "no_timeouts": all(r.get("no_timeouts", False) for r in results)
                if all("no_timeouts" in r for r in results)
                else None,
            }
        )
    return found


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def _median_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def _settings(values: dict[str, Any], envoy: dict[str, Any] | None = None) -> str:
    written = ", ".join(f"`{k}: {'null' if v is None else v}`" for k, v in values.items())
    router = written or "the router at its defaults"
    if not envoy:
        return router
    return router + "; Envoy: " + ", ".join(f"`{k}={v}`" for k, v in envoy.items())


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    rows = []
    for result in summaries(data):
        failed = {k.rsplit(".", 1)[-1]: v for k, v in result["failures"].items() if v}
        rows.append(
            [
                result["variant"],
                f"{result['level']:,}",
                f"{result['completed']:,.0f}",
                _answers(result["statuses"]),
                f"{result['on_body']:,.0f}",
                f"{result['shed']:,.0f}",
                ", ".join(f"`{k}` {v:,.0f}" for k, v in failed.items()) or "all 0",
                _ms(result["ttft_s"]["p50"]),
                _ms(result["ttft_s"]["p99"]),
                {True: "yes", False: "no", None: ""}[result["no_timeouts"]],
                "**yes**" if result["held"] else "no",
            ]
        )
    table = report.markdown_table(
        ["variant", "requests at once", "completed", "answers (status: requests)",
         "decided on the body", "shed (decided on the headers)",
         "Envoy's breaker, timeout and fail-open counters", "TTFT p50 (ms)", "TTFT p99 (ms)",
         "none waited for a timeout", "held"],
        rows,
    )  # fmt: skip
    envoy = data.get("envoy_settings", {})
    settings = "\n".join(
        f"- {name}: {_settings(values, envoy.get(name))}"
        for name, values in data["settings"].items()
    )
    held = [r for r in summaries(data) if r["held"]]
    verdict = (
        "Held: " + "; ".join(f"{r['variant']} at {r['level']:,}" for r in held) + "."
        if held
        else "No variant held at any level."
    )
    return f"""# Bursts: thousands of streaming requests at once

Each row sends that many streaming chat completions together, with no ramp, through one
Envoy (the generated bootstrap: buffered-partial bodies, a 0.5 s message timeout) and one
router, to {options["backends"]} simulated vLLM instances whose replies stream
{options["stream_s"]:g} s ({round(options["stream_s"] / options["itl_s"])} tokens). Each row
runs on a fresh stack. A row holds when every request gets its whole reply, the router
decided every one (on the body, or shed: on the headers alone, the least loaded host), and
Envoy's counters {", ".join(f"`{p}{n}`" for p, names in FAILURE_COUNTERS.items() for n in names)}
all stay 0: no request waited for Envoy's message timeout or was failed open unseen. "None
waited for a timeout" is the weaker outcome the breaker variants aim at: every reply whole,
and each request either decided by the router or failed open at once by the router
cluster's breaker (`{BREAKER_OVERFLOW}`, counted by Envoy), none after a timeout or a failed
stream. TTFT is
the client's, from sending the request to the first token. Each row is the median of its
{options["rounds"]} round(s), run interleaved; it holds only if every round held.

{settings}

{table}

{verdict}

## Reproduce

```
{options["command"]}
```

- Machine: {data["machine"]}
- Envoy: {data["envoy"]}
"""
