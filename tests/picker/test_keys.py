"""Routing-key extraction: openai text, native bytes, salts, and bad input."""

from __future__ import annotations

import gzip
import json

from hypothesis import given
from hypothesis import strategies as st

from extproc.picker.keys import KeyMode, KeySource, extract_key, openai_prompt_text

OPENAI = KeyMode.OPENAI
NATIVE = KeyMode.NATIVE

text = st.text(min_size=0, max_size=200)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}
    ),
    min_size=1,
    max_size=6,
)


def chat(msgs, **extra) -> dict:
    return {"model": "m", "messages": msgs, **extra}


@given(messages, st.integers(min_value=0, max_value=4), st.booleans())
def test_openai_key_ignores_whitespace_and_key_order(msgs, indent, reverse):
    compact = json.dumps(chat(msgs), separators=(",", ":")).encode()
    reordered_msgs = [dict(reversed(list(m.items()))) if reverse else m for m in msgs]
    body = dict(reversed(list(chat(reordered_msgs, temperature=0.5).items())))
    spaced = json.dumps(body, indent=indent, ensure_ascii=reverse).encode()
    a = extract_key(compact, {}, OPENAI, 4096)
    b = extract_key(spaced, {}, OPENAI, 4096)
    assert a.source is b.source is KeySource.OPENAI
    assert a.key == b.key


def test_openai_key_is_the_first_prefix_length_characters_of_message_text():
    body = json.dumps(chat([{"role": "system", "content": "é" * 3000}])).encode()
    key = extract_key(body, {}, OPENAI, 1024)
    assert key.key.decode() == ("system\n" + "é" * 3000)[:1024]
    assert len(key.key.decode()) == 1024  # characters, not bytes


@given(
    messages,
    st.integers(min_value=0, max_value=300),
    st.sampled_from([OPENAI, NATIVE]),
    st.booleans(),
)
def test_a_deep_key_says_where_the_fixed_length_key_ends(msgs, fixed, mode, truncated):
    # One read serves the chain (read deep) and the fixed-length key: cut where the deep
    # key says, it is the key read fixed deep, non-ASCII text and cut bodies included.
    body = json.dumps(chat(msgs), ensure_ascii=False).encode()
    if truncated:
        body = body[: len(body) // 2]
    deep = extract_key(body, {}, mode, 1200, fixed_length=fixed)
    assert deep.fixed_bytes is not None
    assert deep.key[: deep.fixed_bytes] == extract_key(body, {}, mode, fixed).key
    assert extract_key(body, {}, mode, 1200).fixed_bytes is None  # only when asked for


def test_openai_key_covers_multipart_content_and_roles():
    msgs = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url"},
                {"type": "text", "text": "b"},
            ],
        },
    ]
    assert openai_prompt_text(chat(msgs)) == "system\nS\nuser\nab\n"
    swapped = [{"role": "user", "content": "S"}, msgs[1]]
    assert openai_prompt_text(chat(swapped)) != openai_prompt_text(chat(msgs))


def test_completions_prompt_is_the_key():
    assert openai_prompt_text({"prompt": "hello"}) == "hello"
    assert openai_prompt_text({"prompt": ["a", "b"]}) == "a\nb"


def test_truncated_body_keys_on_what_it_shows():
    full = json.dumps(chat([{"role": "user", "content": "x" * 5000 + "tail"}])).encode()
    cut = full[:3000]
    assert extract_key(cut, {}, OPENAI, 1024) == extract_key(full, {}, OPENAI, 1024)


def test_native_key_is_the_first_prefix_length_bytes():
    body = bytes(range(256)) * 20
    key = extract_key(body, {}, NATIVE, 1024)
    assert key.key == body[:1024]
    assert key.source is KeySource.NATIVE


