"""The peer routers on real vLLM, on the same requests as our paths (issue 26's "peers in
the same runs"): smg's ``cache_aware`` (an approximate tree of the prompts it sent) and
vllm-router's ``kv_aware`` (an index of the engines' own KV events, like our precise mode).

Each peer is a proxy in front of the engines, not an ext_proc processor, so its path runs
without Envoy: the client sends to the peer, and the peer to vLLM. It is started fresh for
each scenario (an empty index, as our routers restart), at its defaults but for what it
needs to know of the fleet:

- vllm-router ``kv_aware`` subscribes to every engine's events. It accepts only
  ``tcp://HOST:PORT`` publishers, and vLLM binds only a wildcard address (an endpoint
  with a host makes the engine connect instead; ``../shared/FIELD-NOTES.md``), so an
  ``EventRelay`` forwards each engine's publisher, found at its ``/kv_event_sources``, to a
  loopback TCP port. It hashes blocks from the model's own tokenizer (``--kv-event-model``,
  the model's directory) in the engine's block size.
- smg ``cache_aware`` needs the worker URLs only.

No response header says which instance a peer chose, so a peer's per-instance shares are
the engines' own finished-request counts, and its groups' placement is not known.
"""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import zmq

from extproc.stack.processes import ManagedProcess, free_port, free_ports, wait_until
from extproc.stack.prometheus import scrape, total

SMG_CACHE_AWARE = "smg cache_aware"
VLLM_ROUTER_KV_AWARE = "vllm-router kv_aware"
PEERS = (SMG_CACHE_AWARE, VLLM_ROUTER_KV_AWARE)
# vLLM's KV block on the CPU (its events' block_size; the hit counters count in these).
ENGINE_BLOCK_TOKENS = 128
PEER_START_TIMEOUT_S = 60.0


def peer_binary(path: str) -> str | None:
    """The peer's executable: beside this Python (the bench extra) or on PATH."""
    name = path.split(" ", 1)[0]
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def event_publisher(address: str) -> str:
    """The endpoint engine ``address`` publishes its KV events on (data-parallel rank 0),
    from vLLM's own ``GET /kv_event_sources``."""
    sources = httpx.get(f"http://{address}/kv_event_sources", timeout=10).raise_for_status()
    return str(sources.json()["0"]["endpoint"])


class EventRelay:
    """Forward one ZMQ publisher to a loopback TCP port: an XSUB connected to the engine's
    endpoint and an XPUB bound on ``tcp://127.0.0.1:port``, joined by zmq's own proxy in a
    thread. Subscriptions travel upstream and messages (topic, sequence, batch) downstream
    whole."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        self._context = zmq.Context()
        self._thread: threading.Thread | None = None
        self._control_endpoint = f"inproc://relay-{id(self):x}"

    def __enter__(self) -> EventRelay:
        context = self._context
        frontend, backend = context.socket(zmq.XSUB), context.socket(zmq.XPUB)
        control = context.socket(zmq.PAIR)
        frontend.connect(self.upstream)
        backend.bind(self.endpoint)
        control.bind(self._control_endpoint)

        def forward() -> None:
            try:
                zmq.proxy_steerable(frontend, backend, None, control)
            except zmq.ContextTerminated:  # stopped without its TERMINATE getting through
                pass
            finally:
                for socket in (frontend, backend, control):
                    socket.close(linger=0)

        self._thread = threading.Thread(target=forward, name="event-relay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        stop = self._context.socket(zmq.PAIR)
        stop.connect(self._control_endpoint)
        stop.send(b"TERMINATE")
        stop.close(linger=1000)  # linger=0 could drop the command before the proxy reads it
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._context.term()


def _answers_chat(url: str) -> bool:
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


@contextmanager
def running_peer(path: str, addresses: Sequence[str], model_dir: Path, work: Path) -> Iterator[str]:
    """Peer ``path`` started in front of the engines at ``addresses``; yields its base URL
    once it answers a chat completion, and stops it (and its relays) after."""
    binary = peer_binary(path)
    if binary is None:
        raise FileNotFoundError(f"{path.split(' ', 1)[0]} is not installed (pip install .[bench])")
    port, metrics_port = free_ports(2)
    workers = [f"http://{address}" for address in addresses]
    argv = [binary, *(["launch"] if path == SMG_CACHE_AWARE else [])]
    argv += [
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
    ]  # fmt: skip
    with ExitStack() as stack:
        if path == SMG_CACHE_AWARE:
            argv += ["--policy", "cache_aware"]
        else:
            argv += [
                "--policy", "kv_aware",
                "--kv-event-model", str(model_dir),
                "--kv-event-block-size", str(ENGINE_BLOCK_TOKENS),
            ]  # fmt: skip
            for worker, address in zip(workers, addresses, strict=True):
                relay = stack.enter_context(EventRelay(event_publisher(address)))
                argv += ["--kv-event-source", f"{worker}={relay.endpoint}"]
        name = path.replace(" ", "-")
        process = ManagedProcess(name, argv, work / f"{name}.log").start()
        stack.callback(process.stop)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers_chat(url), PEER_START_TIMEOUT_S, f"{path} to serve", process)
        yield url


def finished_requests(addresses: Sequence[str]) -> dict[str, float]:
    """Requests each engine has finished, whatever the reason, from its own
    ``vllm:request_success_total``."""
    return {
        address: total(scrape(f"http://{address}/metrics", 10.0), "vllm:request_success_total")
        for address in addresses
    }
