"""Turn an OpenAI request body into the prompt text the simulated model sees."""

from __future__ import annotations

from typing import Any, Literal

PromptKind = Literal["chat", "completion"]

# ChatML, as used by many vLLM-served models; the exact template only has to be
# stable so that requests sharing leading messages share a text prefix.
_TURN = "<|im_start|>{role}\n{content}<|im_end|>\n"
_GENERATION_PROMPT = "<|im_start|>assistant\n"


def prompt_text(kind: PromptKind, body: dict[str, Any]) -> str:
    """Render the prompt of a chat or completion request body.

    Raises ValueError with a client-facing message when the body is malformed.
    """
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    if kind == "chat":
        return _chat_text(body)
    if kind == "completion":
        return _completion_text(body)
    raise ValueError(f"unknown prompt kind {kind!r}")


def _chat_text(body: dict[str, Any]) -> str:
    if "messages" not in body:
        raise ValueError("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty array")
    turns = [_render_message(index, message) for index, message in enumerate(messages)]
    return "".join(turns) + _GENERATION_PROMPT


def _render_message(index: int, message: object) -> str:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"{where}.role must be a string")
    return _TURN.format(role=role, content=_content_text(where, message.get("content")))


def _content_text(where: str, content: object) -> str:
    # Assistant turns that only carry tool calls have null content.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string, an array of parts, or null")
    texts: list[str] = []
    for part_index, part in enumerate(content):
        part_where = f"{where}.content[{part_index}]"
        if not isinstance(part, dict):
            raise ValueError(f"{part_where} must be an object")
        # Non-text parts (images, audio) take no room in this text-only model.
        if part.get("type") != "text":
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{part_where}.text must be a string")
        texts.append(text)
    return "".join(texts)


def _completion_text(body: dict[str, Any]) -> str:
    if "prompt" not in body:
        raise ValueError("'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'prompt' must be a string, a non-empty array of strings, or of token ids")
    if all(isinstance(item, str) for item in prompt):
        return "".join(prompt)
    # bool is an int subclass but never a token id.
    if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return " ".join(str(item) for item in prompt)
    raise ValueError("'prompt' array must hold only strings or only integer token ids")
