"""Decisions shared between sibling routers: the workers of one supervisor, or processes
on one machine that name each other (``decision_exchange_bind``/``_peers``).

Each router records its own decisions in its prefix index at once (speculative entries
where the engine's KV events are read, see ``index/precise.py``), but knows nothing of
its siblings' until the engines' events confirm them, and nothing ever where no events
come. So N workers scatter a burst of one new prompt over N hosts. Here each router
passes every decision its index records (``PrefixIndex.on_record``: the host and the
prompt's chained block hashes, whose seed already names its model and salt) to its
siblings, and records theirs (``PrefixIndex.record_hashes``) exactly as it records its
own: the KV events stay the source of truth, confirming or outliving these entries alike.

The wire: a ZMQ PUB socket per router, bound on its own endpoint, and one SUB socket
connected to every sibling's. Decisions wait in a batch for at most ``FLUSH_S`` (or
until ``BATCH_MAX`` of them), and a batch is one msgpack message (``DecisionBatch``),
sent without blocking: a sibling whose queue is full (``SNDHWM`` batches) misses it, and
counts the gap in the sender's sequence when the next arrives. A message that cannot be
read, names a host outside the receiver's host set, or comes from a router whose index
settings differ (a reload half applied) is dropped and counted, never raised.

The endpoints are on this machine only (ipc, or tcp on loopback: see config.py), so
block hashes travel as native 64-bit integers, packed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Final, Protocol

import msgspec
import structlog
import xxhash
import zmq
import zmq.asyncio

from extproc.adapter import metrics
from extproc.config import RouterConfig
from extproc.index.prefix import PrefixIndex
from extproc.picker.hosts import HostSet

log = structlog.get_logger("decision_exchange")

WIRE_VERSION: Final = 1
# How long a decision may wait for others to share its message, and how many one holds.
FLUSH_S: Final = 0.002
BATCH_MAX: Final = 64
# Batches ZMQ queues per sibling, each way, before it drops them (about 1 MB at most).
SNDHWM: Final = 1000
RCVHWM: Final = 1000
# The largest message read: BATCH_MAX decisions of 2,048 blocks each, with room to spare.
MAX_MESSAGE_BYTES: Final = 2 * 1024 * 1024
RECONNECT_MS: Final = 10
# Senders whose sequence is followed; past this many (siblings restarted often), forgotten.
MAX_SENDERS: Final = 1024

_HASH: Final = "Q"  # an unsigned 64-bit integer, native byte order
_HASH_BYTES: Final = array(_HASH).itemsize


class DecisionBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One message: decisions of one router, oldest first."""

    version: int
    # A number this router drew at start: a restarted sibling is a new sender.
    sender: int
    # How many decisions the sender published before this batch: a jump is a loss.
    first: int
    # ``settings_tag`` of the sender's index: hashes mean nothing under other settings.
    settings: int
    # Per decision: the host, and the prompt's block hashes (``pack_hashes``).
    hosts: list[str]
    chains: list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DecisionBatch)


class MalformedBatch(ValueError):
    """A message on the exchange that this version cannot read."""


def settings_tag(config: RouterConfig) -> int:
    """What block hashes mean: two routers whose tags differ hash prompts differently."""
    return _tag(config.key_mode.value, config.block_bytes)


