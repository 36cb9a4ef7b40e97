"""The open- and closed-loop load generators against a real simulator on loopback."""

import asyncio
from dataclasses import dataclass, field

import pytest

from extproc.bench.loadgen import run_closed_loop, run_open_loop
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port


@dataclass(frozen=True)
class Req:
    at_s: float
    body: dict
    group: str = "g"
    headers: dict = field(default_factory=dict)
    think_s: float | None = None


async def test_requests_go_out_on_schedule_and_report_ttft():
    port = free_port("127.0.0.41")
    ready = asyncio.Event()
    server = asyncio.create_task(
        serve([("127.0.0.41", port)], SimOptions(ttft_ms=50, itl_ms=5), ready)
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        body = {"model": "sim-model", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        # Open loop: the second request does not wait for the first.
        requests = [Req(0.0, body), Req(0.01, body), Req(0.3, body)]
        url = f"http://127.0.0.41:{port}/v1/chat/completions"
        outcomes, wall = await run_open_loop(url, requests)
        assert [o.status for o in outcomes] == [200, 200, 200]
        assert all(o.ok and 0.04 < o.ttft_s < 0.5 for o in outcomes)
        assert all(o.output_tokens == 4 for o in outcomes)
        assert outcomes[0].served_by == f"127.0.0.41:{port}"
        assert 0.3 < wall < 1.5
        # A bad request is reported, not raised.
        bad, _ = await run_open_loop(url, [Req(0.0, {"messages": 3})])
        assert bad[0].status == 400 and not bad[0].ok
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


async def test_a_later_turn_waits_for_the_reply_to_the_turn_before_and_its_think_time():
    host = "127.0.0.43"
    port = free_port(host)
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], SimOptions(ttft_ms=20, itl_ms=30), ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        body = {"model": "sim-model", "max_tokens": 10, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        url = f"http://{host}:{port}/v1/chat/completions"
        # Turn 2 is scheduled 10 ms after turn 1, but turn 1's reply takes ~0.3 s: the
        # client sends turn 2 0.2 s after that reply. Another conversation is not held up.
        requests = [Req(0.0, body, "a"), Req(0.01, body, "a", think_s=0.2), Req(0.02, body, "b")]
        started = asyncio.get_running_loop().time()
        outcomes, wall = await run_open_loop(url, requests)
        assert [o.status for o in outcomes] == [200, 200, 200]
        first, second, other = outcomes
        assert first.latency_s is not None and second.latency_s is not None
        assert other.latency_s is not None and other.latency_s < first.latency_s + 0.1
        assert wall >= first.latency_s + 0.2 + second.latency_s - 0.02
        assert asyncio.get_running_loop().time() - started >= wall
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


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
