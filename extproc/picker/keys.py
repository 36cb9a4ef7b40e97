"""Routing-key extraction: turn the buffered body prefix into the bytes that get hashed.

Pure: takes bytes and headers, returns a value. It never raises on bad input, because a
request must be routed whatever its body looks like; it falls back to the raw bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import jiter

SALT_HEADERS = ("x-prefix-aware-id", "x-amzn-sagemaker-prefix-aware-id")
ENCODING_HEADER = "content-encoding"
# Every request header the router reads; Envoy need forward no other (see forward_rules).
READ_HEADERS = (*SALT_HEADERS, ENCODING_HEADER)
SALT_BODY_FIELD = "prompt_cache_key"
MAX_SALT_LENGTH = 64
# At most this much of the body is parsed: enough for 65,536 characters of message text
# behind a large preamble, and it bounds the CPU a huge body can cost.
PARSE_LIMIT_BYTES = 1024 * 1024


class KeyMode(StrEnum):
    NATIVE = "native"
    OPENAI = "openai"


class KeySource(StrEnum):
    """Where a routing key came from; counted, so fallbacks are visible."""

    NATIVE = "native"
    OPENAI = "openai"
    # openai mode, but the body was not parseable JSON of a known shape.
    NATIVE_FALLBACK = "native_fallback"
    # openai mode, but the body is compressed; we never inflate untrusted input.
    ENCODED_FALLBACK = "encoded_fallback"


@dataclass(frozen=True, slots=True)
class RoutingKey:
    key: bytes
    source: KeySource
    salt: str | None = None
    model: str | None = None
    # Why a client-supplied salt was ignored (None when none was rejected).
    salt_rejected: str | None = None
    # Byte offsets in ``key`` where each chat message ends (ascending); empty for a
    # completions prompt or a raw body, which are one piece.
    segments: tuple[int, ...] = ()
    # With ``extract_key(..., fixed_length=n)``: the bytes of ``key`` that its first ``n``
    # characters (bytes, natively) take, so that ``key[:fixed_bytes]`` is the key read
    # ``n`` deep, without reading the body again; None when not asked for.
    fixed_bytes: int | None = None


def valid_salt(value: object) -> bool:
    """At most 64 printable ASCII characters, and not empty."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_SALT_LENGTH
        and all(" " <= ch <= "~" for ch in value)
    )


