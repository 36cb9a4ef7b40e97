"""Validate a raw completion request body into what the simulator needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from extproc.sim.prompt import PromptKind, prompt_text

# vLLM's limits on cache_salt (vllm/entrypoints/generate/base/protocol.py).
_CACHE_SALT_MAX_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    # vLLM's cache_salt: requests share cached blocks only when their salts match.
    cache_salt: str | None = None


def parse_request(
    kind: PromptKind, raw: bytes, *, default_max_tokens: int, max_tokens_cap: int
) -> CompletionRequest:
    """Parse and check a request body; any problem is a ValueError fit for a 400."""
    body = _json_object(raw)
    stream = _optional_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ValueError("'stream_options' must be an object")
    include_usage = _optional_bool(stream_options or {}, "include_usage", "stream_options.")
    return CompletionRequest(
        prompt=prompt_text(kind, body),
        max_tokens=min(_max_tokens(body, default_max_tokens), max_tokens_cap),
        stream=stream,
        include_usage=include_usage,
        cache_salt=_cache_salt(body.get("cache_salt")),
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise ValueError("request body is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"request body is not valid JSON: {exc.msg} at char {exc.pos}") from None
    except ValueError as exc:
        # e.g. an integer literal longer than Python's int-parsing limit.
        raise ValueError(f"request body is not acceptable JSON: {exc}") from None
    except RecursionError:
        # Absurdly deep nesting must not become a 500.
        raise ValueError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def _optional_bool(body: dict[str, Any], key: str, prefix: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"'{prefix}{key}' must be a boolean")
    return value


def _cache_salt(value: object) -> str | None:
    """vLLM's validate_cache_salt, with its messages."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(value) > _CACHE_SALT_MAX_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(value):
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL."
        )
    return value


def _max_tokens(body: dict[str, Any], default: int) -> int:
    # The newer name wins, as in the OpenAI API.
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"'{key}' must be a positive integer")
        return value
    return default
