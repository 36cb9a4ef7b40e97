"""The wire format against vLLM 0.32's own classes and publisher.

vLLM takes ~10 s to import, so one vLLM process serves the whole module: it answers JSON
commands on stdin (decode our bytes, encode its own, run its real ZmqEventPublisher)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.errors import RouterError
from extproc.events.subscriber import EventSource, HostEventStream
from extproc.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from extproc.stack.processes import wait_until_async

from ..vllm_install import wait_for_vllm_install

REPO = Path(__file__).resolve().parents[2]
MARK = "@@"  # vLLM logs on stdout too; our answers carry this prefix

VLLM_SIDE = r"""
import json, sys, time
import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher)

def answer(obj):
    print("@@" + json.dumps(obj), flush=True)

def samples():
    return [
        KVEventBatch(ts=1.25, events=[]),
        KVEventBatch(ts=2.5, data_parallel_rank=3, events=[
            BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                        token_ids=list(range(32)), block_size=16, lora_id=None,
                        medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU"),
            AllBlocksCleared()]),
        KVEventBatch(ts=3.0, events=[
            BlockStored(block_hashes=[2**64 - 1], parent_block_hash=7, token_ids=[1, 2],
                        block_size=2, lora_id=4, medium=None, lora_name="ad",
                        extra_keys=[("ad", "salt")], group_idx=1,
                        kv_cache_spec_kind="full", kv_cache_spec_sliding_window=128,
                        locality="LOCAL", ownership="tier2", session_id="s"),
            BlockRemoved(block_hashes=[9], medium="CPU", group_idx=1, locality="REMOTE",
                         ownership="tier2")]),
    ]

publisher = None
answer({"ready": True})
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "decode":
        out = []
        for h in cmd["hex"]:
            batch = msgspec.msgpack.decode(bytes.fromhex(h), type=KVEventBatch)
            out.append({"reencoded": msgspec.msgpack.encode(batch).hex(),
                        "types": [type(e).__name__ for e in batch.events]})
        answer(out)
    elif op == "encode":
        answer([msgspec.msgpack.encode(b).hex() for b in samples()])
    elif op == "publisher":
        publisher = ZmqEventPublisher(0, endpoint=cmd["endpoint"],
                                      replay_endpoint=cmd["replay"], topic=cmd["topic"])
        answer({"ok": True})
    elif op == "publish":
        for i in range(cmd["n"]):
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[cmd["first"] + i], parent_block_hash=None, token_ids=[i],
                block_size=1, lora_id=None, medium="GPU", lora_name=None)]))
        answer({"ok": True})
    elif op == "quit":
        if publisher is not None:
            publisher.shutdown()
        answer({"ok": True})
        break
