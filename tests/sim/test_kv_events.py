"""The simulator's KV-cache events: what its cache reports, and what its server publishes.

Cache-level tests use the `EventRecorder` with no socket. Server tests start a real
simulator on loopback and read its stream as a consumer does: a SUB socket for the live
batches and the replay socket for any the SUB missed (a SUB that joins late misses the
first ones). Whatever one request publishes is buffered for replay before its response is
sent, so ``assert_no_more`` (an empty replay) is exact, never a wait.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.events.publisher import END_SEQ
from extproc.events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    decode_batch,
)
from extproc.sim import server as sim_server
from extproc.sim.cache import PrefixCache
from extproc.sim.engine import Engine, EngineConfig
from extproc.sim.events import TOPIC, EventRecorder, token_ids
from extproc.sim.options import SimOptions
from extproc.sim.responses import reply_text
from extproc.sim.server import serve
from extproc.stack.processes import free_ports_on, port_is_free

HOST = "127.0.0.1"
BLOCK_CHARS = 64  # the default 16 tokens x 4 chars
CLIENT_TIMEOUT = httpx.Timeout(30)
VLLM_SOURCE_KEYS = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
]


def new_client() -> httpx.AsyncClient:
    # trust_env=False: requests go straight to the simulator, whatever proxy the
    # environment names.
    return httpx.AsyncClient(timeout=CLIENT_TIMEOUT, trust_env=False)


def json_of(response: httpx.Response) -> Any:
    """The response's JSON body; its Content-Type must say it is JSON."""
    mimetype = response.headers["content-type"].partition(";")[0].strip().lower()
    assert mimetype == "application/json", response.headers["content-type"]
    return response.json()


