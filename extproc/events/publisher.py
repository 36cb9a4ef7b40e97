"""vLLM's KV-event publisher protocol, for the simulator and the tests.

The same protocol as vLLM 0.32's ``ZmqEventPublisher``, so a subscriber cannot tell the
two apart:

* a PUB socket; every message is three frames ``[topic, seq, payload]``: ``seq`` is an
  8-byte big-endian counter from 0, ``payload`` a msgpack ``EventBatch`` (``wire.py``);
* a ROUTER replay socket; a request ``[identity, b"", start]`` (``start`` 8 bytes
  big-endian) is answered with every buffered batch whose ``seq >= start``, each as
  ``[identity, b"", topic, seq, payload]``, then the end marker
  ``[identity, b"", b"", (-1 as 8 signed bytes), b""]``;
* a bounded buffer of the last ``buffer_batches`` batches for that replay.

Where we differ from vLLM, and why:

* **We always bind.** vLLM binds an endpoint with ``*`` or ``::`` (``tcp://*:5557``: all
  interfaces) and *connects* to any other (``tcp://10.0.0.5:5557``), expecting the
  consumer to bind. A simulated engine is a server like any other, so
  ``tcp://127.0.0.1:0`` binds loopback on a free port here; ``endpoint`` and
  ``replay_endpoint`` give the address actually bound.
* **The replay socket's send queue holds a whole buffer.** vLLM leaves ROUTER's send
  high-water mark at zmq's default (1000 messages), so a replay of more batches than a
  slow reader takes in stride is cut short without notice; we raise it to the buffer's
  size, per reader.
* **Publishing never blocks.** vLLM's ``publish`` puts onto a bounded queue and blocks when
  it is full. Ours numbers and buffers the batch at once (so replay always has it) and
  hands the send to the socket thread through a bounded queue; if that queue overflows the
  oldest unsent batches are dropped from PUB, as a PUB high-water mark would: subscribers
  see a gap and fill it from replay.

One thread owns both sockets (zmq sockets are not thread-safe); ``publish`` wakes it
through a pipe, so replay requests and sends are served at once rather than on a timer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

import zmq

from extproc.events.wire import EventBatch, KvEvent, encode_batch

__all__ = ["END_SEQ", "EventPublisher", "encode_seq"]

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_MAX_PENDING_SENDS: Final = 100_000
_POLL_MS: Final = 1_000  # the thread re-checks ``closed`` at least this often


def encode_seq(seq: int) -> bytes:
    """A sequence number as vLLM frames it: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


class EventPublisher:
    """A PUB + replay ROUTER pair speaking vLLM's KV-event protocol."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        buffer_batches: int = 10_000,
    ) -> None:
        self._topic = topic.encode("utf-8")
        self._lock = threading.Lock()  # guards _seq, _buffer, _pending
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._pending: deque[tuple[int, bytes]] = deque(maxlen=_MAX_PENDING_SENDS)
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        try:
            self._endpoint = _bind(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.set_hwm(buffer_batches + 1)
                self._replay_endpoint: str | None = _bind(self._replay, replay_endpoint)
            else:
                self._replay_endpoint = None
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._serve, name="kv-event-publisher")
        self._thread.daemon = True
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB address bound (the real port when asked for port 0)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER address bound, or ``None`` without replay."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next ``publish`` will use."""
        with self._lock:
            return self._seq

    def publish(
        self, events: Sequence[KvEvent], ts: float | None = None, *, send: bool = True
    ) -> int:
        """Number, buffer and queue one batch; return its sequence number.

        Cheap and non-blocking, safe from any thread (an asyncio loop's included).
        ``send=False`` buffers the batch for replay without sending it on PUB: a test's
        way to make a gap the subscriber must fill."""
        batch = EventBatch(ts=time.time() if ts is None else ts, events=list(events))
        payload = encode_batch(batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("publisher is closed")
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if send:
                self._pending.append((seq, payload))
        self._wake()
        return seq

    def close(self) -> None:
        """Stop the thread and close both sockets at once (linger 0: unsent is dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        # A full pipe means the thread has wake-ups pending already.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._closed:
                ready = dict(poller.poll(_POLL_MS))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                self._send_pending()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
        finally:
            self._close_sockets()

    def _send_pending(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                seq, payload = self._pending.popleft()
            # PUB never blocks: past its high-water mark zmq drops, like vLLM's.
            self._pub.send_multipart((self._topic, encode_seq(seq), payload))

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(100):  # bounded per wake-up, so sends are not starved
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:  # vLLM logs and ignores a malformed request
                continue
            identity, _, start_bytes = frames
            self._answer(identity, int.from_bytes(start_bytes, "big"))

    def _answer(self, identity: bytes, start: int) -> None:
        assert self._replay is not None
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            self._replay.send_multipart((identity, b"", self._topic, encode_seq(seq), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the address bound; an IPv6 endpoint turns on zmq's IPv6."""
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(bound, bytes)
    return bound.decode()
