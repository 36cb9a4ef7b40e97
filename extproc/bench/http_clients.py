"""The load generators' HTTP client, measured: what driving thousands of streaming
requests at once costs the client's own process, with aiohttp's client and with httpx's.

The load generators (``loadgen``, ``burst``, ``concurrency``) share the machine with what
they measure: each CPU-second the client spends is one that Envoy, the router and the
simulators under test do not get. So the client they use is chosen by this run. The same
streaming requests go straight to one simulator (no Envoy, no router), all sent at once,
with each client in turn, in interleaved rounds; the client's CPU time is its process's
(the simulator runs in its own).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import structlog

from extproc.bench import report
from extproc.bench.probes import cpu_seconds
from extproc.stack.processes import ManagedProcess, free_ports, http_ok, wait_until

log = structlog.get_logger("bench")

HOST = "127.0.0.1"
CLIENTS = ("aiohttp", "httpx")
# The harness's load generators: each drives its streams with the client the committed run
# found cheaper (tests/bench/test_http_clients.py holds them to it).
LOAD_GENERATORS = ("extproc.bench.loadgen", "extproc.bench.burst", "extproc.bench.concurrency")


@dataclass(frozen=True)
class HttpClientOptions:
    # Streaming requests sent at once, one connection each (as burst and concurrency send
    # them; loadgen keeps connections alive, which this run does not measure).
    levels: tuple[int, ...] = (500, 2000)
    stream_s: float = 4.0
    itl_s: float = 0.1
    rounds: int = 3
    out_dir: Path | None = None
    command: str = "prefix-router bench http-clients"
    clients: tuple[str, ...] = field(default=CLIENTS)

    def __post_init__(self) -> None:
        unknown = [name for name in self.clients if name not in CLIENTS]
        if unknown:
            raise ValueError(f"clients: unknown {unknown}, expected some of {list(CLIENTS)}")
        if not self.clients or len(set(self.clients)) != len(self.clients):
            raise ValueError(f"clients: expected distinct names, got {list(self.clients)}")
        if not self.stream_s > 0:
            raise ValueError(f"stream_s: expected seconds above 0, got {self.stream_s}")
        if not self.itl_s > 0:
            raise ValueError(f"itl_s: expected seconds above 0, got {self.itl_s}")
        if self.rounds < 1:
            raise ValueError(f"rounds: expected at least 1, got {self.rounds}")
        if not self.levels or min(self.levels) < 1:
            raise ValueError(f"levels: expected counts of at least 1, got {self.levels}")

    @property
    def tokens(self) -> int:
        return max(1, round(self.stream_s / self.itl_s))


def _body(n: int, tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": tokens,
        "stream": True,
        "messages": [{"role": "user", "content": f"document {n % 64} " * 60}],
    }


def _is_event(line: bytes) -> bool:
    return line.startswith(b"data: ") and not line.startswith(b"data: [DONE]")


async def _aiohttp_streams(url: str, level: int, tokens: int, timeout_s: float) -> list[int]:
    """``level`` requests at once through aiohttp's client: the events each one got."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(n: int) -> int:
            events = 0
            try:
                async with session.post(url, json=_body(n, tokens)) as response:
                    async for line in response.content:
                        events += _is_event(line)
            except (aiohttp.ClientError, TimeoutError):
                pass
            return events

        return list(await asyncio.gather(*(one(n) for n in range(level))))


