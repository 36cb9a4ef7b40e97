"""A subscription to one engine's KV-event stream that knows when it can be trusted.

A PUB/SUB stream by itself is not a record of what an engine holds: zmq drops messages past
a high-water mark, reconnects behind our back, and a restarted engine starts counting from
0 with an empty cache. So every batch is applied strictly in sequence order, and whenever
that order cannot be kept the sink is told to forget the host (``cleared``), because a
missed ``BlockRemoved`` would leave us believing in blocks the engine no longer has.

How each case is told apart (vLLM's protocol carries nothing but the sequence number):

* **Gap** (seq jumps past ``last + 1``): replay from ``last`` and apply what is missing in
  order before the live batch. While we wait, live messages queue in zmq's own SUB queue
  (``_SUB_HWM``, bounded); anything that overflows it is just another gap. A gap replay
  cannot fill (no replay socket, no answer, or the buffer no longer reaches back) clears
  the host with reason ``"gap"`` and counts ``lost_batches``.
* **Replay answers are lossy too.** vLLM's ROUTER keeps zmq's default send queue (1000
  messages) and drops the excess without notice: a 10,000-batch answer to a reader that
  falls behind arrives with holes, and often without its end marker (checked against
  vLLM 0.32). A hole after an answer's first batch, or a missing end marker, is therefore
  asked for again from where it broke (``replay_retries``, bounded); only a hole at the
  start of an answer means the buffer has rolled past it.
* **Restart**: SUB delivers one publisher's messages in order, so a seq at or below the
  last seq *SUB* delivered means a new publisher (``"restart"``). A seq at or below the last
  one *applied* but above the last one SUB delivered is a batch replay already gave us: a
  duplicate, skipped.
* **Anchor check**: every replay asks from the last applied seq, not the one after, and
  compares the batch it gets back with the payload we applied. The same bytes: the same
  publisher. Other bytes, or an empty answer (a publisher that has not reached our seq):
  a restart, even one that SUB's ordering alone would have missed.
* **Warm-up / late join**: on every (re)connection of SUB (zmq's socket monitor tells us)
  we run that replay; with nothing applied yet it asks from seq 0, so a late subscriber
  learns what the engine's buffer still holds. A buffer that no longer starts at 0 gives a
  partial warm-up (``partial_warmups``): we deliver what there is.
* **Silence**: an idle engine publishes nothing, so quiet alone cannot tell idle from
  dead. After ``silent_after_s / 2`` without a message we send the anchor replay as a
  probe; a live publisher answers at once (its end marker, plus any batch we missed at the
  tail). No answer within ``replay_timeout_s``, nothing heard for ``silent_after_s``, or a
  TCP disconnect make the host silent (``live(host, False)``); the next message or answer
  makes it live again. Without a replay socket only the quiet timer and disconnects count.
* **Bad payloads**: a frame set that is not ``[topic, seq, payload]`` is counted and
  ignored (the next good one shows any gap). A good seq whose payload does not decode is
  counted in ``decode_errors``; its events are lost, so the host is cleared
  (``"undecodable"``), and the stream goes on.

Memory: the SUB queue, one replay answer (applied as it streams in, never held whole), one
payload (the anchor). Each replay answer is bounded in count and each frame in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from extproc.events.publisher import END_SEQ, encode_seq
from extproc.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
)

__all__ = [
    "EventSink",
    "EventSource",
    "EventSubscriptions",
    "HostEventStream",
    "StreamStats",
]

log = structlog.get_logger("kv_events")

_SUB_HWM: Final = 10_000  # live batches zmq queues for us while a replay runs
_MAX_REPLAY_BATCHES: Final = 1_000_000  # an answer longer than this is not vLLM's
_DRAIN_PER_WAKE: Final = 1_000  # SUB messages handled before yielding to the loop
# Payload bytes decoded before the event loop gets a turn: about a millisecond of work, so
# a burst of events never holds an ext_proc answer back for long.
_BYTES_PER_WAKE: Final = 256 * 1024
_RECONNECT_IVL_MAX_MS: Final = 2_000  # zmq backs off from 100 ms to this while an engine is down
_REPLAY_ROUNDS: Final = 20  # asks per sync: each gets at least vLLM's 1000-message queue
_DEALER_HWM: Final = 20_000  # replay batches zmq takes in for us: twice vLLM's buffer
_PROBE_ONLY_SEQ: Final = 2**63 - 1  # a replay start no publisher has reached: liveness only


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one engine (one data-parallel rank) publishes its KV events.

    ``host`` is the engine as the router names it (``ip:port`` of its HTTP server); every
    sink call carries it. Ranks of one server share ``host``; ``key`` tells them apart."""

    host: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    data_parallel_rank: int = 0

    @property
    def key(self) -> str:
        """A name unique per publisher: ``host``, or ``host#dpN`` for rank N > 0."""
        rank = self.data_parallel_rank
        return self.host if rank == 0 else f"{self.host}#dp{rank}"


