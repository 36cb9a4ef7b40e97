"""The traffic log: what a record holds (and never holds), rotation, and reading back."""

from __future__ import annotations

import base64
import json
import random

import pytest

from extproc.adapter.observers import TrafficLogObserver
from extproc.adapter.routing import Router
from extproc.adapter.traffic_log import (
    RecordReader,
    TrafficLog,
    log_files,
    read_records,
    salt_digest,
)
from extproc.config import RouterConfig, load_config
from extproc.errors import ConfigError
from extproc.picker.blocks import chain_seed, prompt_blocks
from extproc.picker.decide import Strategy
from extproc.picker.keys import KeyMode, extract_key

HOSTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")
SECRET_TEXT = "the quarterly numbers of ACME-7731 are confidential"
SECRET_SALT = "tenant-blue-7731"


def chat(text: str, **extra: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


def logged_router(tmp_path, **settings) -> tuple[Router, TrafficLog]:
    log = TrafficLog(tmp_path / "traffic.log", max_bytes=1024 * 1024, files=3)
    config = RouterConfig(hosts=HOSTS, **settings)
    return Router(config, random.Random(1), observers=(TrafficLogObserver(log),)), log


@pytest.mark.parametrize("strategy", list(Strategy))
def test_a_record_holds_the_chain_and_lengths_but_no_text_and_no_salt(tmp_path, strategy):
    router, log = logged_router(tmp_path, routing_strategy=strategy)
    body = chat(SECRET_TEXT * 80, prompt_cache_key=SECRET_SALT)
    router.finish(router.route({"content-type": "application/json"}, body))
    log.close()
    raw = b"".join(p.read_bytes() for p in log_files(tmp_path / "traffic.log"))
    for secret in (SECRET_TEXT, SECRET_SALT, "ACME", "confidential"):
        for form in (secret.encode(), base64.b64encode(secret.encode())):
            assert form not in raw
    (record,) = read_records(tmp_path / "traffic.log")
    key = extract_key(body, {}, KeyMode.OPENAI, 65536)
    blocks = prompt_blocks(key.key, 512, chain_seed(key.model, key.salt), key.segments)
    assert record.hashes == blocks.hashes and len(record.hashes) > 3
    assert record.seed == blocks.seed and record.whole == blocks.whole
    assert record.anchors == tuple(blocks.anchor(d) for d in range(blocks.depth + 1))
    assert (record.bytes, record.chars) == (len(key.key), len(key.key.decode()))
    assert record.model == "m" and record.salt == salt_digest(SECRET_SALT)
    assert record.block_bytes == 512 and record.t > 1.7e9


def test_the_log_rotates_and_never_holds_more_than_its_bound(tmp_path):
    log = TrafficLog(tmp_path / "traffic.log", max_bytes=64 * 1024, files=3)
    router = Router(
        RouterConfig(hosts=HOSTS), random.Random(1), observers=(TrafficLogObserver(log),)
    )
    for number in range(600):  # about 600 kB of records
        body = chat(f"document {number} " + "text of the document " * 200)
        router.finish(router.route({}, body))
    log.close()
    files = log_files(tmp_path / "traffic.log")
    assert len(files) == 3
    assert all(p.stat().st_size <= 64 * 1024 for p in files)
    records = list(read_records(tmp_path / "traffic.log"))
    assert 0 < len(records) < 600  # the oldest rotated away
    assert log.dropped == 0
    times = [r.t for r in records]
    assert times == sorted(times)  # oldest file first


def test_reading_skips_what_is_not_a_well_formed_record_and_counts_it(tmp_path):
    good = {
        "t": 1.5, "model": None, "salt": None, "block_bytes": 4, "bytes": 9, "chars": 9,
        "seed": 0, "hashes": [1, 2], "whole": 3, "anchors": [1, 2, 4], "ends": [5, 9],
        "fixed": [77, 1024],
    }  # fmt: skip
    lines = [
        json.dumps(good),
        json.dumps(good)[:40],  # cut short by a crash
        "not json",
        "[]",
        json.dumps({**good, "hashes": "12"}),  # a field of the wrong type
        json.dumps({**good, "anchors": [1]}),  # an anchor short
        json.dumps({**good, "bytes": 4}),  # shorter than its blocks
        json.dumps({k: v for k, v in good.items() if k != "seed"}),  # a field missing
        json.dumps({**good, "ends": [9, 5]}),  # message ends out of order
        json.dumps({**good, "ends": [5, 10]}),  # a message ending past the prompt
        json.dumps({**good, "fixed": [77, 0]}),  # a fixed key of no length
        "\xff\xfe",
    ]
    path = tmp_path / "traffic.log"
    path.write_text("\n".join(lines) + "\n", errors="surrogateescape")
    reader = RecordReader(path)
    assert [(r.hashes, r.ends, r.fixed) for r in reader] == [((1, 2), (5, 9), (77, 1024))]
    assert reader.skipped == len(lines) - 1


def test_the_path_must_be_absolute():
    with pytest.raises(ConfigError, match="traffic_log"):
        load_config(env={}, overrides={"hosts": HOSTS, "traffic_log": "relative/traffic.log"})


def test_each_record_is_built_once(tmp_path, monkeypatch):
    # RotatingFileHandler formats a record twice (to decide whether to rotate, then to
    # write): the chain is hashed and the line encoded once all the same.
    from extproc.adapter import traffic_log

    built = []
    real = traffic_log.record_of
    monkeypatch.setattr(traffic_log, "record_of", lambda *a: built.append(1) or real(*a))
    router, log = logged_router(tmp_path, routing_strategy=Strategy.RANDOM)
    for n in range(5):
        router.finish(router.route({}, chat(f"document {n} " * 100)))
    log.close()
    assert len(built) == 5 == len(list(read_records(tmp_path / "traffic.log")))
