"""Decisions shared between sibling routers: the wire format, what a receiver refuses, and
two routers on ipc sockets that place one new prompt alike."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import msgspec
import pytest

from extproc.adapter.decision_exchange import (
    WIRE_VERSION,
    DecisionBatch,
    DecisionExchange,
    MalformedBatch,
    decode_batch,
    encode_batch,
    pack_hashes,
    settings_tag,
    unpack_hashes,
)
from extproc.adapter.routing import Router
from extproc.config import RouterConfig
from extproc.picker.hosts import HostSet
from extproc.stack.processes import wait_until_async

HOSTS = tuple(f"127.0.0.{21 + i}:8000" for i in range(4))
CHAIN = (0, 1, 2**64 - 1, 0x9E3779B97F4A7C15)


def router(seed: int = 1, **settings) -> Router:
    frozen = 0.0  # prefill queues do not drain: each router's history weighs alike
    config = RouterConfig(hosts=HOSTS, kv_events=False, **settings)
    return Router(config, random.Random(seed), clock=lambda: frozen)


def chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def doc(n: int | str) -> bytes:
    return chat(f"document {n} " + "the body of this document goes on " * 60)


def batch(sender: int = 7, first: int = 0, settings: int | None = None, **entries) -> bytes:
    tag = settings_tag(router().config) if settings is None else settings
    hosts = list(entries.get("hosts", [HOSTS[0]]))
    chains = [pack_hashes(CHAIN)] * len(hosts)
    return encode_batch(DecisionBatch(WIRE_VERSION, sender, first, tag, hosts, chains))


def test_a_batch_and_its_hashes_survive_the_wire():
    tag = settings_tag(router().config)
    sent = DecisionBatch(WIRE_VERSION, 3, 10, tag, [HOSTS[0], HOSTS[1]], [pack_hashes(CHAIN), b""])
    received = decode_batch(encode_batch(sent))
    assert received == sent
    assert unpack_hashes(received.chains[0]) == CHAIN
    assert unpack_hashes(received.chains[1]) == ()
    # Another block size or key mode hashes prompts differently: another tag.
    assert settings_tag(router(block_bytes=256).config) != tag
    assert settings_tag(router(key_mode="native").config) != tag


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode([WIRE_VERSION, 1, 0, 0, ["h"]]),  # a field short
        msgspec.msgpack.encode([WIRE_VERSION, 1, 0, 0, [1], [b""]]),  # a host not a string
        msgspec.msgpack.encode([WIRE_VERSION, 1, 0, 0, ["h", "i"], [b""]]),  # hosts != chains
        msgspec.msgpack.encode([WIRE_VERSION + 1, 1, 0, 0, [], []]),  # a newer version
        msgspec.msgpack.encode({"version": WIRE_VERSION}),
    ],
)
def test_what_is_not_a_batch_is_refused(data):
    with pytest.raises(MalformedBatch):
        decode_batch(data)


def test_a_chain_of_no_whole_number_of_hashes_is_refused():
    with pytest.raises(MalformedBatch):
        unpack_hashes(b"\x00" * 9)


def test_a_receiver_applies_what_it_can_and_counts_the_rest_by_reason():
    receiver = router()
    exchange = DecisionExchange(receiver, None, ())
    exchange.apply(b"\xc1garbage")
    tag = settings_tag(receiver.config)
    short = DecisionBatch(WIRE_VERSION, 7, 0, tag, [HOSTS[0]], [b"\x00" * 9])
    exchange.apply(encode_batch(short))
    exchange.apply(batch(hosts=[HOSTS[1], "10.9.9.9:8000"]))
    assert exchange.applied == 1
    assert receiver.index.host_sizes() == {HOSTS[1]: len(CHAIN)}
    # Sender 7 published 2 decisions, then its next batch says 5 came before it: 3 lost.
    exchange.apply(batch(first=5))
    exchange.apply(batch(settings=tag + 1, first=6))
    # A restarted sender is another sender: nothing lost.
    exchange.apply(batch(sender=8, first=0))
    assert exchange.applied == 3
    assert dict(exchange.dropped) == {"malformed": 2, "unknown_host": 1, "lost": 3, "settings": 1}


def test_a_picker_without_a_pool_takes_decisions_for_the_endpoints_it_has_placed_on():
    # No hosts configured: kgateway's subset hint names each request's endpoints.
    config = RouterConfig(epp=True, kv_events=False)
    receiver = Router(config, random.Random(1), clock=lambda: 0.0)
    assert not receiver.hosts.hosts
    exchange = DecisionExchange(receiver, None, ())
    # Before it has placed anything, it knows no endpoint.
    exchange.apply(batch(hosts=[HOSTS[0]]))
    assert exchange.applied == 0 and dict(exchange.dropped) == {"unknown_host": 1}
    placed = receiver.place({}, doc("own"), within=HostSet.of([HOSTS[1]])).decision
    assert placed.primary == HOSTS[1]
    exchange.apply(batch(first=1, hosts=[HOSTS[1], HOSTS[2]]))
    assert exchange.applied == 1 and dict(exchange.dropped) == {"unknown_host": 2}
    # The sibling's decision now places the sibling's prompt, within the request's hint.
    assert receiver.index.host_sizes()[HOSTS[1]] > len(CHAIN)


async def test_publishing_batches_up_to_batch_max_and_flushes_the_rest_later():
    sender = router()
    exchange = DecisionExchange(sender, None, (), batch_max=3)
    sent: list[bytes] = []
    loop = asyncio.get_running_loop()

    class Socket:
        def send(self, data: bytes, flags: int) -> asyncio.Future[None]:
            sent.append(data)
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done

    exchange._pub = Socket()  # type: ignore[assignment]
    for n in range(4):
        exchange.publish(HOSTS[n % 2], CHAIN[: n + 1])
    assert len(sent) == 1  # the fourth waits for the timer, or close
    exchange.flush()
    first, second = (decode_batch(data) for data in sent)
    assert (first.first, len(first.hosts), second.first, len(second.hosts)) == (0, 3, 3, 1)
    assert [unpack_hashes(c) for c in first.chains] == [CHAIN[:1], CHAIN[:2], CHAIN[:3]]
    assert exchange.published == 4


async def connected(sender: DecisionExchange, receiver: DecisionExchange) -> None:
    """Publish a probe (naming no host) until the receiver has one: SUB joins late."""

    def probe_arrived() -> bool:
        if receiver.dropped["unknown_host"]:
            return True
        sender.publish("probe:0", (1,))
        sender.flush()
        return False

    await wait_until_async(probe_arrived, 10, "a probe to cross", interval_s=0.01)


async def applied(exchange: DecisionExchange, count: int) -> None:
    await wait_until_async(
        lambda: exchange.applied >= count, 10, f"{count} decisions applied", interval_s=0.001
    )


async def test_a_decision_made_by_one_router_is_the_others_and_one_prompt_goes_to_one_host(
    tmp_path: Path,
):
    ends = [f"ipc://{tmp_path / name}" for name in ("a", "b")]
    first, second = router(1), router(2)
    # The second router has a history of its own (other documents queued for prefill):
    # on its own it places new documents elsewhere than the first does.
    for n in range(3):
        second.route({}, doc(f"warm {n}"))
    apart = [router(1), router(2)]
    for n in range(3):
        apart[1].route({}, doc(f"warm {n}"))
    alone = [
        (apart[0].route({}, doc(n)).primary, apart[1].route({}, doc(n)).primary) for n in range(20)
    ]
    assert any(a != b for a, b in alone)

    one = DecisionExchange(first, ends[0], [ends[1]])
    other = DecisionExchange(second, ends[1], [ends[0]])
    tasks = []
    try:
        for exchange in (one, other):
            exchange.start()
            tasks.append(asyncio.create_task(exchange.run()))
        await connected(one, other)
        await connected(other, one)
        # A burst of each new document: the first router takes one request, the second the
        # next, the first the third...
        for n in range(20):
            placed = [first.route({}, doc(n)).primary]
            await applied(other, 2 * n + 1)
            placed.append(second.route({}, doc(n)).primary)
            await applied(one, n + 1)
            placed.append(first.route({}, doc(n)).primary)
            assert len(set(placed)) == 1, (n, placed)
        await applied(other, 40)
        # Each decision was shared once: none came back to the router that made it.
        await asyncio.sleep(0.05)  # a window for a stray echo to arrive in
        assert (one.applied, other.applied) == (20, 40)
        assert sum(second.index.host_sizes().values()) > 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        one.close()
        other.close()
    assert first.index.on_record is None
