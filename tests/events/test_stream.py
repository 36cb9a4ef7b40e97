"""Our publisher and subscriber over loopback TCP: order, gaps, restarts, warm-up, silence.

Every wait polls a condition against a deadline; nothing sleeps to synchronise."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from extproc.events.publisher import END_SEQ, EventPublisher, encode_seq
from extproc.events.subscriber import (
    EventSource,
    EventSubscriptions,
    HostEventStream,
    StreamStats,
)
from extproc.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    decode_batch,
    encode_batch,
)
from extproc.stack.processes import WaitTimeout, wait_until_async

LOOPBACK = "tcp://127.0.0.1:0"
HOST = "10.0.0.1:8000"


class Recorder:
    """An EventSink that writes down every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def stored(self, host: str, event: BlockStored) -> None:
        self.calls.append(("stored", event.block_hashes[0]))

    def removed(self, host: str, event: BlockRemoved) -> None:
        self.calls.append(("removed", event.block_hashes[0]))

    def cleared(self, host: str, reason: str) -> None:
        self.calls.append(("cleared", reason))

    def live(self, host: str, live: bool) -> None:
        self.calls.append(("live", live))

    def of(self, kind: str) -> list[object]:
        return [value for k, value in self.calls if k == kind]

    def blocks(self) -> list[tuple[str, object]]:
        return [(k, v) for k, v in self.calls if k != "live"]


