import json

import pytest

from extproc.sim.request import CompletionRequest, parse_request


def parse(body: object, *, default: int = 16, cap: int = 100) -> CompletionRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request("completion", raw, default_max_tokens=default, max_tokens_cap=cap)


def test_defaults() -> None:
    assert parse({"prompt": "hi"}) == CompletionRequest(
        prompt="hi", max_tokens=16, stream=False, include_usage=False
    )


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse({"prompt": "x", "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert parse({"prompt": "x", "max_completion_tokens": None, "max_tokens": 9}).max_tokens == 9


def test_max_tokens_is_capped() -> None:
    assert parse({"prompt": "x", "max_tokens": 5000}, cap=100).max_tokens == 100


def test_stream_flags() -> None:
    parsed = parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert (parsed.stream, parsed.include_usage) == (True, True)
    assert parse({"prompt": "x", "stream": None}).stream is False


def test_accepts_utf8_text_and_json_escapes() -> None:
    assert parse('{"prompt": "héllo \\ud83d\\ude00"}'.encode()).prompt == "héllo 😀"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "empty"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b"null", "JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": ' + b"9" * 10_000 + b"}", "JSON"),
        (b'{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
        (b'{"prompt": "x", "max_tokens": "3"}', "'max_tokens' must be a positive integer"),
        (b'{"prompt": "x", "max_tokens": 2.0}', "'max_tokens' must be a positive integer"),
        (b'{"prompt": "x", "max_completion_tokens": true}', "'max_completion_tokens'"),
        (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean"),
        (b'{"prompt": "x", "stream_options": []}', "'stream_options' must be an object"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
            "'stream_options.include_usage' must be a boolean",
        ),
        (b'{"prompt": 3}', "'prompt' must be"),
        # vLLM's checks on cache_salt, with its messages.
        (b'{"prompt": "x", "cache_salt": ""}', "'cache_salt' must be a non-empty string"),
        (b'{"prompt": "x", "cache_salt": 7}', "'cache_salt' must be a non-empty string"),
        (b'{"prompt": "x", "cache_salt": "a/b"}', "'cache_salt' must be at most 128"),
        (b'{"prompt": "x", "cache_salt": "' + b"s" * 129 + b'"}', "at most 128 characters"),
    ],
)
def test_bad_bodies_raise_value_error(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(raw)


def test_cache_salt_is_carried() -> None:
    assert parse({"prompt": "x", "cache_salt": "tenant-1"}).cache_salt == "tenant-1"
    assert parse({"prompt": "x", "cache_salt": None}).cache_salt is None
    assert parse({"prompt": "x"}).cache_salt is None