"""


def _vllm_python() -> str | None:
    configured = os.environ.get("PREFIX_ROUTER_VLLM_PYTHON")
    if configured and Path(configured).exists():
        return configured
    local = REPO / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


class VllmSide:
    """The vLLM process: one JSON command in, one answer out."""

    def __init__(self, python: str) -> None:
        self._proc = subprocess.Popen(
            [python, "-c", VLLM_SIDE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._answer(timeout_s=120) == {"ready": True}

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK) :])

    def _answer(self, timeout_s: float = 30) -> Any:
        try:
            return json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"vLLM side silent (exit code {self._proc.poll()})") from None

    def ask(self, **cmd: Any) -> Any:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.ask(op="quit")
        finally:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            if self._proc.stdout is not None:
                self._proc.stdout.close()


@pytest.fixture(scope="module")
def vllm() -> Iterator[VllmSide]:
    wait_for_vllm_install()
    python = _vllm_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must cross-check the wire format: no .venv-vllm and no "
                "PREFIX_ROUTER_VLLM_PYTHON"
            )
        pytest.skip("no Python with vLLM (.venv-vllm or PREFIX_ROUTER_VLLM_PYTHON)")
    side = VllmSide(python)
    yield side
    side.close()


def _stored(hashes: list[bytes | int], **extra: Any) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(len(hashes))),
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **extra,
    )


EXAMPLES = [
    EventBatch(ts=0.0, events=[]),
    EventBatch(
        ts=1700000000.123,
        events=[_stored([b"\xaa" * 32, b"\xbb" * 32]), BlockRemoved([b"\xaa" * 32], "GPU")],
        data_parallel_rank=0,
    ),
    EventBatch(
        ts=5.5,
        events=[
            _stored([1, 2**64 - 1], extra_keys=[("lora",), None], group_idx=2, session_id="x"),
            BlockRemoved(block_hashes=[3], medium=None, locality="LOCAL"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=7,
    ),
]


# --- our own format --------------------------------------------------------------------


@pytest.mark.parametrize("batch", EXAMPLES)
def test_round_trip(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


def test_batch_is_an_array_and_events_are_tagged_maps() -> None:
    raw = msgspec.msgpack.decode(encode_batch(EXAMPLES[2]))
    ts, events, rank = raw
    assert (ts, rank) == (5.5, 7)
    assert events[0]["type"] == "BlockStored"
    assert "ownership" not in events[0]  # defaults are omitted
    assert events[2] == {"type": "AllBlocksCleared"}
    # An unset rank is still sent: msgspec omits no default from an array-like struct.
    assert msgspec.msgpack.decode(encode_batch(EXAMPLES[0])) == [0.0, [], None]


def test_fields_from_a_newer_vllm_are_ignored() -> None:
    newer = [
        1.0,
        [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "new_field": [1, 2]}],
        None,
        "a trailing batch field",
    ]
    batch = decode_batch(msgspec.msgpack.encode(newer))
    assert batch.events == [BlockRemoved(block_hashes=[1], medium=None)]


def test_an_unknown_event_type_makes_the_batch_undecodable() -> None:
    newer = [1.0, [{"type": "BlockMoved", "block_hashes": [1]}], None]
    with pytest.raises(EventDecodeError, match="BlockMoved"):
        decode_batch(msgspec.msgpack.encode(newer))


GOOD = encode_batch(EXAMPLES[1])


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1garbage", id="garbage"),
        pytest.param(GOOD[: len(GOOD) // 2], id="truncated"),
        pytest.param(GOOD + b"\x00", id="trailing"),
        pytest.param(msgspec.msgpack.encode({"ts": 1.0, "events": []}), id="map-batch"),
        pytest.param(msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), id="untagged"),
        pytest.param(msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), id="missing"),
        pytest.param(msgspec.msgpack.encode(["x", []]), id="bad-ts"),
    ],
)
def test_malformed_payloads_raise_event_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError) as caught:
        decode_batch(payload)
    assert isinstance(caught.value, RouterError)


_hashes = st.lists(st.one_of(st.binary(max_size=32), st.integers(0, 2**64 - 1)), max_size=4)
_opt_str = st.none() | st.text(max_size=8)
_opt_int = st.none() | st.integers(-(2**63), 2**64 - 1)
_stored_events = st.builds(
    BlockStored,
    block_hashes=_hashes,
    parent_block_hash=st.none() | st.binary(max_size=32) | st.integers(0, 2**64 - 1),
    token_ids=st.lists(st.integers(0, 2**31), max_size=8),
    block_size=st.integers(1, 1024),
    lora_id=_opt_int,
    medium=_opt_str,
    lora_name=_opt_str,
    extra_keys=st.none()
    | st.lists(
        st.none() | st.tuples(st.text(max_size=4), st.integers(-(2**63), 2**64 - 1)), max_size=3
    ),
    group_idx=_opt_int,
    kv_cache_spec_kind=_opt_str,
    kv_cache_spec_sliding_window=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
    session_id=_opt_str,
)
_removed_events = st.builds(
    BlockRemoved,
    block_hashes=_hashes,
    medium=_opt_str,
    group_idx=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
)
_batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(
        st.one_of(_stored_events, _removed_events, st.just(AllBlocksCleared())), max_size=5
    ),
    data_parallel_rank=_opt_int,
)


@settings(max_examples=200, deadline=None)
@given(_batches)
def test_round_trip_property(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


# --- against vLLM ----------------------------------------------------------------------


def test_vllm_reads_our_bytes_and_writes_them_back_unchanged(vllm: VllmSide) -> None:
    ours = [encode_batch(batch) for batch in EXAMPLES]
    answers = vllm.ask(op="decode", hex=[payload.hex() for payload in ours])
    assert [bytes.fromhex(a["reencoded"]) for a in answers] == ours
    assert answers[2]["types"] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_we_read_vllms_bytes_and_write_them_back_unchanged(vllm: VllmSide) -> None:
    theirs = [bytes.fromhex(h) for h in vllm.ask(op="encode")]
    batches = [decode_batch(payload) for payload in theirs]
    assert [encode_batch(batch) for batch in batches] == theirs
    stored = batches[2].events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**64 - 1]
    assert stored.extra_keys == [("ad", "salt")]
    assert stored.session_id == "s"
    assert batches[1].data_parallel_rank == 3


class _Recorder:
    def __init__(self) -> None:
        self.events: list[BlockStored] = []

    def stored_hashes(self) -> list[bytes | int]:
        return [h for event in self.events for h in event.block_hashes]

    def stored(self, host: str, event: BlockStored) -> None:
        self.events.append(event)

    def removed(self, host: str, event: BlockRemoved) -> None:
        pass

    def cleared(self, host: str, reason: str) -> None:
        pass

    def live(self, host: str, live: bool) -> None:
        pass


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    await wait_until_async(condition, timeout_s, interval_s=0.02)


@pytest.mark.skipif(sys.platform == "win32", reason="ipc:// endpoints")
async def test_our_subscriber_follows_vllms_publisher(vllm: VllmSide, tmp_path: Path) -> None:
    # ipc:// keeps it local: vLLM binds only `*`, `::` and ipc endpoints.
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    assert vllm.ask(op="publisher", endpoint=pub, replay=replay, topic="kv") == {"ok": True}
    vllm.ask(op="publish", n=5, first=100)  # before we join: only replay can tell us
    sink = _Recorder()
    stream = HostEventStream(EventSource("engine:8000", pub, replay, "kv"), sink)
    task = asyncio.create_task(stream.run())
    try:
        await _until(lambda: len(sink.events) == 5)
        vllm.ask(op="publish", n=3, first=200)
        await _until(lambda: len(sink.events) == 8)
        assert sink.stored_hashes() == [100, 101, 102, 103, 104, 200, 201, 202]
        assert stream.stats.replayed_batches >= 5
        assert stream.stats.lost_batches == stream.stats.decode_errors == 0
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