@cache
def _tag(key_mode: str, block_bytes: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{key_mode}/{block_bytes}".encode())


def pack_hashes(hashes: Sequence[int]) -> bytes:
    return array(_HASH, hashes).tobytes()


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    if len(data) % _HASH_BYTES:
        raise MalformedBatch(f"a chain of {len(data)} bytes is no whole number of hashes")
    chain = array(_HASH)
    chain.frombytes(data)
    return tuple(chain)


def encode_batch(batch: DecisionBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> DecisionBatch:
    """The batch in ``data``; raises MalformedBatch for anything else."""
    try:
        batch = _decoder.decode(data)
    except msgspec.DecodeError as error:  # ValidationError included
        raise MalformedBatch(str(error)) from None
    if batch.version != WIRE_VERSION:
        raise MalformedBatch(f"wire version {batch.version}, not {WIRE_VERSION}")
    if len(batch.hosts) != len(batch.chains):
        raise MalformedBatch(f"{len(batch.hosts)} hosts for {len(batch.chains)} chains")
    return batch


class Sibling(Protocol):
    """What the exchange reads of the router it serves (``routing.Router``)."""

    @property
    def index(self) -> PrefixIndex: ...

    @property
    def hosts(self) -> HostSet: ...

    @property
    def config(self) -> RouterConfig: ...


class DecisionExchange:
    """One router's end: publishes the decisions its index records, applies its siblings'.

    ``start`` (on the router's event loop) binds and connects; ``run`` receives until
    cancelled; ``close`` sends what is pending and closes the sockets."""

    def __init__(
        self,
        router: Sibling,
        bind: str | None,
        peers: Iterable[str],
        flush_s: float = FLUSH_S,
        batch_max: int = BATCH_MAX,
    ) -> None:
        self._router = router
        self.bind = bind
        self.peers = tuple(peers)
        self._flush_s = flush_s
        self._batch_max = batch_max
        self._sender = random.getrandbits(63)
        self._published = 0
        self._hosts: list[str] = []
        self._chains: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        # Each sender's next expected sequence number.
        self._expected: dict[int, int] = {}
        # This exchange's own counts (the metrics add up every exchange in the process).
        self.applied = 0
        self.dropped: Counter[str] = Counter()

    @property
    def published(self) -> int:
        return self._published

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        if self.bind is not None:
            self._pub = pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, SNDHWM)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.bind)
            self._router.index.on_record = self.publish
        if self.peers:
            self._sub = sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            # A sibling that binds later (started after this one, or restarted): joined
            # within RECONNECT_MS, so few of its first decisions pass unheard.
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            for peer in self.peers:
                sub.connect(peer)
        log.info("decision_exchange_started", bind=self.bind, peers=len(self.peers))

    # --- publishing (on the request path: a list append, then a send every FLUSH_S)

    def publish(self, host: str, hashes: Sequence[int]) -> None:
        """The router's index recorded ``host`` for a prompt of chain ``hashes``."""
        self._hosts.append(host)
        self._chains.append(pack_hashes(hashes))
        if len(self._hosts) >= self._batch_max:
            self.flush()
        elif self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(self._flush_s, self.flush)

    def flush(self) -> None:
        """Send the pending decisions as one batch, without waiting."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        hosts, chains = self._hosts, self._chains
        if not hosts or self._pub is None:
            return
        self._hosts, self._chains = [], []
        count = len(hosts)
        tag = settings_tag(self._router.config)
        batch = DecisionBatch(WIRE_VERSION, self._sender, self._published, tag, hosts, chains)
        self._published += count
        sent = self._pub.send(encode_batch(batch), zmq.NOBLOCK)
        # Done at once with NOBLOCK: a result, or zmq.Again when the queue is full.
        error = sent.exception() if isinstance(sent, asyncio.Future) and sent.done() else None
        if error is None:
            metrics.DECISIONS_PUBLISHED.inc(count)
        else:
            self._drop("send_full", count)

    # --- receiving

    async def run(self) -> None:
        """Apply every batch the siblings send, until cancelled."""
        sub = self._sub
        if sub is None:
            return
        while True:
            data = await sub.recv()
            try:
                self.apply(data)
            except Exception:  # a bug must cost one message, not the exchange
                self._drop("malformed", 1)
                log.exception("decision_exchange_apply_failed")

    def apply(self, data: bytes) -> None:
        """Record one message's decisions in the index; drop and count what cannot be."""
        try:
            batch = decode_batch(data)
            chains = [unpack_hashes(chain) for chain in batch.chains]
        except MalformedBatch as error:
            self._drop("malformed", 1)
            log.debug("decision_exchange_malformed", error=str(error))
            return
        count = len(chains)
        self._follow(batch.sender, batch.first, count)
        router = self._router
        if batch.settings != settings_tag(router.config):
            self._drop("settings", count)
            return
        hosts, index, applied = router.hosts.addresses, router.index, 0
        # A picker with no pool of its own learns the endpoints from each request's subset
        # hint (kgateway): it takes a sibling's decision for any endpoint it has placed a
        # request on, since its own answers stay within each request's hint.
        known = index.host_sizes() if not hosts else {}
        for host, chain in zip(batch.hosts, chains, strict=True):
            if host in hosts or host in known:
                index.record_hashes(host, chain)
                applied += 1
        self.applied += applied
        metrics.SIBLING_DECISIONS_APPLIED.inc(applied)
        if applied < count:
            self._drop("unknown_host", count - applied)

    def _follow(self, sender: int, first: int, count: int) -> None:
        expected = self._expected.get(sender)
        if expected is not None and first > expected:
            self._drop("lost", first - expected)
        elif expected is None and len(self._expected) >= MAX_SENDERS:
            self._expected.clear()
        self._expected[sender] = first + count

    def _drop(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        metrics.SIBLING_DECISIONS_DROPPED.labels(reason).inc(count)

    def close(self) -> None:
        """Send what is pending, stop publishing, close the sockets."""
        index = self._router.index
        if index.on_record == self.publish:
            index.on_record = None
        with contextlib.suppress(zmq.ZMQError):
            self.flush()
        for socket in (self._pub, self._sub):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
