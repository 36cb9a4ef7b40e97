"""The closed-loop load generator against a real simulator on loopback."""

import asyncio
from dataclasses import dataclass, field

import pytest

from extproc.bench.loadgen import run_closed_loop
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port


@dataclass(frozen=True)
class Req:
    at_s: float
    body: dict
    group: str = "g"
    headers: dict = field(default_factory=dict)


BODY = {"model": "sim-model", "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip


async def test_closed_loop_keeps_a_fixed_number_in_flight():
    host = "127.0.0.42"
    port = free_port(host)
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], SimOptions(ttft_ms=100, itl_ms=0), ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        url = f"http://{host}:{port}/v1/chat/completions"
        # Arrival times are ignored: 12 requests, 4 at a time, ~100 ms each: ~0.3 s.
        requests = [Req(100.0, BODY) for _ in range(12)]
        outcomes, wall = await run_closed_loop(url, requests, concurrency=4, time_limit_s=30)
        assert len(outcomes) == 12 and all(o.ok for o in outcomes)
        assert 0.25 < wall < 1.5
        # The time limit stops new sends; what was sent completes.
        outcomes, wall = await run_closed_loop(url, requests * 10, 2, time_limit_s=0.25)
        assert 2 <= len(outcomes) <= 10 and wall < 1.5
        with pytest.raises(ValueError):
            await run_closed_loop(url, requests, 0, 1)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