def chatml(content: str) -> str:
    """The prompt the simulator renders for one user message (ChatML)."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def text_of(event: BlockStored) -> str:
    return "".join(map(chr, event.token_ids))


def stored(events: Iterable[KvEvent]) -> list[BlockStored]:
    return [event for event in events if isinstance(event, BlockStored)]


# ----------------------------------------------------------------- the cache, no sockets


def recorded_cache(capacity: int = 64, **sizes: int) -> tuple[PrefixCache, EventRecorder]:
    block_tokens = sizes.get("block_size_tokens", 16)
    chars = sizes.get("chars_per_token", 4)
    recorder = EventRecorder(block_tokens * chars)
    return PrefixCache(capacity, block_tokens, chars, listener=recorder), recorder


def test_token_ids_are_code_points_even_beyond_ascii() -> None:
    text = "aé😀\ud800z"  # a lone surrogate can come from JSON
    assert token_ids(text) == [ord(c) for c in text]


def test_new_blocks_are_stored_once_as_one_chain_run() -> None:
    cache, recorder = recorded_cache()
    text = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS + "c" * BLOCK_CHARS + "tail"
    cache.lookup_and_insert(text)
    [event] = recorder.take()
    hashes: list[BlockHash] = [*cache.block_hashes(text)]
    assert event == BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[ord(c) for c in text[: 3 * BLOCK_CHARS]],
        block_size=BLOCK_CHARS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None, None, None],  # vLLM sends one entry per block, even all None
        group_idx=0,
    )
    # Cached already: a hit stores nothing.
    cache.lookup_and_insert(text)
    assert recorder.take() == []
    # A longer prompt stores only its new blocks, chained to the last cached one.
    longer = text[: 3 * BLOCK_CHARS] + "d" * BLOCK_CHARS
    cache.lookup_and_insert(longer)
    [event] = recorder.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == cache.block_hashes(longer)[3:]
    assert event.parent_block_hash == cache.block_hashes(text)[2]
    assert text_of(event) == "d" * BLOCK_CHARS


def test_eviction_removes_exactly_the_evicted_blocks_one_event_each() -> None:
    cache, recorder = recorded_cache(capacity=4)
    first = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS + "c" * BLOCK_CHARS
    second = "x" * BLOCK_CHARS + "y" * BLOCK_CHARS + "z" * BLOCK_CHARS
    cache.lookup_and_insert(first)
    recorder.take()
    cache.lookup_and_insert(second)
    events = recorder.take()
    a, b, c = cache.block_hashes(first)
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, BlockRemoved]
    # The deepest blocks go first, so the chain's head survives.
    assert events[1:] == [
        BlockRemoved(block_hashes=[c], medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=[b], medium="GPU", group_idx=0),
    ]
    assert a in cache and b not in cache and c not in cache


def test_reset_clears_all_or_removes_the_unheld_blocks() -> None:
    cache, recorder = recorded_cache()
    text = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS
    cache.lookup_and_insert(text)
    recorder.take()
    cache.clear_unreferenced()
    # vLLM's reset succeeds only with nothing held, and then sends AllBlocksCleared.
    assert recorder.take() == [AllBlocksCleared()]
    cache.clear_unreferenced()
    assert recorder.take() == [AllBlocksCleared()]  # an empty cache too, as vLLM

    held = cache.block_hashes("h" * BLOCK_CHARS)
    cache.lookup_and_insert(text)
    assert cache.acquire(held, private_blocks=1, text="h" * BLOCK_CHARS)
    recorder.take()
    cache.clear_unreferenced()
    # vLLM would refuse; the simulator drops what no request holds and says which.
    assert recorder.take() == [
        BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
        for h in cache.block_hashes(text)[::-1]
    ]
    assert held[0] in cache


def test_salt_enters_the_first_block_and_its_extra_keys() -> None:
    cache, recorder = recorded_cache()
    text = "a" * BLOCK_CHARS * 2
    plain = cache.block_hashes(text)
    salted = cache.block_hashes(text, "tenant-1")
    assert plain[0] != salted[0] != cache.block_hashes(text, "tenant-2")[0]
    assert cache.block_hashes(text, "") == plain  # an empty salt is none, as in vLLM

    cache.lookup_and_insert(text, "tenant-1")
    [event] = recorder.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == salted
    assert event.extra_keys == [("tenant-1",), None]
    # Unsalted, the same text is another chain: stored again, no extra keys.
    cache.lookup_and_insert(text)
    [event] = recorder.take()
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, event.extra_keys) == (plain, [None, None])
    # A salted chain's later run names its parent, not the salt.
    cache.lookup_and_insert(text + "b" * BLOCK_CHARS, "tenant-1")
    [event] = recorder.take()
    assert isinstance(event, BlockStored)
    assert (event.parent_block_hash, event.extra_keys) == (salted[-1], [None])


def test_no_listener_changes_nothing() -> None:
    text = "abcd" * 100
    with_listener, _ = recorded_cache(capacity=3)
    without = PrefixCache(3)
    for cache in (with_listener, without):
        cache.lookup_and_insert(text)
        cache.insert_output(text, "reply " * 40)
    assert [h in with_listener for h in with_listener.block_hashes(text)] == [
        h in without for h in without.block_hashes(text)
    ]


class Mirror:
    """A consumer's copy of a cache, built from its events alone. Checks every event: a
    stored block is new and its parent known, its tokens (with the parent's text and the
    chain's salt) hash to the block's hash, a removed block was there."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.texts: dict[BlockHash, str] = {}  # block hash -> its chain's text to its end
        self.salts: dict[BlockHash, str | None] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.texts.clear()
            elif isinstance(event, BlockRemoved):
                [block_hash] = event.block_hashes
                del self.texts[block_hash]
            else:
                self._store(event)

    def _store(self, event: BlockStored) -> None:
        count, size = len(event.block_hashes), event.block_size
        assert size == self.cache.block_chars
        assert len(event.token_ids) == count * size
        assert event.extra_keys is not None and len(event.extra_keys) == count
        if event.parent_block_hash is None:
            first = event.extra_keys[0]
            prefix, salt = "", first[0] if first else None
        else:
            assert all(keys is None for keys in event.extra_keys)
            prefix = self.texts[event.parent_block_hash]
            salt = self.salts[event.parent_block_hash]
        text = prefix + text_of(event)
        assert self.cache.block_hashes(text, salt)[-count:] == event.block_hashes
        for index, block_hash in enumerate(event.block_hashes):
            assert block_hash not in self.texts, "a cached block stored again"
            self.texts[block_hash] = text[: len(prefix) + (index + 1) * size]
            self.salts[block_hash] = salt

    def check(self, seen: set[int]) -> None:
        assert set(self.texts) == {h for h in seen if h in self.cache}


SALTS = st.sampled_from([None, None, "s1", "s2"])
PROMPTS = st.text(alphabet="ab", max_size=24)
engine_ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), PROMPTS, st.integers(1, 6), SALTS),
        st.tuples(st.just("abort"), st.just(""), st.integers(0, 50), st.none()),
        st.tuples(st.just("step"), st.just(""), st.just(0), st.none()),
        st.tuples(st.just("reset"), st.just(""), st.just(0), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(min_value=7, max_value=30), ops=engine_ops)
