"""The open-loop load generator against a real simulator on loopback."""

import asyncio
from dataclasses import dataclass, field

from extproc.bench.loadgen import run_open_loop
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port


@dataclass(frozen=True)
class Req:
    at_s: float
    body: dict
    group: str = "g"
    headers: dict = field(default_factory=dict)


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