class EventSink(Protocol):
    """What consumes a host's events (the precise index). Called on the event loop."""

    def stored(self, host: str, event: BlockStored) -> None: ...

    def removed(self, host: str, event: BlockRemoved) -> None: ...

    def cleared(self, host: str, reason: str) -> None:
        """Forget everything of ``host``: ``"cleared"`` (AllBlocksCleared), ``"restart"``,
        ``"gap"`` (batches lost for good) or ``"undecodable"``."""

    def live(self, host: str, live: bool) -> None:
        """``False`` once the host is silent or disconnected, ``True`` when heard again."""


@dataclass(slots=True)
class StreamStats:
    """Counters of one stream; ``EventSubscriptions.stats`` hands out copies."""

    batches: int = 0  # applied, live or replayed, undecodable ones excluded
    events: int = 0
    gaps: int = 0  # live seq jumps
    replayed_batches: int = 0
    lost_batches: int = 0
    restarts: int = 0
    clears: int = 0  # cleared() calls, whatever the reason
    silences: int = 0
    decode_errors: int = 0
    partial_warmups: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    replay_retries: int = 0  # answers cut short in transit, asked for again
    last_event_monotonic: float | None = None  # time.monotonic() of the last batch applied


class _NoAnswer(Exception):
    """The replay socket did not answer in time (internal)."""