def test_events_replay_to_the_engine_models_cache(capacity: int, ops: list[Any]) -> None:
    """Whatever the engine model does (admissions, outputs, aborts, evictions, resets with
    blocks held), its events rebuild exactly the set of blocks its cache holds."""
    recorder = EventRecorder(4)
    cache = PrefixCache(capacity, block_size_tokens=4, chars_per_token=1, listener=recorder)
    engine = Engine(EngineConfig(request_overhead_ms=0, max_batched_tokens=12), cache)
    mirror, seen, requests, now = Mirror(cache), set[int](), [], 0.0
    for kind, prompt, number, salt in ops:
        if kind == "submit":
            output = reply_text(number, 1)
            with contextlib.suppress(ValueError):  # never fits
                request = engine.submit(prompt, number, now, output, salt)
                requests.append(request)
                seen.update(request.block_hashes, request.output_hashes)
        elif kind == "abort" and requests:
            engine.abort(requests[number % len(requests)])
        elif kind == "step" and (batch := engine.schedule(now)) is not None:
            now = batch.ends_at
            engine.complete(batch)
        elif kind == "reset":
            cache.clear_unreferenced()
        mirror.apply(recorder.take())
        mirror.check(seen)


fixed_ops = st.lists(
    st.tuples(st.sampled_from(["request", "request", "reset"]), PROMPTS, st.integers(1, 6), SALTS),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=20), ops=fixed_ops)
def test_events_replay_to_the_fixed_timing_cache(capacity: int, ops: list[Any]) -> None:
    recorder = EventRecorder(4)
    cache = PrefixCache(capacity, block_size_tokens=4, chars_per_token=1, listener=recorder)
    mirror, seen = Mirror(cache), set[int]()
    for kind, prompt, tokens, salt in ops:
        if kind == "reset":
            cache.clear_unreferenced()
        else:
            output = reply_text(tokens, 1)
            seen.update(cache.sequence_hashes(prompt, output, salt))
            cache.lookup_and_insert(prompt, salt)
            mirror.apply(recorder.take())
            mirror.check(seen)
            cache.insert_output(prompt, output, salt)
        mirror.apply(recorder.take())
        mirror.check(seen)


# ----------------------------------------------------------------- the server, on loopback


class EventReader:
    """One instance's stream as a consumer reads it: SUB, with gaps filled from replay."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.next_seq = 0
        self.live = 0  # batches that came over SUB, not replay

    def close(self) -> None:
        self._context.destroy(linger=0)

    async def replay(self, start: int) -> list[tuple[int, EventBatch]]:
        """Every buffered batch from `start` on, as vLLM's replay socket answers."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        answer: list[tuple[int, EventBatch]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(100_000):
                async with asyncio.timeout(5):
                    empty, topic, seq, payload = await dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    return answer
                assert topic == TOPIC.encode()
                answer.append((int.from_bytes(seq, "big"), decode_batch(payload)))
            raise AssertionError("replay never ended")
        finally:
            dealer.close(linger=0)

    def _accept(self, got: list[EventBatch], seq: int, batch: EventBatch) -> None:
        assert seq == self.next_seq, f"seq {seq}, expected {self.next_seq}"
        assert abs(batch.ts - time.time()) < 60  # vLLM stamps batches with time.time()
        assert batch.events, "an empty batch (vLLM publishes none)"
        got.append(batch)
        self.next_seq += 1

    async def take(self, count: int) -> list[EventBatch]:
        """The next `count` batches, in sequence order, failing on any more."""
        got: list[EventBatch] = []
        deadline = time.monotonic() + 10
        while len(got) < count:
            assert time.monotonic() < deadline, f"{len(got)} of {count} batches arrived"
            try:
                async with asyncio.timeout(0.2):
                    topic, seq_bytes, payload = await self._sub.recv_multipart()
            except TimeoutError:
                # Nothing live: the SUB may have joined after they went out.
                for seq, batch in await self.replay(self.next_seq):
                    self._accept(got, seq, batch)
                continue
            assert topic == TOPIC.encode()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue  # replay gave it already
            for missed, batch in await self.replay(self.next_seq):
                if missed < seq:
                    self._accept(got, missed, batch)
            self._accept(got, seq, decode_batch(payload))
            self.live += 1
        assert len(got) == count, f"{len(got)} batches, expected {count}"
        return got

    async def assert_no_more(self) -> None:
        assert await self.replay(self.next_seq) == []


