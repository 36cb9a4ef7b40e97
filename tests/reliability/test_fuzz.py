"""Fuzzing the key extractor, the phase machine and the ext_proc servicer, in process.

100,000 generated cases in all, split over four tests (30,000 + 30,000 + 25,000 + 15,000);
each test counts the examples it ran and asserts the count (a regression property at the
end adds 3,000 more). Hypothesis draws only a seed and a few small choices; the hostile
body is built from them (``hostile_body``), which keeps the per-example cost low and keeps
huge inputs out of Hypothesis's own buffers.
``derandomize=True`` makes every run test the same cases, so CI is reproducible; a
failure prints its seed.

Properties: nothing raises out, every message is answered well inside Envoy's
``message_timeout`` (in half of it), every message gets an answer of its own kind, and
every request gets either a routing decision over the published hosts or an aborted stream
(no hosts, a bug), which Envoy's failure mode then decides.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.adapter import messages, metrics
from extproc.adapter.messages import ProcessingRequest, ProcessingResponse
from extproc.adapter.phases import Phase, RequestStream
from extproc.adapter.routing import Router
from extproc.adapter.service import ExternalProcessor
from extproc.config import RouterConfig
from extproc.errors import StreamAborted
from extproc.picker.hosts import HostSet
from extproc.picker.keys import MAX_SALT_LENGTH, KeyMode, KeySource, extract_key
from extproc.stack.bootstrap import BootstrapParams

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")
# How long Envoy waits for each answer (the ext_proc filter's message_timeout, as the
# stack configures it); a request not answered by then loses its routing.
MESSAGE_TIMEOUT_S = BootstrapParams().message_timeout_ms / 1000
# Each answer must come well inside it: in half of it. One call may parse up to 1 MiB;
# the slowest of these 100k answers took 9 ms on a 2-core machine with two busy processes
# competing (garbage collection kept out, see collector_paused).
CALL_BOUND_S = MESSAGE_TIMEOUT_S / 2


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


@contextmanager
def collector_paused() -> Iterator[None]:
    """Keeps this process's garbage collector out of a timed call. A full collection here
    walks the heap Hypothesis builds over thousands of examples (measured: up to 0.8 s),
    a cost of the test, not of the router's answer; it runs after the call instead."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Protocol errors log a warning each; 100k of them would only cost time."""

    def drop(*_: Any) -> Any:
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(processors=[drop])
    try:
        yield
    finally:
        structlog.configure(**old)


# ---------------------------------------------------------------- hostile inputs

_HUGE = "x" * 1_300_000  # sliced, never rebuilt: up to just past the 1 MiB parse limit
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's magic number; the rest is noise
KINDS = (
    "chat",
    "truncated",
    "deep",
    "huge",
    "nul",
    "invalid_utf8",
    "gzip",
    "zstd",
    "empty",
    "wrong_shape",
    "surrogates",
    "random",
    "completions",
    "salt",
)


def _chat(rng: random.Random, text: str) -> dict[str, Any]:
    content: Any = text
    if rng.random() < 0.3:
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": "x"}]
    return {
        "model": rng.choice(["sim-model", "lora-a", "", 7, None]),
        "messages": [{"role": rng.choice(["system", "user", 3]), "content": content}],
    }