async def _httpx_streams(url: str, level: int, tokens: int, timeout_s: float) -> list[int]:
    """``level`` requests at once through httpx's client: the events each one got."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s, trust_env=False) as client:

        async def one(n: int) -> int:
            events = 0
            try:
                async with asyncio.timeout(timeout_s):
                    request = client.stream("POST", url, json=_body(n, tokens))
                    async with request as response:
                        async for line in response.aiter_lines():
                            events += line.startswith("data: ") and line != "data: [DONE]"
            except (httpx.HTTPError, TimeoutError):
                pass
            return events

        return list(await asyncio.gather(*(one(n) for n in range(level))))


Driver = Callable[[str, int, int, float], Coroutine[Any, Any, list[int]]]
DRIVERS: dict[str, Driver] = {
    "aiohttp": _aiohttp_streams,
    "httpx": _httpx_streams,
}


def measure(
    client: str, url: str, level: int, options: HttpClientOptions, sim_pid: int
) -> dict[str, Any]:
    """One round of one client at one level: its process's CPU time, the simulator's, and
    the wall time of the round (connections included)."""
    timeout_s = options.stream_s * 3 + 60
    gc.collect()  # the garbage of the round before is not charged to this one
    cpu, sim_cpu, wall = time.process_time(), cpu_seconds(sim_pid), time.monotonic()
    events = asyncio.run(DRIVERS[client](url, level, options.tokens, timeout_s))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    sim_cpu = cpu_seconds(sim_pid) - sim_cpu
    result = {
        "client": client,
        "level": level,
        "completed": sum(1 for e in events if e >= options.tokens),
        "events": sum(events),
        "cpu_s": round(cpu, 3),
        "sim_cpu_s": round(sim_cpu, 3),
        "wall_s": round(wall, 3),
    }
    log.info("http_clients.round", **result)
    return result


def run(options: HttpClientOptions) -> dict[str, Any]:
    (port,) = free_ports(1, HOST)
    address = f"{HOST}:{port}"
    sim_args = ("--ttft-ms", "0", "--itl-ms", f"{options.itl_s * 1000:g}")
    with tempfile.TemporaryDirectory(prefix="http-clients-") as tmp:
        sim = ManagedProcess(
            "sim",
            [sys.executable, "-m", "extproc", "sim", "--address", address, *sim_args],
            Path(tmp) / "sim.log",
        ).start()
        try:
            wait_until(lambda: http_ok(f"http://{address}/health"), 30, "the simulator", sim)
            url = f"http://{address}/v1/chat/completions"
            assert sim.popen is not None
            # Each round reverses the order of the one before, so neither client always
            # follows the other (and the simulator's closing of its connections).
            rounds = [
                measure(client, url, level, options, sim.popen.pid)
                for number in range(options.rounds)
                for level in options.levels
                for client in (options.clients[::-1] if number % 2 else options.clients)
            ]
        finally:
            sim.stop()
    data = {
        "kind": "http-clients",
        "options": {
            **{k: v for k, v in asdict(options).items() if k != "out_dir"},
            "tokens": options.tokens,
        },
        "machine": report.machine_description(),
        "rounds": rounds,
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, "http-clients", data)
    return data


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level and client: rounds, whether every request completed in each, and the
    medians of CPU ms per request, µs per event and share of a core."""
    rows = []
    options = data["options"]
    for level in options["levels"]:
        for client in options["clients"]:
            runs = [r for r in data["rounds"] if r["client"] == client and r["level"] == level]
            rows.append(
                {
                    "level": level,
                    "client": client,
                    "rounds": len(runs),
                    "all_completed": all(r["completed"] == level for r in runs),
                    "cpu_ms_per_request": statistics.median(
                        1000 * r["cpu_s"] / level for r in runs
                    ),
                    "cpu_us_per_event": statistics.median(
                        1e6 * r["cpu_s"] / max(1, r["events"]) for r in runs
                    ),
                    "core_share": statistics.median(r["cpu_s"] / r["wall_s"] for r in runs),
                    "wall_s": statistics.median(r["wall_s"] for r in runs),
                    "sim_core_share": statistics.median(r["sim_cpu_s"] / r["wall_s"] for r in runs),
                }
            )
    return rows


def cheaper(data: dict[str, Any]) -> str:
    """The client that cost less CPU per request at the run's largest level, where every
    round of both read every stream whole."""
    largest = max(data["options"]["levels"])
    rows = [r for r in summary(data) if r["level"] == largest]
    if {r["client"] for r in rows} != set(CLIENTS):
        raise ValueError(f"the run did not measure every client: {list(CLIENTS)}")
    if not all(r["all_completed"] for r in rows):
        raise ValueError(f"the run did not complete every stream of {largest} with each client")
    return str(min(rows, key=lambda r: r["cpu_ms_per_request"])["client"])


def _row(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['level']:,}",
        row["client"],
        str(row["rounds"]),
        "yes" if row["all_completed"] else "no",
        f"{row['cpu_ms_per_request']:.2f}",
        f"{row['cpu_us_per_event']:.1f}",
        f"{row['core_share']:.2f}",
        f"{row['wall_s']:.1f}",
        f"{row['sim_core_share']:.2f}",
    ]


def render(data: dict[str, Any]) -> str:
    options = data["options"]
    rows = summary(data)
    header = [
        "requests at once",
        "client",
        "rounds",
        "every request whole",
        "client CPU per request (ms)",
        "client CPU per event (µs)",
        "share of a core",
        "round's wall time (s)",
        "simulator's share of a core",
    ]
    table = report.markdown_table(header, [_row(r) for r in rows])
    ratios = []
    for level in options["levels"]:
        by_client = {r["client"]: r["cpu_ms_per_request"] for r in rows if r["level"] == level}
        if {"aiohttp", "httpx"} <= by_client.keys():
            ratio = by_client["httpx"] / by_client["aiohttp"]
            ratios.append(f"- {level:,} at once: httpx's costs **{ratio:.2f} times** aiohttp's")
    ratio_lines = "\n".join(ratios)
    try:
        chosen = cheaper(data)
        largest = max(options["levels"])
        verdict = (
            f"The load generators ({', '.join(LOAD_GENERATORS)}) use **{chosen}**'s client, "
            f"the cheaper here at {largest:,} at once (tests/bench/test_http_clients.py holds "
            "them to the committed run)."
        )
    except ValueError as why:
        verdict = f"No client is chosen from this run: {why}."
    return f"""# The load generators' HTTP client

Each round sends that many streaming chat completions at once, one connection each, straight
to one simulated vLLM instance (no Envoy, no router), whose replies stream
{options["stream_s"]:g} s ({options["tokens"]} events), with each client in turn; rounds are
interleaved. The client's CPU is its own process's (the simulator runs in another). The load
generators (extproc/bench: loadgen, burst, concurrency) share the machine with Envoy, the
router and the simulators they measure, so the CPU their client spends is taken from those.
Medians of {options["rounds"]} round(s).

{table}

{ratio_lines}

A round's wall time is from its first connection to its last stream's end. Past the
streams' {options["stream_s"]:g} s it is time the client or the simulator (one process, its
share of a core beside the client's) took to read and write them.

{verdict}

## Reproduce

```
{options["command"]}
```

- Machine: {data["machine"]}
- Rendered from `http-clients.json`.
"""
