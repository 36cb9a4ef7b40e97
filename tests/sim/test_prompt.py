import pytest

from extproc.sim.prompt import prompt_text


def test_chat_renders_chatml_with_a_generation_prompt() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ]
    }
    assert prompt_text("chat", body) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_content_parts_contribute_only_their_text() -> None:
    content = [
        {"type": "text", "text": "Look "},
        {"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}},
        {"type": "text", "text": "here"},
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    assert (
        prompt_text("chat", body)
        == "<|im_start|>user\nLook here<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_null_content_renders_empty() -> None:
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}
    assert prompt_text("chat", body) == "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"


def test_chats_sharing_leading_messages_share_a_text_prefix() -> None:
    system = {"role": "system", "content": "You are a long system prompt." * 10}
    first = prompt_text("chat", {"messages": [system, {"role": "user", "content": "A"}]})
    second = prompt_text("chat", {"messages": [system, {"role": "user", "content": "B"}]})
    shared = prompt_text("chat", {"messages": [system]}).removesuffix("<|im_start|>assistant\n")
    assert first.startswith(shared)
    assert second.startswith(shared)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Once upon", "Once upon"),
        ("", ""),
        (["Once ", "upon"], "Once upon"),
        ([101, 7, 0], "101 7 0"),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: str) -> None:
    assert prompt_text("completion", {"prompt": prompt}) == expected


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("chat", [], "JSON object"),
        ("chat", {}, "'messages' is required"),
        ("chat", {"messages": "hi"}, "'messages' must be"),
        ("chat", {"messages": []}, "'messages' must be"),
        ("chat", {"messages": ["hi"]}, r"messages\[0\] must be an object"),
        ("chat", {"messages": [{"content": "hi"}]}, r"messages\[0\]\.role"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content"),
        (
            "chat",
            {"messages": [{"role": "user", "content": ["x"]}]},
            r"messages\[0\]\.content\[0\] must be an object",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            r"messages\[0\]\.content\[0\]\.text",
        ),
        ("completion", {}, "'prompt' is required"),
        ("completion", {"prompt": None}, "'prompt' must be"),
        ("completion", {"prompt": 7}, "'prompt' must be"),
        ("completion", {"prompt": []}, "'prompt' must be"),
        ("completion", {"prompt": ["a", 1]}, "only strings or only integer"),
        ("completion", {"prompt": [True, False]}, "only strings or only integer"),
        ("completion", {"prompt": [1.5]}, "only strings or only integer"),
    ],
)
def test_malformed_bodies_raise_a_clear_value_error(kind: str, body: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prompt_text(kind, body)  # type: ignore[arg-type]