class HostEventStream:
    """SUB + replay DEALER for one publisher; see the module docstring for the rules."""

    def __init__(
        self,
        source: EventSource,
        sink: EventSink,
        *,
        silent_after_s: float = 10.0,
        replay_timeout_s: float = 2.0,
        warm_up: bool = True,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.source = source
        self.stats = StreamStats()
        self._sink = sink
        self._host = source.host
        self._topic = source.topic.encode("utf-8")
        self._silent_after_s = silent_after_s
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._warm_up = warm_up
        self._given_ctx = context
        # Sequence state.
        self._last: int | None = None  # last seq applied
        self._last_payload: bytes | None = None  # its bytes: the anchor
        self._live_seq: int | None = None  # last seq SUB delivered
        # Liveness.
        self._live: bool | None = None
        self._last_heard = time.monotonic()
        self._last_probe = self._last_heard
        self._sync_due = False
        # Sockets, made in run().
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None

    async def run(self) -> None:
        """Follow the stream until cancelled; sockets are closed on the way out."""
        try:
            self._open()
            while True:
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv_events_stream_failed", host=self._host)
            self._clear("failed")
            self._set_live(False)
            raise
        finally:
            self._close()

    # --- sockets -------------------------------------------------------------------

    def _open(self) -> None:
        self._last_heard = self._last_probe = time.monotonic()
        self._ctx = self._given_ctx or zmq.asyncio.Context()
        self._sub = sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, _SUB_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        _ipv6_if_needed(sub, self.source.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        self._new_dealer()

    def _new_dealer(self) -> None:
        """A fresh DEALER: after a timeout, a late answer must not pass for the next one."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        endpoint = self.source.replay_endpoint
        if endpoint is None or self._ctx is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, _DEALER_HWM)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        _ipv6_if_needed(dealer, endpoint)
        dealer.connect(endpoint)
        self._dealer = dealer

    def _close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._sub = self._monitor = self._dealer = None
        if self._ctx is not None and self._given_ctx is None:
            self._ctx.term()
        self._ctx = None

    # --- main loop -----------------------------------------------------------------

    async def _step(self) -> None:
        assert self._sub is not None and self._monitor is not None
        if self._sync_due:
            self._sync_due = False
            await self._sync(probe=True)
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        wait_s = max(0.0, self._next_timer() - time.monotonic())
        ready = dict(await poller.poll(timeout=int(wait_s * 1000) + 1))
        if self._monitor in ready:
            await self._on_monitor()
        if self._sub in ready:
            await self._drain_sub()
        await self._on_timers()

    def _next_timer(self) -> float:
        """When ``_on_timers`` has something to do next (at the latest, half a silence)."""
        half = self._silent_after_s / 2
        due = time.monotonic() + half
        if self._live is not False:
            due = min(due, self._last_heard + self._silent_after_s)
        if self._dealer is not None:
            due = min(due, max(self._last_heard, self._last_probe) + half)
        return due

    async def _on_timers(self) -> None:
        now = time.monotonic()
        half = self._silent_after_s / 2
        quiet = now - self._last_heard
        if self._dealer is not None and quiet >= half and now - self._last_probe >= half:
            self._last_probe = now
            await self._sync(probe=True)
            quiet = time.monotonic() - self._last_heard
        if quiet >= self._silent_after_s:
            self._set_live(False)

    async def _on_monitor(self) -> None:
        assert self._monitor is not None
        for _ in range(_DRAIN_PER_WAKE):
            try:
                frames = await self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._sync_due = self._dealer is not None
            elif event == zmq.EVENT_DISCONNECTED:
                self._set_live(False)

    async def _drain_sub(self) -> None:
        assert self._sub is not None
        taken = 0
        for _ in range(_DRAIN_PER_WAKE):
            try:
                frames = await self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_live(frames)
            taken += len(frames[-1])
            if taken >= _BYTES_PER_WAKE:  # the loop's requests go first: decoding waits
                taken = 0
                await asyncio.sleep(0)

    # --- live messages -------------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            return
        topic, seq_bytes, payload = frames
        if topic != self._topic:  # SUB matches prefixes: "kv" also gets "kv2"
            return
        seq = int.from_bytes(seq_bytes, "big")
        self._heard()
        if self._live_seq is not None and seq <= self._live_seq:
            self._restart(seq)
        if self._last is None and self._warm_up:
            await self._sync(probe=False)  # what came before, then this batch
        elif self._last is not None and seq > self._last + 1:
            self.stats.gaps += 1
            log.info("kv_events_gap", host=self._host, after=self._last, got=seq)
            await self._sync(probe=False)
        self._live_seq = seq
        self._apply_in_order(seq, payload, replayed=False)

    # --- replay --------------------------------------------------------------------

    async def _sync(self, *, probe: bool) -> None:
        """The anchor replay: from the last applied seq (or 0, or liveness only).

        An answer cut short (a hole after its first batch, or no end marker) is asked for
        again from where it broke, up to ``_REPLAY_ROUNDS`` times: vLLM's ROUTER drops
        what exceeds its send queue (1000 messages) without notice."""
        if self._dealer is None:
            return
        for _ in range(_REPLAY_ROUNDS):
            check = _AnchorCheck(self._last, self._last_payload)
            start = self._replay_start()
            try:
                await self._replay(start, functools.partial(self._on_replayed, check))
            except _NoAnswer:
                if check.first_seq is None:
                    if probe:
                        self._set_live(False)
                    return
                check.cut_short = True  # its end marker never came
            if check.anchor is not None and check.first_seq is None and not check.restarted:
                check.restarted = True  # the publisher has not reached our seq: a new one
                self._restart(None)
            if check.anchor is None and start == 0 and (check.first_seq or 0) > 0:
                self.stats.partial_warmups += 1
            if check.restarted and self._warm_up:
                continue  # last is None now: the next round warms up from 0
            if check.restarted or not check.cut_short:
                return
            self.stats.replay_retries += 1

    def _replay_start(self) -> int:
        if self._last is not None:
            return self._last
        return 0 if self._warm_up else _PROBE_ONLY_SEQ

    def _on_replayed(self, check: _AnchorCheck, seq: int, payload: bytes) -> None:
        first = check.first_seq is None
        if first:
            check.first_seq = seq
        if check.restarted:
            return  # the rest of an answer from a publisher we no longer follow
        if check.cut_short:
            return  # past a hole: the next round asks again
        if first and check.anchor is not None and seq == check.anchor:
            if payload != check.payload:
                check.restarted = True
                self._restart(None)
            return
        if not first and self._last is not None and seq > self._last + 1:
            check.cut_short = True  # dropped in transit, not rolled out of the buffer
            return
        self._apply_in_order(seq, payload, replayed=True)

    async def _replay(self, start: int, handle: Callable[[int, bytes], None]) -> None:
        """Ask for every buffered batch from ``start``; stream each to ``handle``."""
        assert self._dealer is not None
        self.stats.replay_requests += 1
        await self._dealer.send_multipart((b"", encode_seq(start)))
        for _ in range(_MAX_REPLAY_BATCHES):
            if not await self._dealer.poll(timeout=self._replay_timeout_ms):
                self.stats.replay_timeouts += 1
                self._new_dealer()
                raise _NoAnswer
            frames = await self._dealer.recv_multipart()
            self._heard()
            parsed = _parse_replay(frames)
            if parsed is None:
                self.stats.decode_errors += 1
            elif parsed[0] < 0:
                return
            else:
                handle(*parsed)
        self._new_dealer()
        raise _NoAnswer

    # --- applying ------------------------------------------------------------------

    def _apply_in_order(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        last = self._last
        if last is not None and seq <= last:
            return  # replay delivered it already
        if last is not None and seq > last + 1:
            self.stats.lost_batches += seq - last - 1
            log.warning("kv_events_lost", host=self._host, after=last, got=seq)
            self._clear("gap")
        self._last = seq
        self._last_payload = payload
        if replayed:
            self.stats.replayed_batches += 1
        self._deliver(payload)

    def _deliver(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("kv_events_undecodable", host=self._host, error=str(exc))
            self._clear("undecodable")
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._sink.stored(self._host, event)
            elif isinstance(event, BlockRemoved):
                self._sink.removed(self._host, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear("cleared")
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_event_monotonic = time.monotonic()

    def _restart(self, seq: int | None) -> None:
        self.stats.restarts += 1
        log.info("kv_events_restart", host=self._host, after=self._last, got=seq)
        self._last = self._last_payload = self._live_seq = None
        self._clear("restart")

    def _clear(self, reason: str) -> None:
        self.stats.clears += 1
        self._sink.cleared(self._host, reason)

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        self._set_live(True)

    def _set_live(self, live: bool) -> None:
        if self._live is live:
            return
        self._live = live
        if not live:
            self.stats.silences += 1
        self._sink.live(self._host, live)


@dataclass(slots=True)
class _AnchorCheck:
    """What one replay answer has shown so far."""

    anchor: int | None
    payload: bytes | None
    first_seq: int | None = None
    restarted: bool = False
    cut_short: bool = False


def _parse_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[b"", topic, seq, payload]`` (vLLM 0.32), or without the topic (vllm#45174);
    the end marker comes back as seq -1. ``None``: malformed."""
    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
        return None
    if frames[-2] == END_SEQ:
        return -1, b""
    return int.from_bytes(frames[-2], "big"), frames[-1]


def _ipv6_if_needed(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a failed stream's exception seen: ``run`` logged it, ``update`` restarts it."""
    if not task.cancelled():
        task.exception()


class EventSubscriptions:
    """One ``HostEventStream`` per event source of the current fleet, on one zmq context."""

    def __init__(self, sink: EventSink, **stream_options: Any) -> None:
        self._sink = sink
        self._options = stream_options
        self._ctx: zmq.asyncio.Context | None = None
        self._streams: dict[str, tuple[HostEventStream, asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def update(self, sources: Mapping[str, EventSource]) -> None:
        """Follow exactly ``sources``: start new ones, stop removed or changed ones, and
        start again any that failed.

        Call from the event loop. Keys are any stable names (``EventSource.key`` fits)."""
        for key in list(self._streams):
            stream, task = self._streams[key]
            if sources.get(key) != stream.source or task.done():  # done: it failed
                del self._streams[key]
                self._stop(task)
        for key, source in sources.items():
            if key not in self._streams:
                self._streams[key] = self._start(key, source)

    def stats(self) -> Mapping[str, StreamStats]:
        """A copy of every running stream's counters, by key."""
        return {key: replace(stream.stats) for key, (stream, _) in self._streams.items()}

    async def close(self) -> None:
        """Stop every stream and wait for its sockets to close."""
        for _, task in self._streams.values():
            self._stop(task)
        self._streams.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _start(self, key: str, source: EventSource) -> tuple[HostEventStream, asyncio.Task[None]]:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        stream = HostEventStream(source, self._sink, context=self._ctx, **self._options)
        task = asyncio.get_running_loop().create_task(stream.run(), name=f"kv-events {key}")
        task.add_done_callback(_retrieve)
        return stream, task

    def _stop(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