def stored(block: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=[block],
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def within(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``condition`` holds within ``timeout_s``, polled."""
    try:
        await wait_until_async(condition, timeout_s, interval_s=0.01)
    except WaitTimeout:
        return False
    return True


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    await wait_until_async(condition, timeout_s, interval_s=0.01)


@pytest.fixture
def publishers() -> Iterator[Callable[..., EventPublisher]]:
    made: list[EventPublisher] = []

    def make(
        endpoint: str = LOOPBACK, replay: str | None = LOOPBACK, buffer_batches: int = 10_000
    ) -> EventPublisher:
        publisher = EventPublisher(endpoint, replay, "kv", buffer_batches=buffer_batches)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def source_of(publisher: EventPublisher, *, replay: bool = True) -> EventSource:
    return EventSource(
        HOST, publisher.endpoint, publisher.replay_endpoint if replay else None, "kv"
    )


@contextlib.asynccontextmanager
async def running(stream: HostEventStream) -> AsyncIterator[HostEventStream]:
    task = asyncio.create_task(stream.run())
    try:
        yield stream
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # anything but the cancellation fails the test
        assert stream._sub is None and stream._dealer is None  # closed on the way out


async def joined(stream: HostEventStream, publisher: EventPublisher) -> None:
    """Publish empty batches until one arrives *live*: the subscription has taken."""
    for _ in range(50):
        publisher.publish([])
        if await within(lambda: stream._live_seq == publisher.next_seq - 1, 0.1):
            return
    raise AssertionError("never joined")


# --- the publisher's protocol, seen raw ------------------------------------------------


def test_publisher_frames_and_replay_protocol(publishers: Callable[..., EventPublisher]) -> None:
    publisher = publishers()
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    assert not publisher.endpoint.endswith(":0")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(publisher.replay_endpoint or "")
        events: list[KvEvent] = [stored(1)]
        assert [publisher.publish(events, ts=1.0) for _ in range(3)] == [0, 1, 2]
        dealer.send_multipart([b"", b"not 8 bytes", b"extra frame"])  # ignored, as vLLM does
        dealer.send_multipart([b"", encode_seq(1)])
        answer = [dealer.recv_multipart() for _ in range(3)]
        assert answer[0][:3] == [b"", b"kv", encode_seq(1)]
        assert decode_batch(answer[0][3]) == EventBatch(ts=1.0, events=events)
        assert [frames[2] for frames in answer[1:]] == [encode_seq(2), END_SEQ]
        assert answer[2] == [b"", b"", END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        ctx.term()
    publisher.close()
    with pytest.raises(RuntimeError):
        publisher.publish([])


async def test_pub_frames_are_topic_seq_payload(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher = publishers(replay=None)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        deadline = time.monotonic() + 5.0
        while not sub.poll(20):  # slow joiner: publish until one arrives
            assert time.monotonic() < deadline
            publisher.publish([AllBlocksCleared()], ts=2.0)
        topic, seq, payload = sub.recv_multipart()
        assert (topic, len(seq)) == (b"kv", 8)
        assert payload == encode_batch(EventBatch(ts=2.0, events=[AllBlocksCleared()]))
    finally:
        sub.close(linger=0)
        ctx.term()


# --- the subscriber --------------------------------------------------------------------


async def test_delivers_in_order(publishers: Callable[..., EventPublisher]) -> None:
    publisher, sink = publishers(), Recorder()
    async with running(HostEventStream(source_of(publisher), sink)) as stream:
        await joined(stream, publisher)
        publisher.publish([stored(1), stored(2)])
        publisher.publish([BlockRemoved(block_hashes=[1], medium="GPU")])
        publisher.publish([AllBlocksCleared(), stored(3)])
        await until(lambda: len(sink.blocks()) == 5)
    assert sink.blocks() == [
        ("stored", 1),
        ("stored", 2),
        ("removed", 1),
        ("cleared", "cleared"),
        ("stored", 3),
    ]
    assert sink.of("live") == [True]
    assert (stream.stats.gaps, stream.stats.lost_batches, stream.stats.clears) == (0, 0, 1)
    assert stream.stats.last_event_monotonic is not None


async def test_a_gap_is_filled_from_replay(publishers: Callable[..., EventPublisher]) -> None:
    publisher, sink = publishers(), Recorder()
    async with running(HostEventStream(source_of(publisher), sink)) as stream:
        await joined(stream, publisher)
        publisher.publish([stored(1)], send=False)
        publisher.publish([stored(2)], send=False)
        publisher.publish([stored(3)])
        await until(lambda: len(sink.blocks()) == 3)
        publisher.publish([stored(4)])  # the stream carries on live
        await until(lambda: len(sink.blocks()) == 4)
    assert sink.blocks() == [("stored", 1), ("stored", 2), ("stored", 3), ("stored", 4)]
    assert stream.stats.gaps == 1
    assert stream.stats.replayed_batches >= 2
    assert stream.stats.lost_batches == 0


async def test_a_gap_without_replay_clears_the_host(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(replay=None), Recorder()
    async with running(HostEventStream(source_of(publisher, replay=False), sink)) as stream:
        await joined(stream, publisher)
        publisher.publish([stored(1)], send=False)
        publisher.publish([stored(2)])
        await until(lambda: len(sink.blocks()) == 2)
    assert sink.blocks() == [("cleared", "gap"), ("stored", 2)]
    assert (stream.stats.gaps, stream.stats.lost_batches) == (1, 1)


async def test_a_gap_the_buffer_no_longer_holds_clears_the_host(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(buffer_batches=2), Recorder()
    async with running(HostEventStream(source_of(publisher), sink)) as stream:
        await joined(stream, publisher)
        for block in (1, 2, 3):
            publisher.publish([stored(block)], send=False)
        publisher.publish([stored(4)])
        await until(lambda: ("stored", 4) in sink.blocks())
    assert sink.blocks() == [("cleared", "gap"), ("stored", 3), ("stored", 4)]
    assert stream.stats.lost_batches == 2


async def test_a_replay_that_never_answers_clears_the_host(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(replay=None), Recorder()
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # takes replay requests, answers none
    try:
        mute.bind(LOOPBACK)
        mute_endpoint = mute.getsockopt_string(zmq.LAST_ENDPOINT)
        source = EventSource(HOST, publisher.endpoint, mute_endpoint, "kv")
        stream = HostEventStream(source, sink, replay_timeout_s=0.1, warm_up=False)
        async with running(stream):
            await until(lambda: stream.stats.replay_timeouts >= 1)  # the connect probe
            await joined(stream, publisher)
            publisher.publish([stored(1)], send=False)
            publisher.publish([stored(2)])
            await until(lambda: ("stored", 2) in sink.blocks())
    finally:
        mute.close(linger=0)
        ctx.term()
    assert sink.blocks() == [("cleared", "gap"), ("stored", 2)]
    assert stream.stats.lost_batches == 1


async def test_a_publisher_restart_clears_the_host(
    publishers: Callable[..., EventPublisher],
) -> None:
    first, sink = publishers(), Recorder()
    async with running(HostEventStream(source_of(first), sink)) as stream:
        await joined(stream, first)
        for block in range(1, 6):
            first.publish([stored(block)])
        await until(lambda: len(sink.blocks()) == 5)
        first.close()
        second = publishers(first.endpoint, first.replay_endpoint)  # same ports, seq from 0
        second.publish([stored(100)])
        await until(lambda: ("stored", 100) in sink.blocks())
        second.publish([stored(101)])
        await until(lambda: ("stored", 101) in sink.blocks())
    assert sink.blocks()[5:] == [("cleared", "restart"), ("stored", 100), ("stored", 101)]
    assert stream.stats.restarts == 1
    assert sink.of("live") == [True, False, True]  # the disconnect shows


async def test_a_restart_that_outran_our_seq_is_caught_by_the_anchor_check(
    publishers: Callable[..., EventPublisher],
) -> None:
    first, sink = publishers(), Recorder()
    async with running(HostEventStream(source_of(first), sink)) as stream:
        await joined(stream, first)
        first.publish([stored(1)])
        await until(lambda: ("stored", 1) in sink.blocks())
        first.close()
        # No await in between: the new publisher is far past our seq before we reconnect,
        # so SUB's order alone would take its next batch for a gap, not a restart.
        second = publishers(first.endpoint, first.replay_endpoint)
        for block in range(100, 120):
            second.publish([stored(block)])
        await until(lambda: ("stored", 119) in sink.blocks())
    assert sink.blocks()[1:] == [("cleared", "restart")] + [
        ("stored", block) for block in range(100, 120)
    ]
    assert (stream.stats.restarts, stream.stats.lost_batches) == (1, 0)


@contextlib.asynccontextmanager
async def fake_engine(
    answer: Callable[[int, int], list[int]],
) -> AsyncIterator[tuple[EventSource, list[int]]]:
    """A PUB that stays quiet and a replay ROUTER whose n-th answer from ``start`` holds the
    seqs ``answer(n, start)`` of batches storing block 10 + seq, framed without the topic
    (as vllm#45174 reports of vLLM); yields the source and the starts asked for."""
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    starts: list[int] = []

    async def serve() -> None:
        for n in range(100):
            identity, _, start = await router.recv_multipart()
            starts.append(int.from_bytes(start, "big"))
            for seq in answer(n, starts[-1]):
                payload = encode_batch(EventBatch(ts=0.0, events=[stored(10 + seq)]))
                await router.send_multipart([identity, b"", encode_seq(seq), payload])
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])

    try:
        pub.bind(LOOPBACK)
        router.bind(LOOPBACK)
        pub_at, replay_at = (sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in (pub, router))
        server = asyncio.create_task(serve())
        try:
            yield EventSource(HOST, pub_at, replay_at, "kv"), starts
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    finally:
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


async def test_replay_answers_without_the_topic_frame_are_understood() -> None:
    sink = Recorder()
    engine = fake_engine(lambda n, start: [0, 1][start:])
    async with engine as (source, _), running(HostEventStream(source, sink)):
        await until(lambda: len(sink.blocks()) == 2)
    assert sink.blocks() == [("stored", 10), ("stored", 11)]


def first_answer_loses_seq_2(n: int, start: int) -> list[int]:
    sent = [0, 1, 3, 4] if n == 0 else [0, 1, 2, 3, 4]
    return [seq for seq in sent if seq >= start]


async def test_a_replay_answer_with_holes_is_asked_for_again() -> None:
    """The first answer loses seq 2 in transit (as vLLM's ROUTER does past 1000 messages);
    asking again from seq 1 gets the rest, and nothing is cleared."""
    sink = Recorder()
    engine = fake_engine(first_answer_loses_seq_2)
    async with engine as (source, starts), running(HostEventStream(source, sink)) as stream:
        await until(lambda: len(sink.blocks()) == 5)
    assert sink.blocks() == [("stored", 10 + seq) for seq in range(5)]
    assert starts[:2] == [0, 1]
    assert (stream.stats.replay_retries, stream.stats.lost_batches) == (1, 0)


async def test_a_late_subscriber_warms_up_from_the_buffer(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(), Recorder()
    for block in range(5):
        publisher.publish([stored(block)])
    async with running(HostEventStream(source_of(publisher), sink)) as stream:
        await until(lambda: len(sink.blocks()) == 5)
        await joined(stream, publisher)
        publisher.publish([stored(5)])
        await until(lambda: len(sink.blocks()) == 6)
    assert sink.blocks() == [("stored", block) for block in range(6)]
    assert stream.stats.partial_warmups == 0
    assert stream.stats.restarts == stream.stats.lost_batches == 0


async def test_a_warm_up_from_a_rolled_buffer_is_partial(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(buffer_batches=3), Recorder()
    for block in range(5):
        publisher.publish([stored(block)])
    async with running(HostEventStream(source_of(publisher), sink)) as stream:
        await until(lambda: len(sink.blocks()) == 3)
    assert sink.blocks() == [("stored", 2), ("stored", 3), ("stored", 4)]
    assert stream.stats.partial_warmups == 1
    assert stream.stats.lost_batches == 0


async def test_without_warm_up_only_later_batches_arrive(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(), Recorder()
    publisher.publish([stored(0)], send=False)  # in the buffer only
    async with running(HostEventStream(source_of(publisher), sink, warm_up=False)) as stream:
        await joined(stream, publisher)
        publisher.publish([stored(1)])
        await until(lambda: len(sink.blocks()) == 1)
    assert sink.blocks() == [("stored", 1)]


async def test_an_idle_publisher_is_live_and_a_dead_one_silent(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(), Recorder()
    stream = HostEventStream(source_of(publisher), sink, silent_after_s=0.3, replay_timeout_s=0.2)
    async with running(stream):
        await until(lambda: stream.stats.replay_requests >= 4)  # probes, answered
        assert sink.of("live") == [True]
        publisher.close()
        await until(lambda: sink.of("live") == [True, False])
        assert stream.stats.silences == 1
        await until(lambda: stream.stats.replay_timeouts >= 1)  # probes go on, unanswered
        again = publishers(publisher.endpoint, publisher.replay_endpoint)
        again.publish([stored(7)])
        await until(lambda: ("stored", 7) in sink.blocks())
    assert sink.of("live") == [True, False, True]


async def test_silence_without_replay_comes_from_the_quiet_timer(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(replay=None), Recorder()
    stream = HostEventStream(source_of(publisher, replay=False), sink, silent_after_s=0.2)
    async with running(stream):
        await joined(stream, publisher)
        await until(lambda: sink.of("live") == [True, False])
        publisher.publish([stored(1)])
        await until(lambda: sink.of("live") == [True, False, True])
    assert stream.stats.silences == 1


async def test_bad_payloads_are_counted_and_the_stream_goes_on() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sink = Recorder()
    try:
        pub.bind(LOOPBACK)
        source = EventSource(HOST, pub.getsockopt_string(zmq.LAST_ENDPOINT), None, "kv")
        async with running(HostEventStream(source, sink)) as stream:
            seq = 0
            for seq in range(50):  # slow joiner: until one arrives
                pub.send_multipart([b"kv", encode_seq(seq), encode_batch(EventBatch(0, []))])
                if await within(lambda: stream.stats.batches > 0, 0.1):
                    break
            assert stream._last == seq
            good = encode_batch(EventBatch(ts=1.0, events=[stored(1)]))
            pub.send_multipart([b"kv", encode_seq(seq + 5), good])  # a gap first
            pub.send_multipart([b"kv", encode_seq(seq + 6), b"\xc1 not msgpack"])
            pub.send_multipart([b"kv", b"short"])
            pub.send_multipart([b"kv2", encode_seq(0), good])  # another topic: not ours
            pub.send_multipart([b"kv", encode_seq(seq + 7), good])
            await until(lambda: len(sink.of("stored")) == 2)
    finally:
        pub.close(linger=0)
        ctx.term()
    assert sink.blocks() == [
        ("cleared", "gap"),
        ("stored", 1),
        ("cleared", "undecodable"),
        ("stored", 1),
    ]
    assert stream.stats.decode_errors == 2
    assert stream.stats.restarts == 0


async def test_subscriptions_follow_the_fleet(publishers: Callable[..., EventPublisher]) -> None:
    a, b, sink = publishers(), publishers(), Recorder()
    subs = EventSubscriptions(sink, silent_after_s=5.0)
    source_a = EventSource("a:1", a.endpoint, a.replay_endpoint, "kv")
    source_b = EventSource("b:1", b.endpoint, b.replay_endpoint, "kv")
    a.publish([stored(1)])
    b.publish([stored(2)])
    try:
        subs.update({"a": source_a, "b": source_b})
        await until(lambda: sorted(sink.of("stored")) == [1, 2])  # type: ignore[type-var]
        assert set(subs.stats()) == {"a", "b"}
        subs.update({"a": source_a})
        assert set(subs.stats()) == {"a"}
        renamed = EventSource("a:2", a.endpoint, a.replay_endpoint, "kv")
        subs.update({"a": renamed})  # changed: a new stream, which warms up afresh
        a.publish([stored(3)])
        await until(lambda: sorted(sink.of("stored")) == [1, 1, 2, 3])  # type: ignore[type-var]
        stats = subs.stats()["a"]
        assert isinstance(stats, StreamStats)
    finally:
        await subs.close()
    assert subs.stats() == {}


class FailsOnce(Recorder):
    """A sink with a bug: its first ``stored`` raises."""

    def stored(self, host: str, event: BlockStored) -> None:
        if not self.calls or self.calls[0] != ("bug", None):
            self.calls.insert(0, ("bug", None))
            raise RuntimeError("sink bug")
        super().stored(host, event)


async def test_a_failed_stream_is_reported_and_restarted_by_update(
    publishers: Callable[..., EventPublisher],
) -> None:
    publisher, sink = publishers(), FailsOnce()
    publisher.publish([stored(1)])
    subs = EventSubscriptions(sink)
    source = source_of(publisher)
    try:
        subs.update({"a": source})
        await until(lambda: ("cleared", "failed") in sink.calls)
        assert sink.of("live")[-1] is False
        subs.update({"a": source})  # the same fleet: the failed stream starts again
        await until(lambda: ("stored", 1) in sink.calls)
    finally:
        await subs.close()
