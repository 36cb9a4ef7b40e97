"""A logged record read as the router reads a prompt: the same chain, anchors and fixed
key at the logged block size; the same sharing of anchors at a multiple of it."""

import json
import random
from types import SimpleNamespace

import pytest

from extproc.adapter.traffic_log import read_records
from extproc.picker.blocks import chain_seed, prompt_blocks
from extproc.picker.keys import KeyMode, extract_key
from extproc.picker.placement import key_digest
from extproc.replay.recorded import fixed_key_digest, recorded_blocks

from .logs import record_log

SYSTEM = "You are a careful assistant who answers from the documents given. " * 12


def conversation(user: str, turns: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{user} question {turn} " * 9})
        messages.append({"role": "assistant", "content": f"answer {turn} to {user} " * 30})
    return chat_messages(messages)


def chat_messages(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def chat(text: str) -> bytes:
    return chat_messages([{"role": "user", "content": text}])


def logged(tmp_path, bodies, **settings):  # type: ignore[no-untyped-def]
    requests = [
        SimpleNamespace(body=json.loads(body), headers={}, at_s=float(at))
        for at, body in enumerate(bodies)
    ]
    path = record_log(tmp_path / "traffic.log", requests, **settings)
    return list(read_records(path))


def router_blocks(body: bytes, block_bytes: int):  # type: ignore[no-untyped-def]
    key = extract_key(body, {}, KeyMode.OPENAI, 65536)
    return prompt_blocks(key.key, block_bytes, chain_seed(key.model, key.salt), key.segments)


def test_at_the_logged_block_size_the_record_is_the_routers_prompt(tmp_path):
    bodies = [conversation("ada", 2), chat("a document " * 300)]
    for body, record in zip(bodies, logged(tmp_path, bodies, block_bytes=64), strict=True):
        blocks, replayed = router_blocks(body, 64), recorded_blocks(record)
        assert replayed.hashes == blocks.hashes and replayed.whole == blocks.whole
        assert replayed.length == blocks.length and replayed.block_bytes == 64
        assert [replayed.anchor(d) for d in range(blocks.depth + 1)] == blocks.anchors()
        assert record.ends == blocks.segments


@pytest.mark.parametrize("multiple", [2, 4, 8])
def test_at_a_multiple_prompts_share_an_anchor_where_the_routers_do(tmp_path, multiple):
    users = ["ada", "bob", "cy", "di"]
    bodies = [conversation(user, turns) for user in users for turns in (1, 2, 3)]
    records = logged(tmp_path, bodies, block_bytes=64)
    coarse = 64 * multiple
    routed = [router_blocks(body, coarse) for body in bodies]
    replayed = [recorded_blocks(record, multiple) for record in records]
    for blocks, view in zip(routed, replayed, strict=True):
        assert view.hashes == view.hashes[: blocks.depth] and view.depth == blocks.depth
        assert view.block_bytes == coarse
    for depth in range(3):
        for i in range(len(bodies)):
            for j in range(len(bodies)):
                if depth > min(routed[i].depth, routed[j].depth):
                    continue
                same_router = routed[i].anchor(depth) == routed[j].anchor(depth)
                same_replay = replayed[i].anchor(depth) == replayed[j].anchor(depth)
                assert same_router == same_replay, (depth, i, j)


def test_the_fixed_key_is_the_routers_digest_where_it_logged_one(tmp_path):
    long, short = chat("long document text " * 800), chat("short question")
    records = logged(tmp_path, [long, short], prefix_length=8192)
    for body, record in zip([long, short], records, strict=True):
        key = extract_key(body, {}, KeyMode.OPENAI, 8192)
        assert record.fixed == (key_digest(key.key, key.salt), 8192)
        assert fixed_key_digest(record, 8192) == key_digest(key.key, key.salt)
    # At another prefix_length: the chain's hash within it, the whole prompt if shorter.
    assert fixed_key_digest(records[0], 4096) == records[0].hashes[4096 // 512 - 1]
    assert fixed_key_digest(records[1], 4096) == records[1].whole


def test_prefix_aware_by_longest_match_logs_no_fixed_key(tmp_path):
    (record,) = logged(tmp_path, [chat("text " * 400)], routing_strategy="PREFIX_AWARE")
    assert record.fixed is None
    assert fixed_key_digest(record, 1024) == record.hashes[1024 // 512 - 1]


def test_random_draws_do_not_change_what_is_logged(tmp_path):
    body = conversation("ada", 2)
    first = logged(tmp_path / "a", [body])
    random.seed(7)
    second = logged(tmp_path / "b", [body])
    assert first[0].hashes == second[0].hashes and first[0].anchors == second[0].anchors


@pytest.mark.parametrize("key_mode", ["openai", "native"])
def test_the_logged_fixed_key_is_the_one_read_to_prefix_length(tmp_path, key_mode):
    # The router reads the prompt once, as deep as matching goes, and cuts the fixed key
    # from it where the key says its first prefix_length characters end (beyond ASCII,
    # characters are not bytes).
    bodies = [chat("ascii text " * 900), chat("texte accentué, 漢字 " * 700), chat("short")]
    records = logged(tmp_path, bodies, prefix_length=4096, key_mode=key_mode)
    for body, record in zip(bodies, records, strict=True):
        key = extract_key(body, {}, KeyMode(key_mode), 4096)
        assert record.fixed == (key_digest(key.key, key.salt), 4096)
