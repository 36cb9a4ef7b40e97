import asyncio
import contextlib
import hashlib
import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from extproc.sim import server as sim_server
from extproc.sim.server import SimOptions, serve
from extproc.stack import prometheus
from extproc.stack.processes import free_ports_on, tcp_open, wait_until, wait_until_async

HOST = "127.0.0.1"
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=30)
# Prompts of whole 64-char blocks under the default 16 tokens x 4 chars.
BLOCK_CHARS = 64


def free_port(*hosts: str) -> int:
    """A port number currently free on every one of `hosts`."""
    return free_ports_on(1, hosts)[0]


@contextlib.asynccontextmanager
async def running(
    addresses: list[tuple[str, int]], options: SimOptions | None = None
) -> AsyncIterator[None]:
    ready = asyncio.Event()
    server = asyncio.create_task(serve(addresses, options or SimOptions(), ready))
    bound = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({server, bound}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    bound.cancel()
    if server in done:
        server.result()  # surfaces a bind error
    assert done, "simulator did not bind within 10 s"
    try:
        yield
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


Start = Callable[..., contextlib.AbstractAsyncContextManager[str]]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
        yield client


@pytest.fixture
def start() -> Start:
    """Start one instance on a free loopback port; yields its base URL."""

    @contextlib.asynccontextmanager
    async def _start(**option_overrides: object) -> AsyncIterator[str]:
        port = free_port(HOST)
        async with running([(HOST, port)], SimOptions(**option_overrides)):  # type: ignore[arg-type]
            yield f"http://{HOST}:{port}"

    return _start


async def metric(session: aiohttp.ClientSession, base: str, sample_name: str) -> float:
    async with session.get(f"{base}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    for (name, labels), value in prometheus.parse(text).items():
        if name == sample_name:
            assert dict(labels)["model_name"] == "sim-model"
            return value
    raise AssertionError(f"{sample_name} not exported")


async def wait_for_metric(
    session: aiohttp.ClientSession, base: str, name: str, value: float, timeout_s: float = 5
) -> None:
    async def reached() -> bool:
        return await metric(session, base, name) == value

    await wait_until_async(reached, timeout_s, f"{name} to be {value}", interval_s=0.02)


def sse_payloads(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    return [event.removeprefix("data: ") for event in events]


def chat_body(content: str, **extra: object) -> dict:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def test_chat_completion_shape(start: Start, session: aiohttp.ClientSession) -> None:
    async with (
        start() as base,
        session.post(f"{base}/v1/chat/completions", json=chat_body("Hi", max_tokens=5)) as resp,
    ):
        assert resp.status == 200
        assert resp.content_type == "application/json"
        body = await resp.json()

    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "sim-model"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert body["usage"] == {
        "prompt_tokens": -(-len(prompt) // 4),
        "completion_tokens": 5,
        "total_tokens": -(-len(prompt) // 4) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_shape_and_token_limits(
    start: Start, session: aiohttp.ClientSession
) -> None:
    async with start(default_max_tokens=3, max_tokens_cap=7) as base:
        url = f"{base}/v1/completions"
        async with session.post(url, json={"prompt": "abcdefgh"}) as resp:
            body = await resp.json()
        assert body["id"].startswith("cmpl-")
        assert body["object"] == "text_completion"
        assert len(body["choices"][0]["text"].split()) == 3
        assert body["usage"]["prompt_tokens"] == 2
        assert body["usage"]["completion_tokens"] == 3

        async with session.post(url, json={"prompt": "x", "max_tokens": 1000}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 7
        async with session.post(url, json={"prompt": "x", "max_completion_tokens": 2}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 2


async def test_chat_stream_shape(start: Start, session: aiohttp.ClientSession) -> None:
    body = chat_body("Hi", max_tokens=4, stream=True)
    async with start() as base:
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            payloads = sse_payloads(await resp.text())
        body["stream"] = False
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            whole = (await resp.json())["choices"][0]["message"]["content"]

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert len(chunks) == 4
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == whole
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert reasons == [None, None, None, "length"]


async def test_completion_stream_shape_with_usage(
    start: Start, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "x" * 130, "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with start() as base, session.post(f"{base}/v1/completions", json=body) as resp:
        payloads = sse_payloads(await resp.text())

    assert payloads[-1] == "[DONE]"
    *token_chunks, usage_chunk = (json.loads(payload) for payload in payloads[:-1])
    assert len(token_chunks) == 3
    assert all(chunk["object"] == "text_completion" for chunk in token_chunks)
    assert all(chunk["choices"][0]["text"] for chunk in token_chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 33
    assert usage_chunk["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_identical_requests_raise_prefix_cache_hits(
    start: Start, session: aiohttp.ClientSession, stream: bool
) -> None:
    prompt = "p" * (5 * BLOCK_CHARS + 10)  # five full blocks and a tail
    body = {"prompt": prompt, "max_tokens": 2, "stream": stream}
    async with start() as base:
        before = await metric(session, base, "vllm:prefix_cache_hits_total")
        for _ in range(2):
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()

        assert before == 0
        assert await metric(session, base, "vllm:prefix_cache_hits_total") == 5 * 16
        queries = await metric(session, base, "vllm:prefix_cache_queries_total")
        assert queries == 2 * -(-len(prompt) // 4)
        assert await metric(session, base, "vllm:prompt_tokens_total") == queries
        assert await metric(session, base, "vllm:generation_tokens_total") == 4
        assert await metric(session, base, "vllm:request_success_total") == 2
        assert await metric(session, base, "vllm:kv_cache_usage_perc") == 5 / 4096
        assert await metric(session, base, "vllm:num_requests_waiting") == 0


async def test_cached_tokens_reported_in_usage(
    start: Start, session: aiohttp.ClientSession
) -> None:
    shared = "s" * (3 * BLOCK_CHARS)
    async with start() as base:
        for suffix, cached in (("first question", 0), ("another question", 48)):
            body = chat_body(shared + suffix)
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == cached


BAD_BODIES = [
    pytest.param("/v1/completions", b"", id="empty"),
    pytest.param("/v1/completions", b"{not json", id="not-json"),
    pytest.param("/v1/completions", b'{"prompt": "\xff\xfe"}', id="bad-utf8"),
    pytest.param("/v1/completions", b'["prompt"]', id="not-object"),
    pytest.param("/v1/completions", b'{"prompt": 12}', id="prompt-type"),
    pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": "9"}', id="max-tokens-type"),
    pytest.param("/v1/completions", b'{"prompt": "x", "stream": 1}', id="stream-type"),
    pytest.param("/v1/completions", b"[" * 50_000 + b"]" * 50_000, id="deep-nesting"),
    pytest.param("/v1/chat/completions", b"{}", id="no-messages"),
    pytest.param("/v1/chat/completions", b'{"messages": [{"role": 1}]}', id="role-type"),
]


@pytest.mark.parametrize(("path", "raw"), BAD_BODIES)
async def test_bad_bodies_get_400_with_identity_and_digest_headers(
    start: Start, session: aiohttp.ClientSession, path: str, raw: bytes
) -> None:
    headers = {"Content-Type": "application/json"}
    async with start() as base:
        async with session.post(f"{base}{path}", data=raw, headers=headers) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert resp.headers["x-served-by"] == base.removeprefix("http://")
            assert resp.headers["x-request-body-bytes"] == str(len(raw))
            assert resp.headers["x-request-body-sha256"] == hashlib.sha256(raw).hexdigest()
        assert await metric(session, base, "vllm:num_requests_running") == 0
        assert await metric(session, base, "vllm:prefix_cache_queries_total") == 0

    assert error["type"] == "invalid_request_error"
    assert error["message"]


async def test_every_response_names_the_instance(
    start: Start, session: aiohttp.ClientSession
) -> None:
    async with start() as base:
        name = base.removeprefix("http://")
        async with session.get(f"{base}/health") as resp:
            assert resp.status == 200
            assert await resp.read() == b""
            assert resp.headers["x-served-by"] == name
        async with session.get(f"{base}/v1/models") as resp:
            assert resp.headers["x-served-by"] == name
            models = await resp.json()
            assert models["object"] == "list"
            assert [model["id"] for model in models["data"]] == ["sim-model"]
        async with session.get(f"{base}/metrics") as resp:
            assert resp.headers["x-served-by"] == name
        async with session.get(f"{base}/no/such/path") as resp:
            assert resp.status == 404
            assert resp.headers["x-served-by"] == name
        async with session.post(f"{base}/health", data=b"abc") as resp:
            assert resp.status == 405
            assert resp.headers["x-served-by"] == name
            assert resp.headers["x-request-body-sha256"] == hashlib.sha256(b"abc").hexdigest()


def big_body(size: int) -> bytes:
    head = b'{"max_tokens": 1, "prompt": "'
    tail = b'"}'
    return head + b"q" * (size - len(head) - len(tail)) + tail


@pytest.mark.parametrize("chunked", [False, True])
async def test_body_digest_of_a_3mb_body(
    start: Start, session: aiohttp.ClientSession, chunked: bool
) -> None:
    raw = big_body(3 * 1024 * 1024)

    async def pieces() -> AsyncIterator[bytes]:
        for offset in range(0, len(raw), 256 * 1024):
            yield raw[offset : offset + 256 * 1024]

    # BytesIO: aiohttp warns about sending multi-MB raw bytes in one go.
    data = pieces() if chunked else io.BytesIO(raw)
    async with (
        start() as base,
        session.post(f"{base}/v1/completions", data=data) as resp,
    ):
        assert resp.status == 200
        assert (resp.request_info.headers.get("Transfer-Encoding") == "chunked") is chunked
        assert resp.headers["x-request-body-bytes"] == str(len(raw))
        assert resp.headers["x-request-body-sha256"] == hashlib.sha256(raw).hexdigest()
        assert (await resp.json())["usage"]["prompt_tokens"] == -(-(len(raw) - 31) // 4)


async def test_oversized_body_gets_413_not_500(
    start: Start, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_server, "MAX_BODY_BYTES", 1000)
    async with (
        start() as base,
        session.post(f"{base}/v1/completions", data=big_body(5000)) as resp,
    ):
        assert resp.status == 413
        assert resp.headers["x-served-by"] == base.removeprefix("http://")
        assert "x-request-body-sha256" not in resp.headers
        assert (await resp.json())["error"]["message"]


async def test_delays_follow_ttft_and_itl(start: Start, session: aiohttp.ClientSession) -> None:
    async with start(ttft_ms=150, itl_ms=50) as base:
        began = time.monotonic()
        async with session.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3}):
            pass
        assert time.monotonic() - began >= 0.25 - 0.01

        body = {"prompt": "x", "max_tokens": 3, "stream": True}
        began = time.monotonic()
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            first_token_s = time.monotonic() - began
            await resp.read()
        total_s = time.monotonic() - began
    assert first_token_s >= 0.15 - 0.01
    assert total_s >= 0.25 - 0.01


async def test_running_gauge_covers_a_slow_request(
    start: Start, session: aiohttp.ClientSession
) -> None:
    async with start(ttft_ms=400) as base:

        async def slow_request() -> int:
            async with session.post(f"{base}/v1/completions", json={"prompt": "x"}) as resp:
                await resp.read()
                return resp.status

        request = asyncio.create_task(slow_request())
        await wait_for_metric(session, base, "vllm:num_requests_running", 1)
        assert await asyncio.wait_for(request, timeout=10) == 200
        assert await metric(session, base, "vllm:num_requests_running") == 0
        assert await metric(session, base, "vllm:request_success_total") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_client_abort_releases_the_running_gauge(
    start: Start, session: aiohttp.ClientSession, stream: bool
) -> None:
    # ttft for the whole response, itl so a stream stalls after its first token.
    async with start(ttft_ms=30_000 if not stream else 0, itl_ms=30_000) as base:

        async def abandoned_request() -> None:
            body = {"prompt": "x", "max_tokens": 3, "stream": stream}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()

        request = asyncio.create_task(abandoned_request())
        await wait_for_metric(session, base, "vllm:num_requests_running", 1)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request

        await wait_for_metric(session, base, "vllm:num_requests_running", 0)
        assert await metric(session, base, "vllm:request_success_total") == 0


async def test_instances_sharing_a_port_keep_independent_caches(
    session: aiohttp.ClientSession,
) -> None:
    hosts = ("127.0.0.2", "127.0.0.3")
    port = free_port(*hosts)
    first, second = (f"http://{host}:{port}" for host in hosts)
    body = {"prompt": "z" * (4 * BLOCK_CHARS)}

    async def cached_tokens(base: str) -> int:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.headers["x-served-by"] == f"{base.removeprefix('http://')}"
            return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with running([(host, port) for host in hosts]):
        assert await cached_tokens(first) == 0
        assert await cached_tokens(first) == 64
        assert await cached_tokens(second) == 0  # its cache never saw the prompt
        assert await metric(session, first, "vllm:prefix_cache_hits_total") == 64
        assert await metric(session, second, "vllm:prefix_cache_hits_total") == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", ""),
        ("capacity_blocks", 0),
        ("block_size_tokens", -1),
        ("chars_per_token", 2.5),
        ("ttft_ms", -1.0),
        ("itl_ms", float("nan")),
        ("default_max_tokens", 0),
        ("max_tokens_cap", True),
        ("keepalive_s", -0.5),
    ],
)
def test_options_reject_bad_values_by_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SimOptions(**{field: value})  # type: ignore[arg-type]


async def _idle_until_closed(base: str, wait_s: float) -> bool:
    """Send one request on a raw connection, then wait idle: True if the server closed it."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        await reader.readuntil(b"\r\n\r\n")  # the rest of the headers (no body)
        try:
            return await asyncio.wait_for(reader.read(1), wait_s) == b""
        except TimeoutError:
            return False
    finally:
        writer.close()


async def test_an_idle_connection_is_closed_after_the_keepalive_as_vllm_does(
    start: Start,
) -> None:
    # vLLM closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): so must the
    # simulator, or the fleet benchmarks hide the race Envoy's idle_timeout avoids.
    assert SimOptions().keepalive_s == 5.0
    async with start(keepalive_s=0.3) as base:
        assert await _idle_until_closed(base, wait_s=3.0)
    async with start(keepalive_s=30.0) as base:
        assert not await _idle_until_closed(base, wait_s=1.0)


async def test_serve_needs_an_address() -> None:
    with pytest.raises(ValueError, match="addresses"):
        await serve([], SimOptions())


def test_run_stops_cleanly_on_sigterm() -> None:
    port = free_port(HOST)
    code = (
        f"from extproc.sim.server import SimOptions, run\nrun([({HOST!r}, {port})], SimOptions())\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:

        def accepting() -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            return tcp_open(HOST, port)

        wait_until(accepting, 20, "the simulator to accept a connection")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    assert f"{HOST}:{port}".encode() in output
    assert b"sim.listening" in output


# --- timing "model": the engine model of extproc/sim/engine.py ---

PROMPT_8K_TOKENS = 8000


async def streamed_ttft(session: aiohttp.ClientSession, base: str, prompt: str) -> float:
    """Seconds from sending a streamed completion to reading its first token."""
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    began = time.monotonic()
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        ttft = time.monotonic() - began
        await resp.read()
    return ttft


@pytest.mark.parametrize("time_scale", [1.0, 0.25])
async def test_model_timing_streams_first_token_at_the_modelled_ttft(
    start: Start, session: aiohttp.ClientSession, time_scale: float
) -> None:
    options = SimOptions(timing="model", time_scale=time_scale)
    config = options.engine_config()
    overhead_ms = config.request_overhead_ms + config.step_overhead_ms
    uncached_s = (overhead_ms + config.prefill_ms_per_token * PROMPT_8K_TOKENS) / 1000
    # Cached: one forward pass for the recomputed last block, at the decode floor.
    cached_s = (overhead_ms + config.decode_ms_per_token) / 1000
    prompt = "q" * (PROMPT_8K_TOKENS * 4)
    # Loopback HTTP and a busy test machine add latency; they never remove it. So every
    # sample is at least the model's time, and the fastest of a few is close to it (one
    # sample alone once took 0.74 s for 0.27 on a loaded CI machine).
    slack_s = 0.06
    rounds = 3
    firsts, seconds = [], []
    async with start(timing="model", time_scale=time_scale) as base:
        for _ in range(rounds):
            async with session.post(f"{base}/reset_prefix_cache") as resp:
                assert resp.status == 200
            firsts.append(await streamed_ttft(session, base, prompt))
            seconds.append(await streamed_ttft(session, base, prompt))
        assert await metric(session, base, "vllm:time_to_first_token_seconds_count") == 2 * rounds
        assert await metric(session, base, "vllm:prefix_cache_hits_total") == rounds * (8000 - 16)
    for modelled, samples in ((uncached_s, firsts), (cached_s, seconds)):
        assert min(samples) >= modelled * time_scale * 0.98, samples
        assert min(samples) <= modelled * time_scale + slack_s, samples


@pytest.mark.parametrize("timing", ["fixed", "model"])
async def test_reset_prefix_cache_zeroes_later_hits(
    start: Start, session: aiohttp.ClientSession, timing: str
) -> None:
    body = {"prompt": "r" * (3 * BLOCK_CHARS + 5), "max_tokens": 1}

    async def cached_tokens(base: str) -> int:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with start(timing=timing, time_scale=0.01) as base:
        assert await cached_tokens(base) == 0
        assert await cached_tokens(base) == 48
        async with session.post(f"{base}/reset_prefix_cache") as resp:
            assert resp.status == 200
        hits = await metric(session, base, "vllm:prefix_cache_hits_total")
        assert await cached_tokens(base) == 0
        assert await metric(session, base, "vllm:prefix_cache_hits_total") == hits == 48


async def test_model_timing_queues_beyond_max_num_seqs_and_aborts_free_the_slot(
    start: Start, session: aiohttp.ClientSession
) -> None:
    async with start(timing="model", max_num_seqs=1, time_scale=0.1) as base:

        async def long_stream(letter: str) -> None:
            body = {"prompt": letter * 640, "max_tokens": 4000, "stream": True}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()

        first = asyncio.create_task(long_stream("a"))
        await wait_for_metric(session, base, "vllm:num_requests_running", 1)
        assert await metric(session, base, "vllm:kv_cache_usage_perc") > 0
        second = asyncio.create_task(long_stream("b"))
        await wait_for_metric(session, base, "vllm:num_requests_waiting", 1)

        first.cancel()  # the client goes away: its slot and blocks go to the next
        await wait_for_metric(session, base, "vllm:num_requests_waiting", 0)
        assert await metric(session, base, "vllm:num_requests_running") == 1
        second.cancel()
        await wait_for_metric(session, base, "vllm:num_requests_running", 0)
        assert await metric(session, base, "vllm:kv_cache_usage_perc") == 0
        assert await metric(session, base, "vllm:request_success_total") == 0
        for task in (first, second):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_model_timing_whole_response_and_counters(
    start: Start, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "w" * (4 * BLOCK_CHARS), "max_tokens": 3}  # exactly four blocks
    async with start(timing="model", time_scale=0.01) as base:
        cached = []
        for _ in range(3):
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                whole = await resp.json()
            assert len(whole["choices"][0]["text"].split()) == 3
            cached.append(whole["usage"]["prompt_tokens_details"]["cached_tokens"])
        # vLLM computes a prompt's last token, so a fully cached prompt hits all but
        # its last block.
        assert cached == [0, 48, 48]
        assert await metric(session, base, "vllm:prefix_cache_hits_total") == 96
        assert await metric(session, base, "vllm:prefix_cache_queries_total") == 3 * 64
        assert await metric(session, base, "vllm:prompt_tokens_total") == 3 * 64
        assert await metric(session, base, "vllm:generation_tokens_total") == 9
        assert await metric(session, base, "vllm:request_success_total") == 3
        assert await metric(session, base, "vllm:num_requests_running") == 0
        assert await metric(session, base, "vllm:kv_cache_usage_perc") == 0


async def test_model_timing_refuses_a_request_beyond_the_kv_cache(
    start: Start, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "x" * 400, "max_tokens": 100}
    async with start(timing="model", capacity_blocks=8) as base:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 400
            assert "KV blocks" in (await resp.json())["error"]["message"]
        assert await metric(session, base, "vllm:prefix_cache_queries_total") == 0


def test_capacity_default_follows_the_timing() -> None:
    assert SimOptions().capacity_blocks == 4096
    assert SimOptions(timing="model").capacity_blocks == 10_000
    assert SimOptions(timing="model", capacity_blocks=7).capacity_blocks == 7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"timing": "magic"}, "timing"),
        ({"timing": "model", "ttft_ms": 5.0}, "ttft_ms"),
        ({"time_scale": -0.5}, "time_scale"),
        ({"prefill_ms_per_token": float("inf")}, "prefill_ms_per_token"),
        ({"max_batched_tokens": 0}, "max_batched_tokens"),
        ({"max_num_seqs": 1.5}, "max_num_seqs"),
    ],
)
def test_model_options_reject_bad_values_by_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimOptions(**overrides)


@pytest.mark.parametrize("timing", ["fixed", "model"])
async def test_time_scale_can_change_at_run_time(
    start: Start, session: aiohttp.ClientSession, timing: str
) -> None:
    prompt = "z" * (PROMPT_8K_TOKENS * 4)
    delays = {"ttft_ms": 300.0} if timing == "fixed" else {}
    async with start(timing=timing, time_scale=1.0, **delays) as base:
        async with session.post(f"{base}/sim/time_scale", json={"time_scale": 0}) as resp:
            assert resp.status == 200 and (await resp.json()) == {"time_scale": 0}
        assert await streamed_ttft(session, base, prompt) < 0.1  # modelled ~0.27 s at scale 1
        for bad in ({"time_scale": -1}, {"scale": 1}, {"time_scale": "x"}):
            async with session.post(f"{base}/sim/time_scale", json=bad) as resp:
                assert resp.status == 400
        async with session.post(f"{base}/sim/time_scale", json={"time_scale": 1.0}) as resp:
            assert resp.status == 200
        assert await streamed_ttft(session, base, prompt + "y" * 64) >= 0.058


@pytest.mark.parametrize("timing", ["fixed", "model"])
async def test_the_next_turn_hits_the_reply_the_instance_generated(
    start: Start, session: aiohttp.ClientSession, timing: str
) -> None:
    from extproc.sim.responses import reply_text

    overrides = {"timing": timing, "time_scale": 0.0} if timing == "model" else {}
    first = [{"role": "user", "content": "q" * (2 * BLOCK_CHARS)}]
    async with start(**overrides) as base:
        async with session.post(
            f"{base}/v1/chat/completions",
            json={**chat_body(""), "messages": first, "max_tokens": 64},
        ) as resp:
            reply = (await resp.json())["choices"][0]["message"]["content"]
        assert reply == reply_text(64)  # 64 tokens of 4 characters: 4 blocks
        hits_before = await metric(session, base, "vllm:prefix_cache_hits_total")
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "?"}]
        async with session.post(
            f"{base}/v1/chat/completions", json={**chat_body(""), "messages": second}
        ) as resp:
            assert resp.status == 200
            await resp.read()
        hits = await metric(session, base, "vllm:prefix_cache_hits_total") - hits_before
        # The first prompt's blocks and the reply's full blocks (all but the last token's).
        from extproc.sim.prompt import prompt_text

        prompt = prompt_text("chat", {"messages": first})
        expected_blocks = (len(prompt) + len(reply) - 4) // BLOCK_CHARS
        assert hits == expected_blocks * 16
        assert expected_blocks * BLOCK_CHARS > len(prompt) + BLOCK_CHARS  # reply blocks count


async def test_cache_config_info_states_the_kv_cache_size(
    start: Start, session: aiohttp.ClientSession
) -> None:
    from extproc.control.loadfeed import parse_vllm_metrics

    async with (
        start(capacity_blocks=321, block_size_tokens=32) as base,
        session.get(f"{base}/metrics") as response,
    ):
        text = await response.text()
    ((labels, value),) = [
        (dict(pairs), value)
        for (name, pairs), value in prometheus.parse(text).items()
        if name == "vllm:cache_config_info"
    ]
    assert value == 1
    assert (labels["num_gpu_blocks"], labels["block_size"]) == ("321", "32")
    assert parse_vllm_metrics(text, 0.0).cache_capacity_tokens == 321 * 32