Post = Callable[..., Any]


@contextlib.asynccontextmanager
async def simulator(
    host: str = HOST, **overrides: Any
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """One instance with KV events on free ports; yields its URL and an HTTP client."""
    [port] = free_ports_on(1, [host])
    options = SimOptions(
        **{"kv_events": True, "kv_events_port": 0, "kv_events_replay_port": 0, **overrides}
    )
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], options, ready))
    bound = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({server, bound}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    bound.cancel()
    if server in done:
        server.result()
    assert done, "simulator did not bind within 10 s"
    try:
        async with new_client() as client:
            yield f"http://{host}:{port}", client
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def sources(client: httpx.AsyncClient, base: str) -> dict[str, Any]:
    response = await client.get(f"{base}/kv_event_sources")
    assert response.status_code == 200
    body: dict[str, Any] = json_of(response)  # application/json, or it fails
    return body


@contextlib.asynccontextmanager
async def reading(client: httpx.AsyncClient, base: str) -> AsyncIterator[EventReader]:
    rank = (await sources(client, base))["0"]
    reader = EventReader(rank["endpoint"], rank["replay_endpoint"])
    try:
        yield reader
    finally:
        reader.close()


async def chat(
    client: httpx.AsyncClient, base: str, content: str, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
    }
    body.update(max_tokens=max_tokens, **extra)
    response = await client.post(f"{base}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = json_of(response)
    return reply


async def test_kv_event_sources_has_vllms_shape() -> None:
    async with simulator() as (base, client):
        body = await sources(client, base)
    assert list(body) == ["0"]
    rank = body["0"]
    assert list(rank) == [*VLLM_SOURCE_KEYS, "token_ids"]
    assert rank["enable_kv_cache_events"] is True
    assert (rank["publisher"], rank["topic"], rank["token_ids"]) == ("zmq", "kv", "codepoints")
    # Port 0: the address bound, as vLLM reports it for tcp://*:0.
    assert rank["endpoint"].startswith(f"tcp://{HOST}:")
    assert rank["replay_endpoint"].startswith(f"tcp://{HOST}:")
    assert rank["endpoint"] != rank["replay_endpoint"]
    assert (rank["buffer_steps"], rank["hwm"], rank["max_queue_size"]) == (10_000, 100_000, 100_000)


async def test_fixed_ports_are_reported_as_vllm_reports_its_wildcard() -> None:
    port, replay_port = free_ports_on(2, [HOST])
    async with simulator(kv_events_port=port, kv_events_replay_port=replay_port) as (base, client):
        rank = (await sources(client, base))["0"]
        # vLLM answers with its configured endpoint; the consumer puts in the host.
        assert (rank["endpoint"], rank["replay_endpoint"]) == (
            f"tcp://*:{port}",
            f"tcp://*:{replay_port}",
        )
        assert not port_is_free(HOST, port) and not port_is_free(HOST, replay_port)
        reader = EventReader(f"tcp://{HOST}:{port}", f"tcp://{HOST}:{replay_port}")
        try:
            await chat(client, base, "x" * 200, 1)
            [batch] = await reader.take(1)
            assert stored(batch.events)
        finally:
            reader.close()
    assert port_is_free(HOST, port) and port_is_free(HOST, replay_port)  # closed on shutdown


async def test_events_off_serve_empty_sources_and_bind_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, replay_port = free_ports_on(2, [HOST])

    def no_stream(*args: object) -> None:
        raise AssertionError("an event stream was opened")

    monkeypatch.setattr(sim_server, "EventStream", no_stream)
    assert SimOptions().kv_events is False
    async with simulator(
        kv_events=False, kv_events_port=port, kv_events_replay_port=replay_port
    ) as (base, client):
        assert await sources(client, base) == {}
        await chat(client, base, "x" * 200, 20)
        assert port_is_free(HOST, port) and port_is_free(HOST, replay_port)


async def test_chat_publishes_its_prompt_then_its_output_blocks() -> None:
    content = "the quick brown fox " * 10
    prompt = chatml(content)  # 250 characters: 3 full blocks and a partial one
    max_tokens = 40
    # The cached sequence: the prompt, then the reply but its last token (never computed).
    sequence = prompt + reply_text(max_tokens)[:-4]
    chain = PrefixCache(1).block_hashes(sequence)
    assert (len(prompt) // BLOCK_CHARS, len(chain)) == (3, 6)
    async with simulator() as (base, client), reading(client, base) as reader:
        await chat(client, base, content, max_tokens)
        first, second = await reader.take(2)
        [prompt_event] = first.events
        [output_event] = second.events
        assert isinstance(prompt_event, BlockStored) and isinstance(output_event, BlockStored)
        assert prompt_event.block_hashes == chain[:3]
        assert prompt_event.parent_block_hash is None
        assert text_of(prompt_event) == prompt[: 3 * BLOCK_CHARS]
        assert prompt_event.block_size == BLOCK_CHARS
        assert output_event.block_hashes == chain[3:]
        assert output_event.parent_block_hash == chain[2]
        assert text_of(output_event) == sequence[3 * BLOCK_CHARS : 6 * BLOCK_CHARS]
        assert first.data_parallel_rank in (None, 0)

        # The same request again: every block is cached, so nothing is stored or sent.
        await chat(client, base, content, max_tokens)
        await reader.assert_no_more()
        # A request shorter than one block stores nothing either.
        await chat(client, base, "hi", 1)
        await reader.assert_no_more()


async def test_sequence_numbers_count_from_zero_and_the_sub_gets_them_live() -> None:
    async with simulator() as (base, client), reading(client, base) as reader:
        # Until its subscription reaches the publisher a SUB hears nothing; requests with
        # new prompts until one batch comes live (bounded).
        for attempt in range(50):
            await chat(client, base, f"probe {attempt} " * 30, 1)
            await reader.take(1)
            if reader.live:
                break
        assert reader.live, "no batch came over SUB"
        assert reader.next_seq == attempt + 1  # one batch per request, from seq 0
        live = reader.live
        for index in range(3):
            await chat(client, base, f"more {index} " * 30, 1)
        await reader.take(3)
        assert reader.live == live + 3


async def test_eviction_publishes_exactly_the_evicted_blocks() -> None:
    first, second = "a" * 200, "b" * 200
    async with (
        simulator(capacity_blocks=4) as (base, client),
        reading(client, base) as reader,
    ):
        await chat(client, base, first, 1)
        await reader.take(1)
        await chat(client, base, second, 1)
        [batch] = await reader.take(1)
    kept = PrefixCache(4)
    kept.lookup_and_insert(chatml(first))
    kept.lookup_and_insert(chatml(second))
    a = PrefixCache(1).block_hashes(chatml(first))
    removed = [e.block_hashes for e in batch.events if isinstance(e, BlockRemoved)]
    assert removed == [[a[2]], [a[1]]]
    assert [h for h in a if h not in kept] == [a[1], a[2]]
    [stored_event] = stored(batch.events)
    assert stored_event.block_hashes == PrefixCache(1).block_hashes(chatml(second))
    assert isinstance(batch.events[0], BlockStored)  # stored, then what that evicted


async def test_reset_is_published_with_the_next_step_as_vllm_does() -> None:
    async with simulator() as (base, client), reading(client, base) as reader:
        await chat(client, base, "x" * 200, 1)
        await reader.take(1)
        response = await client.post(f"{base}/reset_prefix_cache")
        assert response.status_code == 200
        # vLLM's engine publishes at the end of a step; an idle one has none.
        await reader.assert_no_more()
        await chat(client, base, "x" * 200, 1)
        [batch] = await reader.take(1)
    cleared, again = batch.events
    assert cleared == AllBlocksCleared()
    assert isinstance(again, BlockStored)
    assert again.block_hashes == PrefixCache(1).block_hashes(chatml("x" * 200))


async def test_engine_model_publishes_per_step_with_the_salt() -> None:
    content, max_tokens = "y" * 200, 40
    prompt = chatml(content)
    sequence = prompt + reply_text(max_tokens)[:-4]
    async with (
        simulator(timing="model", time_scale=0.0) as (base, client),
        reading(client, base) as reader,
    ):
        await chat(client, base, content, max_tokens, cache_salt="tenant")
        admitted, finished = await reader.take(2)
        await chat(client, base, content, max_tokens)  # unsalted: another chain
        unsalted, _ = await reader.take(2)
        await chat(client, base, content, max_tokens, cache_salt="tenant")
        await reader.assert_no_more()
    salted_chain = PrefixCache(1).block_hashes(sequence, "tenant")
    [head] = admitted.events
    [tail] = finished.events
    assert isinstance(head, BlockStored) and isinstance(tail, BlockStored)
    assert head.block_hashes == salted_chain[:3]
    assert head.extra_keys == [("tenant",), None, None]
    assert text_of(head) == prompt[: 3 * BLOCK_CHARS]
    assert (tail.parent_block_hash, tail.block_hashes) == (salted_chain[2], salted_chain[3:])
    assert tail.extra_keys == [None, None, None]
    [plain] = unsalted.events
    assert isinstance(plain, BlockStored)
    assert plain.block_hashes == PrefixCache(1).block_hashes(prompt)
    assert plain.extra_keys == [None, None, None]


async def test_a_bad_cache_salt_is_a_400_as_in_vllm() -> None:
    async with simulator() as (base, client):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": ""}
        response = await client.post(f"{base}/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert "cache_salt" in json.dumps(json_of(response))


async def test_instances_on_distinct_ips_share_port_numbers() -> None:
    hosts = ["127.0.0.11", "127.0.0.12"]
    port, events_port, replay_port = free_ports_on(3, hosts)
    options = SimOptions(
        kv_events=True, kv_events_port=events_port, kv_events_replay_port=replay_port
    )
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(h, port) for h in hosts], options, ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        readers = [
            EventReader(f"tcp://{h}:{events_port}", f"tcp://{h}:{replay_port}") for h in hosts
        ]
        try:
            async with new_client() as client:
                await chat(client, f"http://{hosts[0]}:{port}", "z" * 200, 1)
            [batch] = await readers[0].take(1)
            assert stored(batch.events)
            await readers[1].assert_no_more()
        finally:
            for reader in readers:
                reader.close()
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def test_a_taken_event_port_fails_startup_with_a_clear_error() -> None:
    port, other, events_port, replay_port = free_ports_on(4, [HOST])
    options = SimOptions(
        kv_events=True, kv_events_port=events_port, kv_events_replay_port=replay_port
    )
    with pytest.raises(OSError, match="distinct kv_events ports"):
        async with asyncio.timeout(10):
            await serve([(HOST, port), (HOST, other)], options)
    assert port_is_free(HOST, events_port) and port_is_free(HOST, port)


def test_a_long_prompt_is_published_in_step_sized_batches_chained_by_parent():
    from extproc.sim.events import step_batches

    tokens = list(range(64 * 300))
    hashes = list(range(1, 301))
    stored = BlockStored(hashes, None, tokens, 64, None, "GPU", None, [None] * 300, 0)
    batches = step_batches([stored, BlockRemoved([7], "GPU")], 8192)
    pieces = [e for batch in batches for e in batch if isinstance(e, BlockStored)]
    assert all(
        sum(len(e.token_ids) for e in b if isinstance(e, BlockStored)) <= 8192 for b in batches
    )
    assert [h for p in pieces for h in p.block_hashes] == hashes
    assert [t for p in pieces for t in p.token_ids] == tokens
    assert [p.parent_block_hash for p in pieces] == [
        None,
        *(p.block_hashes[-1] for p in pieces[:-1]),
    ]
    assert isinstance(batches[-1][-1], BlockRemoved)
