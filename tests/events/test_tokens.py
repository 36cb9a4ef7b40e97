"""Token ids back to the router's key bytes: the vocabulary table of a real byte-level BPE
tokenizer, the simulator's code points, and where a host's tokenizer.json is found."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from extproc.errors import RouterError
from extproc.events.tokens import (
    CodepointDecoder,
    TokenDecoder,
    UndecodableTokens,
    UnsupportedTokenizer,
    VocabDecoder,
    find_tokenizer,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SAMPLES = [
    "plain ascii: the quick brown fox, 42 times!",
    "the document says alpha beta gamma, and then delta: 42 results.",
    "café crème brûlée, naïve résumé",
    "中文字符和标点\uff0c混合 English 文本\u3002",  # full-width comma and stop
    "emoji 😀🎉👍🏽 and flags 🇫🇷 mixed in",
    "tabs\tand\nnewlines\r\n  indented   spaces",
]
# Characters the corpus never had are byte tokens: one character, several tokens.
UNSEEN = "unseen: ø 漢字 🦀 ∑ ŝ"


def corpus() -> list[str]:
    """Enough text for merges that join (and split) multi-byte characters."""
    words = " ".join(SAMPLES).split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 3


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json with ChatML's special tokens, trained in
    milliseconds (once per test session)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return str(tokenizer.to_str())


def write_tokenizer(directory: Path, text: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(tokenizer_json() if text is None else text)
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json())


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> VocabDecoder:
    return VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path_factory.mktemp("tok")))


def decode_in_blocks(decoder: TokenDecoder, ids: list[int], cuts: list[int]) -> bytes:
    """What the decoder gives for ``ids`` cut at ``cuts``, pending carried across."""
    out, pending, start = [], b"", 0
    for stop in [*cuts, len(ids)]:
        chunk, pending = decoder.decode(pending, ids[start:stop])
        out.append(chunk)
        start = stop
    return b"".join(out)


@pytest.mark.parametrize("text", [*SAMPLES, UNSEEN])
def test_round_trip_cut_at_every_token_boundary(tokenizer, decoder, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for cut in range(len(ids) + 1):
        assert decode_in_blocks(decoder, ids, [cut]) == text.encode()


def test_tokens_split_characters_and_blocks_of_any_size(tokenizer, decoder):
    # The table's entries are bytes, not characters: a character can be two tokens.
    text = "".join([*SAMPLES, UNSEEN])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = [decoder.decode(b"", [token_id])[0] for token_id in ids]
    assert any(_not_utf8(piece) for piece in pieces)
    for size in (1, 2, 3, 7, 16):
        cuts = list(range(size, len(ids), size))
        assert decode_in_blocks(decoder, ids, cuts) == text.encode()


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_special_tokens_are_dropped(tokenizer, decoder):
    text = "<|im_start|>user\nhi é<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<|im_start|>") in ids
    assert decoder.decode(b"", ids) == ("user\nhi é\nassistant\n".encode(), b"")


def test_added_tokens_that_are_not_special_are_text(tmp_path):
    tokenizer = Tokenizer.from_str(tokenizer_json())
    tokenizer.add_tokens(["<tool_call>", "two words"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    decoder = VocabDecoder.from_tokenizer_file(path)
    text = "x <tool_call> and two words é"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("two words") in ids
    assert decoder.decode(b"", ids)[0] == text.encode()


def test_id_past_the_vocabulary_is_undecodable(tokenizer, decoder):
    with pytest.raises(UndecodableTokens):
        decoder.decode(b"", [5, tokenizer.get_vocab_size() + 10])


@pytest.mark.parametrize("kind", ["vocab", "codepoint"])
def test_decode_blocks_is_decode_block_by_block(tokenizer, decoder, kind):
    one_by_one: TokenDecoder = decoder if kind == "vocab" else CodepointDecoder()
    text = CHAT + "".join(SAMPLES) + UNSEEN
    if kind == "vocab":
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        bad = tokenizer.get_vocab_size() + 1
    else:
        ids, bad = codepoints(text), 0x110000
    for size in (1, 5, 16, len(ids), len(ids) + 3):
        expected, pending = [], b""
        for start in range(0, len(ids), size):
            out, pending = one_by_one.decode(pending, ids[start : start + size])
            expected.append((out, pending))
        assert one_by_one.decode_blocks(b"", ids, size) == expected
        # A block that does not decode ends the list: the blocks before it still count.
        broken = [*ids[:size], bad, *ids]
        assert one_by_one.decode_blocks(b"", broken, size) == expected[: int(size <= len(ids))]
    assert one_by_one.decode_blocks(b"", [], 16) == []


def _variant(**changes: object) -> str:
    config = json.loads(tokenizer_json())
    config.update(changes)
    return json.dumps(config)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (_variant(decoder={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}),
         "Metaspace"),
        (_variant(decoder={"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}), "Replace+ByteFallback+Fuse"),
        (_variant(normalizer={"type": "Lowercase"}), "Lowercase"),
        (_variant(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True,
                                 "trim_offsets": True, "use_regex": True}), "prefix space"),
    ],
)  # fmt: skip
def test_unsupported_tokenizers_are_named(tmp_path, config, named):
    with pytest.raises(UnsupportedTokenizer, match=re.escape(named)) as raised:
        VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, config))
    assert isinstance(raised.value, RouterError)


def test_nfc_normalizer_is_accepted(tmp_path):
    config = _variant(normalizer={"type": "NFC"})
    VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, config))


def test_a_vocabulary_without_chatml_markers_is_refused(tmp_path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SAMPLES, trainer=trainer)
    with pytest.raises(UnsupportedTokenizer, match="ChatML"):
        VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, tokenizer.to_str()))


def test_an_unreadable_file_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedTokenizer, match="cannot read"):
        VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, "{not json"))


def test_sequences_as_the_library_writes_them(tmp_path):
    # The checks read the file as the library writes it, not a hand-written shape.
    tokenizer = Tokenizer.from_str(tokenizer_json())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    with pytest.raises(UnsupportedTokenizer, match="Lowercase"):
        VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, tokenizer.to_str()))
    # Qwen2's shape: NFC, a split before the byte-level step, no prefix space.
    tokenizer.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(r"\p{N}", behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, tokenizer.to_str()))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=True)]
    )
    with pytest.raises(UnsupportedTokenizer, match="prefix space"):
        VocabDecoder.from_tokenizer_file(write_tokenizer(tmp_path, tokenizer.to_str()))


# The simulator's tokens: code points of its ChatML text.

CHAT = "<|im_start|>user\nhi <é中😀> a<b|c<|im_end|>\n<|im_start|>assistant\n"
_MARKERS = re.compile(r"<\|im_start\|>|<\|im_end\|>")


def codepoints(text: str) -> list[int]:
    return [ord(char) for char in text]


def test_codepoint_markers_split_at_every_position():
    expected = "user\nhi <é中😀> a<b|c\nassistant\n".encode()
    ids = codepoints(CHAT)
    for cut in range(len(ids) + 1):
        assert decode_in_blocks(CodepointDecoder(), ids, [cut]) == expected
    for size in range(1, 14):
        cuts = list(range(size, len(ids), size))
        assert decode_in_blocks(CodepointDecoder(), ids, cuts) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # One left-to-right scan, as a tokenizer finds special tokens: taking a marker out
        # never makes a new one.
        ("<|im_<|im_end|>start|>", "<|im_start|>"),
        ("<|im_e<|im_start|>nd|>", "<|im_end|>"),
        ("<<|im_end|>", "<"),
        ("<|im_start|<|im_end|>>", "<|im_start|>"),
        ("<|im_star", ""),  # held back: the next block may complete it
    ],
)
def test_codepoint_scan_is_one_pass(text, expected):
    ids = codepoints(text)
    for cut in range(len(ids) + 1):
        assert decode_in_blocks(CodepointDecoder(), ids, [cut]) == expected.encode()


def test_codepoint_pending_is_the_held_back_start_of_a_marker():
    assert CodepointDecoder().decode(b"", codepoints("ab<|im_")) == (b"ab", b"<|im_")
    assert CodepointDecoder().decode(b"<|im_", codepoints("x")) == (b"<|im_x", b"")


@given(
    st.lists(
        st.sampled_from(["<|im_start|>", "<|im_end|>", "<", "|", "im_", "start", "end", ">",
                         "é", "😀", "a", "\n"]),
        max_size=40,
    ),
    st.lists(st.integers(0, 200), max_size=6),
)  # fmt: skip
def test_codepoint_decoding_is_blockwise_the_whole_text_scanned(pieces, cuts):
    text = "".join(pieces)
    ids = codepoints(text)
    decoded = decode_in_blocks(CodepointDecoder(), ids, sorted(c for c in cuts if c <= len(ids)))
    whole = _MARKERS.sub("", text).encode()
    # What is still held back at the end is a marker's start, not yet text.
    assert whole.startswith(decoded)
    assert len(whole) - len(decoded) <= len("<|im_start|>") - 1


def test_codepoint_outside_unicode_is_undecodable():
    with pytest.raises(UndecodableTokens):
        CodepointDecoder().decode(b"", [65, 0x110000])


# Where a host's tokenizer.json is.


def test_find_tokenizer_in_the_model_directory(tmp_path):
    path = write_tokenizer(tmp_path / "tiny")
    assert find_tokenizer(str(tmp_path / "tiny"), "tiny") == path


def _hub_snapshot(cache: Path, repo: str, commit: str) -> Path:
    return write_tokenizer(cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit)


def test_find_tokenizer_in_the_hub_cache(tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = tmp_path / "hf" / "hub"
    _hub_snapshot(cache, "org/model", "old")
    main = _hub_snapshot(cache, "org/model", "abc123")
    (cache / "models--org--model" / "refs").mkdir()
    (cache / "models--org--model" / "refs" / "main").write_text("abc123\n")
    assert find_tokenizer("org/model", "served-name") == main
    # The served name is tried when the root is no hub id the cache holds.
    assert find_tokenizer(None, "org/model") == main
    assert find_tokenizer("/no/such/dir", "org/model") == main
    assert find_tokenizer("org/other", "other") is None

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert find_tokenizer("org/model", "org/model") is None
    only = _hub_snapshot(tmp_path / "elsewhere", "org/model", "def456")
    assert find_tokenizer("org/model", "org/model") == only


def test_find_tokenizer_ignores_what_is_no_repo_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _hub_snapshot(tmp_path, "a", "c")
    assert find_tokenizer("../../a", "") is None
    assert (
        find_tokenizer(None, "a") == tmp_path / "models--a" / "snapshots" / "c" / "tokenizer.json"
    )
