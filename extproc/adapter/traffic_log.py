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
  replay places a new prefix as the router did without the text.

Records are JSON lines, built and written off the event loop by a ``QueueHandler`` and a
listener thread (the request only queues what it saw; the prompt's text stays in memory
until its record is built, and is never written), into files that
``RotatingFileHandler`` rotates at ``max_bytes``, keeping ``files`` of them: the log never
holds more than ``files`` x ``max_bytes``. A record the queue cannot take is dropped and
counted (``prefix_router_traffic_log_dropped_total``). ``read_records`` streams them back,
oldest file first, for ``prefix-router replay``.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from extproc import metrics
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


def record_of(
    blocks: PromptBlocks, model: str | None, salt: str | None, when: float
) -> dict[str, Any]:
    return {
        "t": round(when, 3),
        "model": model,
        "salt": salt_digest(salt),
        "block_bytes": blocks.block_bytes,
        "bytes": blocks.length,
        "chars": len(blocks.key.decode("utf-8", "replace")),
        "seed": blocks.seed,
        "hashes": list(blocks.hashes),
        "whole": blocks.whole,
        "anchors": blocks.anchors(),
    }


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
        return json.dumps(record_of(*record.msg), separators=(",", ":"))


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

    @property
    def dropped(self) -> int:
        return self._handler.dropped

    def write(self, blocks: PromptBlocks, model: str | None, salt: str | None) -> None:
        record = logging.LogRecord("traffic", logging.INFO, "", 0, None, None, None)
        record.msg = (blocks, model, salt, self._clock())
        self._handler.enqueue(record)

    def close(self) -> None:
        """Write what is queued, then close the file."""
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


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every record, oldest first, one line at a time (a log is never loaded whole). A
    line cut short by a crash, or not a record, is skipped."""
    for file in log_files(path):
        with file.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("hashes"), list):
                    yield record
