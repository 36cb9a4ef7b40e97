"""The traffic log: one record per routed request, holding no prompt text.

A record is what the prefix index sees of a prompt, and nothing it does not need:

- ``t``: Unix time in seconds (milliseconds kept);
- ``model``: the model or LoRA adapter the body names, or null;
- ``salt``: a 64-bit hash of the tenant salt (hex), or null; the salt itself is never
  written;
- ``block_bytes``, ``bytes``, ``chars``: the block size, and the prompt's length in bytes
  and in characters;
- ``seed``, ``hashes``, ``whole``: the chain's seed, the chained block hashes and the
  whole-prompt hash (``picker/blocks.py``);
- ``anchors``: the placement anchor at every depth (``PromptBlocks.anchor``), so that a
  replay places a new prefix as the router did without the text;
- ``ends``: the byte offsets where the prompt's messages end (lengths, no text), so that a
  replay at a larger block size can tell where a message leaves too little for a block;
- ``fixed``: the digest of SageMaker's fixed-length key (the first ``prefix_length``
  characters, salted) and that ``prefix_length``, where the router computed it (under
  every strategy but PREFIX_AWARE by longest match), or null.

Records are JSON lines, built and written off the event loop by a ``QueueHandler`` and a
listener thread (the request only queues what it saw; the prompt's text stays in memory
until its record is built, and is never written), into files that
``RotatingFileHandler`` rotates at ``max_bytes``, keeping ``files`` of them: the log never
holds more than ``files`` x ``max_bytes``. A record the queue cannot take is dropped and
counted (``prefix_router_traffic_log_dropped_total``). ``read_records`` streams them back,
oldest file first, for ``prefix-router replay``.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from extproc.adapter import metrics
from extproc.picker.blocks import PromptBlocks

# A record the queue cannot take (the writer thread far behind) is dropped and counted,
# never waited for: the request matters more than its record.
QUEUE_RECORDS = 65_536


def salt_digest(salt: str | None) -> str | None:
    """The salt as the log keeps it: a hash, so tenants stay apart in a replay while their
    names stay out of the file. A guessable salt can still be guessed by hashing guesses."""
    if salt is None:
        return None
    return f"{xxhash.xxh3_64_intdigest(salt.encode('utf-8', 'surrogatepass')):016x}"


class TrafficRecord(msgspec.Struct, frozen=True):
    """One line of the log; msgspec checks every field's type as a line is read."""

    t: float
    model: str | None
    salt: str | None
    block_bytes: int
    bytes: int
    chars: int
    seed: int
    hashes: tuple[int, ...]
    whole: int
    anchors: tuple[int, ...]
    ends: tuple[int, ...] = ()
    # (digest, prefix_length) of the fixed-length key, where the router computed it.
    fixed: tuple[int, int] | None = None

    def well_formed(self) -> bool:
        """What the types cannot say: one anchor per depth, lengths that fit the blocks."""
        return (
            self.block_bytes >= 1
            and len(self.anchors) == len(self.hashes) + 1
            and len(self.hashes) * self.block_bytes <= self.bytes
            and self.chars >= 0
            and all(a < b for a, b in zip((0, *self.ends), self.ends, strict=False))
            and (not self.ends or self.ends[-1] <= self.bytes)
            and (self.fixed is None or self.fixed[1] >= 1)
        )


def record_of(
    blocks: PromptBlocks | Callable[[], PromptBlocks],
    model: str | None,
    salt: str | None,
    fixed: tuple[int, int] | None,
    when: float,
) -> TrafficRecord:
    if callable(blocks):  # the chain, hashed here, in the writer thread
        blocks = blocks()
    return TrafficRecord(
        t=round(when, 3),
        model=model,
        salt=salt_digest(salt),
        block_bytes=blocks.block_bytes,
        bytes=blocks.length,
        chars=len(blocks.key.decode("utf-8", "replace")),
        seed=blocks.seed,
        hashes=blocks.hashes,
        whole=blocks.whole,
        anchors=tuple(blocks.anchors()),
        ends=blocks.segments,
        fixed=fixed,
    )


class _Dropping(logging.handlers.QueueHandler):
    """A QueueHandler that drops a record when the queue is full instead of raising."""

    def __init__(self, records: queue.Queue[Any]) -> None:
        super().__init__(records)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            metrics.TRAFFIC_LOG_DROPPED.inc()

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # the message is serialised by the writer thread, not here


class _JsonLine(logging.Formatter):
    """Builds the record in the writer thread: the request only queued what it saw."""

    def format(self, record: logging.LogRecord) -> str:
        # RotatingFileHandler formats each record twice (to decide whether to rotate, then
        # to write it): build it once.
        line = getattr(record, "line", None)
        if line is None:
            line = record.line = _ENCODER.encode(record_of(*record.msg)).decode()
        return str(line)


_ENCODER = msgspec.json.Encoder()


class TrafficLog:
    """Appends records to ``path`` (rotated: ``path.1`` ... ``path.<files - 1>``)."""

    def __init__(self, path: Path, max_bytes: int, files: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=files - 1, encoding="utf-8"
        )
        writer.setFormatter(_JsonLine())
        self._writer = writer
        self._handler = _Dropping(queue.Queue(QUEUE_RECORDS))
        self._listener = logging.handlers.QueueListener(self._handler.queue, writer)
        self._listener.start()
        self._clock = time.time
        self._closed = False

    @property
    def dropped(self) -> int:
        return self._handler.dropped

    def write(
        self,
        blocks: PromptBlocks | Callable[[], PromptBlocks],
        model: str | None,
        salt: str | None,
        fixed: tuple[int, int] | None = None,
    ) -> None:
        record = logging.LogRecord("traffic", logging.INFO, "", 0, None, None, None)
        record.msg = (blocks, model, salt, fixed, self._clock())
        self._handler.enqueue(record)

    def close(self) -> None:
        """Write what is queued, then close the file; closing it again does nothing (its
        opener and the router that wrote to it may both close it)."""
        if self._closed:
            return
        self._closed = True
        self._listener.stop()
        self._writer.close()


def log_files(path: Path) -> list[Path]:
    """The log's files, oldest first: ``path.N`` ... ``path.1``, then ``path``."""
    rotated = []
    for candidate in path.parent.glob(path.name + ".*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), candidate))
    ordered = [p for _, p in sorted(rotated, reverse=True)]
    return [*ordered, path] if path.exists() else ordered


class RecordReader:
    """Every record of a log, oldest file first, one line at a time (a log is never
    loaded whole). A line cut short by a crash, or not a well-formed record, is skipped
    and counted in ``skipped``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.skipped = 0

    def __iter__(self) -> Iterator[TrafficRecord]:
        decode = msgspec.json.Decoder(TrafficRecord).decode
        for file in log_files(self.path):
            with file.open("rb") as lines:
                for line in lines:
                    try:
                        record = decode(line)
                    except msgspec.DecodeError:  # validation errors included
                        self.skipped += 1
                        continue
                    if record.well_formed():
                        yield record
                    else:
                        self.skipped += 1


def read_records(path: Path) -> Iterator[TrafficRecord]:
    return iter(RecordReader(path))