def hostile_body(
    kind: str, seed: int, size: int, huge: int = len(_HUGE)
) -> tuple[bytes, dict[str, str]]:
    """A request body of one hostile ``kind`` (strings of up to ``huge`` characters) and
    the headers that go with it."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c\n\u00e9\u4e2d") for _ in range(size % 200))
    headers = {"content-type": rng.choice(["application/json", "text/plain", "", "x/\x00"])}
    if kind == "chat":
        body = json.dumps(_chat(rng, text)).encode()
    elif kind == "truncated":
        whole = json.dumps(_chat(rng, text * 3)).encode()
        body = whole[: rng.randrange(len(whole) + 1)]
    elif kind == "deep":
        depth = 10 + (size * 97) % 30_000
        opener = rng.choice(["[", '{"a":', '{"messages":[', '{"prompt":['])
        body = (opener * depth).encode() + (b"]" * rng.randrange(depth + 1))
    elif kind == "huge":
        length = (size * 7919) % huge
        if rng.random() < 0.5:
            body = json.dumps(_chat(rng, _HUGE[:length])).encode()
        else:
            body = b'{"messages":[{"role":"user","content":"' + _HUGE[:length].encode()
    elif kind == "nul":
        body = json.dumps(_chat(rng, text + "\x00" * (size % 9))).encode()
        cut = rng.randrange(len(body) + 1)
        body = body[:cut] + b"\x00" * (size % 5) + body[cut:]
    elif kind == "invalid_utf8":
        body = json.dumps(_chat(rng, text)).encode()
        cut = rng.randrange(len(body) + 1)
        body = (
            body[:cut]
            + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88"])
            + body[cut:]
        )
    elif kind == "gzip":
        body = gzip.compress(json.dumps(_chat(rng, text)).encode())
        headers["content-encoding"] = rng.choice(["gzip", "GZIP ", "identity", ""])
    elif kind == "zstd":
        body = ZSTD_MAGIC + rng.randbytes(size % 300)
        headers["content-encoding"] = rng.choice(["zstd", "zstd, gzip", "identity"])
    elif kind == "empty":
        body = b""
    elif kind == "wrong_shape":
        body = json.dumps(
            rng.choice(
                [
                    {"messages": "not a list"},
                    {"messages": [1, None, [], {"role": {}, "content": {"text": 1}}]},
                    {"messages": [{"content": [{"type": "text", "text": 5}, "x", None]}]},
                    {"prompt": {"a": 1}},
                    {"prompt": [1, [2, [3]], None, "s"]},
                    [text],
                    text,
                    None,
                    1e308,
                ]
            )
        ).encode()
    elif kind == "surrogates":
        body = b'{"messages":[{"role":"user","content":"\\ud800' + text.encode() + b'\\udfff"}]}'
    elif kind == "completions":
        prompt: Any = text if rng.random() < 0.5 else list(range(size))
        body = json.dumps({"model": "sim-model", "prompt": prompt}).encode()
    elif kind == "salt":
        salt = rng.choice(["t" * (MAX_SALT_LENGTH + 1), "", "\x00", "ok-tenant", "\u00e9", 5])
        body = json.dumps({**_chat(rng, text), "prompt_cache_key": salt}).encode()
        headers[rng.choice(["x-prefix-aware-id", "x-amzn-sagemaker-prefix-aware-id"])] = (
            str(salt)[:80].encode("utf-8").decode("latin-1")
        )
    else:  # random
        body = rng.randbytes(size % 400)
    return body, headers


# ---------------------------------------------------------------- the key extractor


def check_key(body: bytes, headers: dict[str, str], mode: KeyMode, prefix_length: int) -> None:
    with collector_paused():
        started = time.perf_counter()
        key = extract_key(body, headers, mode, prefix_length)
        elapsed = time.perf_counter() - started
    assert elapsed < CALL_BOUND_S, elapsed
    assert isinstance(key.key, bytes)
    assert key.salt is None or (0 < len(key.salt) <= MAX_SALT_LENGTH and key.salt.isascii())
    if key.source is KeySource.OPENAI:
        assert len(key.key) <= 4 * prefix_length  # prefix_length characters of UTF-8
    else:
        assert key.key == body[:prefix_length]
    if mode is KeyMode.NATIVE:
        assert key.source is KeySource.NATIVE
    encoding = headers.get("content-encoding", "").strip().lower()
    if mode is KeyMode.OPENAI and encoding not in ("", "identity"):
        assert key.source is KeySource.ENCODED_FALLBACK  # never inflated


def test_key_extractor_on_arbitrary_bytes():
    """30,000 cases: any bytes at all, any mode, any prefix length, any encoding."""
    calls = 0

    @fuzz_settings(30_000)
    @given(
        body=st.binary(max_size=256),
        mode=st.sampled_from(list(KeyMode)),
        prefix_length=st.sampled_from([1, 16, 1024, 8192]),
        encoding=st.sampled_from([None, "gzip", "zstd", "identity", " Identity ", "br"]),
    )
    def run(body: bytes, mode: KeyMode, prefix_length: int, encoding: str | None) -> None:
        nonlocal calls
        calls += 1
        headers = {} if encoding is None else {"content-encoding": encoding}
        check_key(body, headers, mode, prefix_length)

    run()
    assert calls == 30_000


def test_key_extractor_on_hostile_bodies():
    """30,000 cases: truncated and deeply nested JSON, bodies of up to 1.3 MB, NUL bytes,
    invalid UTF-8, lone surrogates, gzip and zstd bodies, wrong shapes, bad salts."""
    calls = 0

    @fuzz_settings(30_000)
    @given(
        kind=st.sampled_from(KINDS),
        seed=st.integers(0, 2**32 - 1),
        size=st.integers(0, 2000),
        mode=st.sampled_from(list(KeyMode)),
        prefix_length=st.sampled_from([1024, 8192, 65536]),
    )
    def run(kind: str, seed: int, size: int, mode: KeyMode, prefix_length: int) -> None:
        nonlocal calls
        calls += 1
        body, headers = hostile_body(kind, seed, size)
        check_key(body, headers, mode, prefix_length)

    run()
    assert calls == 30_000


# ---------------------------------------------------------------- the phase machine

MESSAGE_KINDS = (
    "headers",
    "headers_eos",
    "body",
    "body_more",
    "trailers",
    "response_headers",
    "response_body",
    "response_trailers",
    "empty",
)


def build_message(kind: str, body: bytes, headers: dict[str, str]) -> ProcessingRequest:
    if kind in ("headers", "headers_eos"):
        return request_headers({":method": "POST", **headers}, kind == "headers_eos")
    if kind in ("body", "body_more"):
        return request_body(body, kind == "body")
    request = ProcessingRequest()
    if kind == "trailers":
        request.request_trailers.SetInParent()
    elif kind == "response_headers":
        request.response_headers.SetInParent()
    elif kind == "response_body":
        request.response_body.body = body[:64]
    elif kind == "response_trailers":
        request.response_trailers.SetInParent()
    return request  # "empty": no oneof set


def sequence_strategy(max_size: int) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(MESSAGE_KINDS), max_size=max_size)


def routes(sequence: list[str]) -> bool:
    """Whether the phase machine must decide on this sequence: the first request headers
    ended the stream, or a body came before any decision."""
    phase = Phase.AWAITING_HEADERS
    for kind in sequence:
        if kind in ("headers", "headers_eos") and phase is Phase.AWAITING_HEADERS:
            if kind == "headers_eos":
                return True
            phase = Phase.AWAITING_BODY
        elif kind in ("body", "body_more"):
            return True  # a body before headers is still routed
    return False


def check_answers(
    sequence: list[str],
    requests: list[ProcessingRequest],
    responses: list[ProcessingResponse],
    published: frozenset[str],
    aborted: bool = False,
) -> None:
    """One answer per non-empty message, of its kind; exactly one decision, or an aborted
    stream (no hosts, a bug: Envoy's failure mode decides), when a message could carry
    one, over the published hosts only. An aborted stream answers nothing more."""
    expected = [r for r in requests if r.WhichOneof("request") is not None]
    if aborted:
        assert len(responses) < len(expected), (sequence, responses)
        expected = expected[: len(responses)]
    assert len(responses) == len(expected), (sequence, responses)
    routed = 1 if aborted else 0
    for request, response in zip(expected, responses, strict=True):
        kind = response.WhichOneof("response")
        assert kind == request.WhichOneof("request"), (sequence, kind)
        if response.dynamic_metadata.fields:
            value = response.dynamic_metadata.fields[messages.LB_METADATA_NAMESPACE]
            targets = value.struct_value.fields[messages.LB_METADATA_KEY].string_value
            assert set(targets.split(",")) <= published
            routed += 1
    assert routed == (1 if routes(sequence) else 0), (sequence, responses)


def make_router(empty: bool) -> Router:
    if empty:  # a control-plane router before its first host set
        return Router(RouterConfig(control_plane="127.0.0.1:18000"), random.Random(3))
    return Router(RouterConfig(hosts=HOSTS, prefix_length=1024), random.Random(3))


def test_phase_machine_on_malformed_sequences():
    """25,000 cases: any sequence of up to 8 ext_proc messages (body before headers,
    duplicate phases, trailers or response phases first, empty messages, an empty stream)
    with hostile bodies, against a router with hosts and one with none."""
    calls = 0
    routers = {False: make_router(False), True: make_router(True)}

    @fuzz_settings(25_000)
    @given(
        sequence=sequence_strategy(8),
        kind=st.sampled_from(KINDS),
        seed=st.integers(0, 2**32 - 1),
        size=st.integers(0, 300),
        empty=st.booleans(),
    )
    def run(sequence: list[str], kind: str, seed: int, size: int, empty: bool) -> None:
        nonlocal calls
        calls += 1
        router = routers[empty]
        body, headers = hostile_body(kind, seed, size, huge=70_000)
        requests = [build_message(k, body, headers) for k in sequence]
        stream = RequestStream(router)
        responses = []
        aborted = False
        for message in requests:
            with collector_paused():
                started = time.perf_counter()
                try:
                    answers = stream.on_message(message)
                except StreamAborted as error:
                    assert empty and error.reason == "prefix_router_no_hosts"
                    aborted = True  # the servicer ends the stream here
                    answers = ()
                elapsed = time.perf_counter() - started
            assert elapsed < CALL_BOUND_S, (sequence, kind, seed, elapsed)
            responses.extend(answers)
            if aborted:
                break
        published = frozenset() if empty else HostSet.of(HOSTS).addresses
        check_answers(sequence, requests, responses, published, aborted)
        stream.close()
        assert stream.phase is Phase.CLOSED
        assert router.ledger.in_flight.total() == 0  # every slot released

    run()
    assert calls == 25_000


# ---------------------------------------------------------------- the servicer


async def _messages(
    requests: list[ProcessingRequest], sent: list[float]
) -> AsyncIterator[ProcessingRequest]:
    """The requests as gRPC hands them over, noting when each was handed over."""
    for request in requests:
        sent.append(time.perf_counter())
        yield request
        await asyncio.sleep(0)  # a turn of the loop between messages, as over a network


class _Aborted(Exception):
    """What grpc.aio's ``context.abort`` raises, to end the handler."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class _Context:
    """What the servicer asks of gRPC's context: ``read`` (the requests, then EOF once the
    client half-closed) and ``abort``."""

    def __init__(self, requests: AsyncIterator[ProcessingRequest]) -> None:
        self._requests = requests

    async def read(self) -> Any:
        return await anext(self._requests, grpc.aio.EOF)

    async def abort(self, code: Any, details: str = "") -> None:
        raise _Aborted(code, details)


class _Exploding(Router):
    """A router whose decision raises an unexpected error: it must cost one aborted
    stream, which Envoy's failure mode then decides."""

    def place(self, headers, body, within=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")


def test_servicer_streams_in_process():
    """15,000 cases: ExternalProcessor.process driven as gRPC would drive it, with no
    network: any message sequence, hostile bodies, no hosts, and a router that raises.
    Each answer must come within CALL_BOUND_S of its message, and each stream must end,
    release its slot and close its gauge."""
    calls = 0
    loop = asyncio.new_event_loop()
    processors = {
        # No wait for a reset after the half-close: these streams have no peer to send one.
        "hosts": ExternalProcessor(make_router(False), reset_wait_s=0),
        "empty": ExternalProcessor(make_router(True), reset_wait_s=0),
        "explodes": ExternalProcessor(_Exploding(RouterConfig(hosts=HOSTS)), reset_wait_s=0),
    }
    open_streams = metrics.STREAMS._value.get()

    async def drive(
        processor: ExternalProcessor, requests: list[ProcessingRequest]
    ) -> tuple[list[ProcessingResponse], float, _Aborted | None]:
        """The answers, the longest any took after the message it answers, and how the
        stream was aborted, if it was."""
        sent: list[float] = []
        responses, slowest = [], 0.0
        try:
            stream = _messages(requests, sent)
            async for response in processor.process(stream, _Context(stream)):  # type: ignore[arg-type]
                slowest = max(slowest, time.perf_counter() - sent[-1])
                responses.append(response)
        except _Aborted as aborted:
            slowest = max(slowest, time.perf_counter() - sent[-1])
            return responses, slowest, aborted
        return responses, slowest, None

    @fuzz_settings(15_000)
    @given(
        sequence=sequence_strategy(6),
        kind=st.sampled_from(KINDS),
        seed=st.integers(0, 2**32 - 1),
        size=st.integers(0, 300),
        which=st.sampled_from(sorted(processors)),
    )
    def run(sequence: list[str], kind: str, seed: int, size: int, which: str) -> None:
        nonlocal calls
        calls += 1
        body, headers = hostile_body(kind, seed, size, huge=70_000)
        requests = [build_message(k, body, headers) for k in sequence]
        processor = processors[which]
        with collector_paused():  # the wait_for only turns a hang into a failure
            responses, slowest, aborted = loop.run_until_complete(
                asyncio.wait_for(drive(processor, requests), 5)
            )
        assert slowest < CALL_BOUND_S, (sequence, kind, seed, slowest)
        published = HostSet.of(HOSTS).addresses if which == "hosts" else frozenset()
        check_answers(sequence, requests, responses, published, aborted is not None)
        if aborted is not None:
            expected = {
                "empty": (grpc.StatusCode.UNAVAILABLE, "prefix_router_no_hosts"),
                "explodes": (grpc.StatusCode.INTERNAL, "prefix_router_internal_error"),
            }
            assert (aborted.code, aborted.details) == expected[which], (which, aborted)
        assert processor.router.ledger.in_flight.total() == 0
        assert metrics.STREAMS._value.get() == open_streams

    try:
        run()
    finally:
        loop.close()
    assert calls == 15_000


# ---------------------------------------------------------------- regression: wide bodies


def _wide_bodies(rng: random.Random) -> dict[str, Any]:
    def item() -> Any:
        return rng.choice(["", "a", "\u00e9\u4e2d", "xyz" * rng.randrange(5), 7, [1, [2]], None])

    if rng.random() < 0.5:
        return {"prompt": [item() for _ in range(rng.randrange(40))]}
    return {
        "messages": [
            {
                "role": rng.choice(["user", "system", 1]),
                "content": rng.choice(
                    [item(), [{"type": "text", "text": item()} for _ in range(rng.randrange(6))]]
                ),
            }
            for _ in range(rng.randrange(20))
        ]
    }


@settings(max_examples=3000, deadline=None, database=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), limit=st.integers(0, 80))
def test_prompt_text_stopped_at_the_limit_keeps_the_key(seed: int, limit: int):
    """3,000 cases: stopping early at ``limit`` characters never changes the key, which is
    the text's first ``prefix_length`` characters."""
    from extproc.picker.keys import openai_prompt_text

    body = _wide_bodies(random.Random(seed))
    whole = openai_prompt_text(body)
    cut = openai_prompt_text(body, limit)
    assert whole is not None and cut is not None
    assert cut[:limit] == whole[:limit]


def test_a_body_of_many_tiny_items_costs_what_its_key_needs():
    """Regression: 200k one-element prompt items (1 MB) were all repr'd and joined for a
    key of 1,024 characters (~100 ms of router CPU per request, on top of parsing)."""
    from extproc.picker.keys import openai_prompt_text

    wide = {"prompt": [[1]] * 200_000, "messages": None}
    started = time.perf_counter()
    text = openai_prompt_text(wide, 1024)
    assert text is not None and 1024 <= len(text) < 1100
    messages = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 10**5}]}
    text = openai_prompt_text(messages, 1024)
    assert text is not None and len(text) < 1100
    assert time.perf_counter() - started < 0.05
