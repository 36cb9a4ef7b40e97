"""Pure builders of OpenAI-shaped response bodies and SSE frames."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from extproc.sim.metrics import FINISHED_REASON
from extproc.sim.prompt import PromptKind

_FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")

_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
# OpenAI reuses "text_completion" for streamed completion chunks.
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Envelope:
    """Fields shared by a response and all of its stream chunks."""

    kind: PromptKind
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: PromptKind, model: str) -> Envelope:
        return cls(
            kind=kind,
            id=_ID_PREFIX[kind] + uuid.uuid4().hex,
            created=int(time.time()),
            model=model,
        )


def _head(envelope: Envelope, object_name: str) -> dict[str, Any]:
    return {
        "id": envelope.id,
        "object": object_name,
        "created": envelope.created,
        "model": envelope.model,
    }


def filler_tokens(count: int, chars_per_token: int = 4) -> list[str]:
    """`count` output tokens of recognisable filler, each `chars_per_token` characters (a
    word cut to fit, then a space), so the reply's length in tokens is what the cache model
    counts when a client sends it back in its next turn."""
    if chars_per_token == 1:
        return [_FILLER_WORDS[i % len(_FILLER_WORDS)][0] for i in range(count)]
    width = chars_per_token - 1
    return [_FILLER_WORDS[i % len(_FILLER_WORDS)][:width].ljust(width) + " " for i in range(count)]


def reply_text(tokens: int, chars_per_token: int = 4) -> str:
    """The whole reply a request of `max_tokens` = `tokens` gets: deterministic, as at
    temperature 0, so a client (or a workload generator) can resend it as history."""
    return "".join(filler_tokens(tokens, chars_per_token))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(envelope: Envelope, text: str, usage_body: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming chat.completion or text_completion body."""
    choice: dict[str, Any] = {"index": 0}
    if envelope.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=FINISHED_REASON)
    return {**_head(envelope, _OBJECT[envelope.kind]), "choices": [choice], "usage": usage_body}


def token_chunk(envelope: Envelope, token: str, *, first: bool, last: bool) -> dict[str, Any]:
    """One streamed token; the first chat chunk also names the role, the last one finishes."""
    choice: dict[str, Any] = {"index": 0}
    if envelope.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = token
        choice["delta"] = delta
    else:
        choice["text"] = token
    choice.update(logprobs=None, finish_reason=FINISHED_REASON if last else None)
    return {**_head(envelope, _CHUNK_OBJECT[envelope.kind]), "choices": [choice]}


def usage_chunk(envelope: Envelope, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The closing chunk sent when stream_options.include_usage is set."""
    return {**_head(envelope, _CHUNK_OBJECT[envelope.kind]), "choices": [], "usage": usage_body}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_body(message: str, error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": None}}
