"""Memory the router's gRPC server keeps per ext_proc stream, by how the client ends it.

The soak showed the router's resident memory growing with the request count. This isolates
it: the router's real ``ExternalProcessor`` (static hosts, no Envoy) runs in a child
process, and a grpc.aio client sends it header and body messages the way Envoy does, then
ends each stream either with a clean half-close that reads the status (``close``), or
with a half-close followed at once by a cancel (``reset``: what Envoy's ext_proc client
does when a request finishes, ``closeStream()`` then ``resetStream()``). The child's
resident-memory growth per stream is reported for each.

    python -m extproc.bench.stream_leak [streams]
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from typing import Literal

import grpc

from extproc.adapter import messages
from extproc.bench.probes import rss_bytes
from extproc.stack.processes import free_port, tcp_open, wait_until

Ending = Literal["close", "reset"]
METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")


def _requests(n: int) -> list[messages.ProcessingRequest]:
    """What Envoy sends the router for one request: its headers, then its body."""
    text = f"prefix {n} " + "lorem ipsum " * 80
    body = '{"model":"m","messages":[{"role":"user","content":"' + text + '"}]}'
    headers = messages.ProcessingRequest()
    header = headers.request_headers.headers.headers.add()
    header.key, header.raw_value = "content-type", b"application/json"
    chunk = messages.ProcessingRequest()
    chunk.request_body.body = body.encode()
    chunk.request_body.end_of_stream = False
    return [headers, chunk]


async def _drive(port: int, first: int, count: int, ending: Ending, workers: int = 64) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.stream_stream(
            METHOD,
            request_serializer=messages.ProcessingRequest.SerializeToString,
            response_deserializer=messages.ProcessingResponse.FromString,
        )
        numbers = iter(range(first, first + count))

        async def worker() -> None:
            for n in numbers:
                call = method()
                for request in _requests(n):
                    await call.write(request)
                    await call.read()
                await call.done_writing()
                if ending == "reset":
                    call.cancel()
                else:
                    await call.read()  # end of stream, then the status

        await asyncio.gather(*(worker() for _ in range(workers)))


async def _serve(port: int) -> None:
    from extproc import logs
    from extproc.adapter.routing import Router
    from extproc.adapter.service import ExternalProcessor
    from extproc.config import RouterConfig
    from extproc.picker.decide import Strategy

    logs.configure("info")  # as the router runs: no line per decision
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        # RANDOM keeps no state per prompt (no index, no popularity), so what grows is
        # the gRPC stream's cost alone.
        (
            ExternalProcessor(
                Router(RouterConfig(hosts=HOSTS, routing_strategy=Strategy.RANDOM))
            ).handler(),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    while True:  # until killed
        await asyncio.sleep(0.5)
        gc.collect()


def growth_per_stream(ending: Ending, streams: int, warmup: int = 5000) -> float:
    """Bytes of the server's resident memory per stream, after ``warmup`` streams."""
    port = free_port()
    argv = [sys.executable, "-m", "extproc.bench.stream_leak", "serve", str(port)]
    server = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: tcp_open("127.0.0.1", port), 30.0, "the gRPC server")
        asyncio.run(_drive(port, 0, warmup, ending))
        time.sleep(1.0)  # let the server's collector run
        before = rss_bytes(server.pid)
        asyncio.run(_drive(port, warmup, streams, ending))
        time.sleep(1.0)
        return (rss_bytes(server.pid) - before) / streams
    finally:
        server.kill()
        server.wait(5)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        asyncio.run(_serve(int(argv[1])))
        return
    streams = int(argv[0]) if argv else 20_000
    for ending in ("close", "reset"):
        per_stream = growth_per_stream(ending, streams)
        print(f"{ending}: {per_stream:+.0f} bytes of server RSS per stream over {streams}")


if __name__ == "__main__":
    main(sys.argv[1:])