def test_unparseable_bodies_fall_back_to_native_bytes():
    for body in [
        b"",
        b"not json",
        b"\xff\xfe\x00garbage",
        b'{"messages": 5}',
        b"[1,2,3]",
        b"\x00" * 100,
    ]:
        key = extract_key(body, {}, OPENAI, 1024)
        assert key.source is KeySource.NATIVE_FALLBACK
        assert key.key == body[:1024]


def test_compressed_bodies_are_never_inflated():
    body = gzip.compress(json.dumps(chat([{"role": "user", "content": "hi"}])).encode())
    key = extract_key(body, {"content-encoding": "gzip"}, OPENAI, 1024)
    assert key.source is KeySource.ENCODED_FALLBACK
    assert key.key == body[:1024]


def test_deeply_nested_json_falls_back_to_native_bytes():
    nested_list = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested_content = (
        b'{"messages": [{"role":"user","content":'
        + b'{"a":' * 100_000
        + b"1"
        + b"}" * 100_000
        + b"}]}"
    )
    for body in (nested_list, nested_content):
        key = extract_key(body, {}, OPENAI, 1024)
        assert key.source is KeySource.NATIVE_FALLBACK
        assert key.key == body[:1024]


@given(st.binary(max_size=2048), st.sampled_from([OPENAI, NATIVE]))
def test_any_bytes_get_a_key(body, mode):
    key = extract_key(body, {}, mode, 1024)
    assert isinstance(key.key, bytes)
    assert len(key.key) <= 1024 * 4


def test_salt_from_header_alias_and_body():
    body = json.dumps(
        chat([{"role": "user", "content": "x"}], prompt_cache_key="tenant-b")
    ).encode()
    assert extract_key(body, {"x-prefix-aware-id": "tenant-a"}, OPENAI, 1024).salt == "tenant-a"
    alias = {"x-amzn-sagemaker-prefix-aware-id": "tenant-c"}
    assert extract_key(body, alias, OPENAI, 1024).salt == "tenant-c"
    assert extract_key(body, {}, OPENAI, 1024).salt == "tenant-b"
    assert extract_key(b"raw", {"x-prefix-aware-id": "t"}, NATIVE, 1024).salt == "t"


def test_a_trusted_salt_header_is_the_only_salt():
    body = json.dumps(
        chat([{"role": "user", "content": "x"}], prompt_cache_key="from-client")
    ).encode()
    client = {"x-prefix-aware-id": "client-a", "x-amzn-sagemaker-prefix-aware-id": "client-b"}
    trusted = {**client, "x-tenant-id": "tenant-7"}
    assert extract_key(body, trusted, OPENAI, 1024, "x-tenant-id").salt == "tenant-7"
    # Without the trusted header: no salt at all, whatever the client sent.
    key = extract_key(body, client, OPENAI, 1024, "x-tenant-id")
    assert key.salt is None and key.salt_rejected is None
    assert extract_key(b"raw", trusted, NATIVE, 1024, "x-tenant-id").salt == "tenant-7"
    # A malformed value is refused and reported, as the client's are.
    bad = extract_key(body, {"x-tenant-id": "caf\u00e9"}, OPENAI, 1024, "x-tenant-id")
    assert bad.salt is None and bad.salt_rejected == "header x-tenant-id"


def test_bad_salts_are_ignored_and_reported():
    for value in ["", "x" * 65, "caf\u00e9", "tab\there", "nul\x00"]:
        key = extract_key(b"{}", {"x-prefix-aware-id": value}, OPENAI, 1024)
        assert key.salt is None
        assert key.salt_rejected == "header x-prefix-aware-id"
    body = json.dumps(chat([{"role": "user", "content": "x"}], prompt_cache_key=["no"])).encode()
    key = extract_key(body, {}, OPENAI, 1024)
    assert key.salt is None and key.salt_rejected == "body prompt_cache_key"
    assert extract_key(b"{}", {"x-prefix-aware-id": "x" * 64}, OPENAI, 1024).salt == "x" * 64
