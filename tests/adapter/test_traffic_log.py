"""The traffic log: what a record holds (and never holds), rotation, and reading back."""

from __future__ import annotations

import base64
import json
import random

import pytest

from extproc.adapter.routing import Router
from extproc.adapter.traffic_log import TrafficLog, log_files, read_records, salt_digest
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
    return Router(config, random.Random(1), traffic_log=log), log


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
    assert record["hashes"] == list(blocks.hashes) and len(record["hashes"]) > 3
    assert record["seed"] == blocks.seed and record["whole"] == blocks.whole
    assert record["anchors"] == [blocks.anchor(d) for d in range(blocks.depth + 1)]
    assert (record["bytes"], record["chars"]) == (len(key.key), len(key.key.decode()))
    assert record["model"] == "m" and record["salt"] == salt_digest(SECRET_SALT)
    assert record["block_bytes"] == 512 and record["t"] > 1.7e9


def test_the_log_rotates_and_never_holds_more_than_its_bound(tmp_path):
    log = TrafficLog(tmp_path / "traffic.log", max_bytes=64 * 1024, files=3)
    router = Router(RouterConfig(hosts=HOSTS), random.Random(1), traffic_log=log)
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
    times = [r["t"] for r in records]
    assert times == sorted(times)  # oldest file first


def test_reading_skips_a_line_cut_short(tmp_path):
    path = tmp_path / "traffic.log"
    path.write_text('{"hashes": [1, 2], "t": 1}\n{"hashes": [3\nnot json\n[]\n')
    assert [r["hashes"] for r in read_records(path)] == [[1, 2]]


def test_the_path_must_be_absolute():
    with pytest.raises(ConfigError, match="traffic_log"):
        load_config(env={}, overrides={"hosts": HOSTS, "traffic_log": "relative/traffic.log"})