def _salt_from_headers(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    for name in SALT_HEADERS:
        if name in headers:
            value = headers[name]
            if valid_salt(value):
                return value, None
            return None, f"header {name}"
    return None, None


def _text_of_content(content: Any, limit: int | None = None) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts, length = [], 0
        for part in content:
            if limit is not None and length >= limit:
                break
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                    length += len(text)
        return "".join(parts)
    return ""


def openai_prompt_text(body: Any, limit: int | None = None) -> str | None:
    """The message text a model sees, in order, or None if the body is no known shape.

    Chat: each message as ``<role>\\n<text>\\n`` so a role change changes the key.
    Completions: the ``prompt`` string (or list of strings, or token ids). With ``limit``,
    the text may stop once it has ``limit`` characters: a body of 100k tiny messages or
    prompt items then costs no more than the key needs.
    """
    pieces = openai_prompt_pieces(body, limit)
    return None if pieces is None else "".join(pieces)


def openai_prompt_pieces(body: Any, limit: int | None = None) -> list[str] | None:
    """``openai_prompt_text`` before the join: one piece per chat message, or one piece
    for a completions prompt."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages")
    if isinstance(messages, list):
        pieces, length = [], 0
        for message in messages:
            if limit is not None and length >= limit:
                break
            if isinstance(message, dict):
                role = message.get("role")
                role_text = role if isinstance(role, str) else ""
                content = _text_of_content(message.get("content"), limit)
                piece = f"{role_text}\n{content}\n"
                pieces.append(piece)
                length += len(piece)
        return pieces
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        items, length = [], 0
        for item in prompt:
            if limit is not None and length > limit:  # joined so far: length - 1
                break
            text = item if isinstance(item, str) else repr(item)
            items.append(text)
            length += len(text) + 1
        return ["\n".join(items)]
    return None


def _salt_from_trusted_header(
    headers: Mapping[str, str], name: str
) -> tuple[str | None, str | None]:
    if name not in headers:
        return None, None
    value = headers[name]
    return (value, None) if valid_salt(value) else (None, f"header {name}")


def extract_key(
    body: bytes,
    headers: Mapping[str, str],
    mode: KeyMode,
    prefix_length: int,
    trusted_salt_header: str | None = None,
    fixed_length: int | None = None,
) -> RoutingKey:
    """Build the routing key for one request.

    ``headers`` has lower-case names. ``body`` may be a truncated prefix of the real body.
    With ``trusted_salt_header`` the salt comes from that header alone (set by a trusted
    filter in front of the router); the client's salt headers and body field are ignored.
    With ``fixed_length`` (at most ``prefix_length``) the key also says where its first
    ``fixed_length`` characters end (``fixed_bytes``): one read serves a deep key and the
    fixed-length one.
    """
    if trusted_salt_header is None:
        salt, salt_rejected = _salt_from_headers(headers)
    else:
        salt, salt_rejected = _salt_from_trusted_header(headers, trusted_salt_header)
    native = body[:prefix_length]
    native_fixed = None if fixed_length is None else min(fixed_length, len(native))
    if mode is KeyMode.NATIVE:
        return RoutingKey(native, KeySource.NATIVE, salt, None, salt_rejected, (), native_fixed)

    encoding = headers.get(ENCODING_HEADER, "identity").strip().lower()
    if encoding not in ("", "identity"):
        return RoutingKey(
            native, KeySource.ENCODED_FALLBACK, salt, None, salt_rejected, (), native_fixed
        )

    try:
        # trailing-strings: the router sees only the first bytes, so the last string is
        # usually cut; keep its visible part.
        parsed = jiter.from_json(body[:PARSE_LIMIT_BYTES], partial_mode="trailing-strings")
    except ValueError:
        parsed = None
    pieces = openai_prompt_pieces(parsed, prefix_length)
    if pieces is None:
        return RoutingKey(
            native, KeySource.NATIVE_FALLBACK, salt, None, salt_rejected, (), native_fixed
        )

    assert isinstance(parsed, dict)
    model = parsed.get("model")
    if salt is None and trusted_salt_header is None and SALT_BODY_FIELD in parsed:
        body_salt = parsed[SALT_BODY_FIELD]
        if valid_salt(body_salt):
            salt = body_salt
        else:
            salt_rejected = f"body {SALT_BODY_FIELD}"
    text = "".join(pieces)[:prefix_length]
    key = text.encode("utf-8", "surrogatepass")
    ascii_only = len(key) == len(text)
    fixed_bytes = None
    if fixed_length is not None:
        fixed_bytes = (
            min(fixed_length, len(key))
            if ascii_only
            else len(text[:fixed_length].encode("utf-8", "surrogatepass"))
        )
    return RoutingKey(
        key,
        KeySource.OPENAI,
        salt,
        model if isinstance(model, str) else None,
        salt_rejected,
        _segment_ends(pieces, len(text), ascii_only=ascii_only),
        fixed_bytes,
    )


def _segment_ends(pieces: list[str], length: int, ascii_only: bool) -> tuple[int, ...]:
    """Byte offsets where the messages end, within the first ``length`` characters."""
    if len(pieces) < 2:
        return ()
    ends, chars, offset = [], 0, 0
    for piece in pieces:
        if chars >= length:
            break
        taken = piece[: length - chars]
        chars += len(taken)
        offset += len(taken) if ascii_only else len(taken.encode("utf-8", "surrogatepass"))
        ends.append(offset)
    return tuple(ends)
