"""Token ids back to the router's key bytes: how an engine's KV-cache events become text.

vLLM's ``BlockStored`` events name blocks by hashes of token ids, which the router cannot
compute: it never tokenizes. But each event carries the token ids themselves, so decoding
them gives the text the engine holds, and hashing that text the way ``picker/blocks.py``
hashes a request's key gives the router's own block hashes. A decoder's one job is to
turn tokens into bytes of the *key format* (``keys.openai_prompt_pieces``: each chat
message as ``role\\ncontent\\n``).

That format is ChatML with its markers taken out. ``<|im_start|>user\\nhi<|im_end|>\\n``
decodes, with the special tokens dropped (as vLLM's ``skip_special_tokens``), to
``user\\nhi\\n``. So a decoder is exact for ChatML templates only, and
``VocabDecoder.from_tokenizer_file`` refuses a vocabulary without ChatML's markers
rather than fill the index with hashes no request will ever ask for.

The trailing generation prompt does not matter. The engine's prompt ends with
``<|im_start|>assistant\\n`` (``assistant\\n`` once decoded), which the router's key for
that request lacks. Router blocks are cut every ``block_bytes`` from the start, so every
block that ends inside the key is the same on both sides; only a block that runs past the
key's end differs, and the router never hashes that one for this request (it is the
key's partial last block). It is, though, exactly the block the *next* turn asks for:
that turn's key resends ``assistant\\n<reply>\\n``, and the engine stored
``assistant\\n<reply>`` (the reply's ``<|im_end|>`` decodes to nothing), so the blocks
of the reply that the engine cached match the next turn's key byte for byte. What the
engine holds is always a prefix of some conversation's future key.

Known approximations, each on the side of claiming less:

* A message whose text contains a literal ``<|im_start|>`` or ``<|im_end|>`` is
  tokenized as the special token and decoded to nothing, while the router's key keeps
  the text: that conversation's blocks past the marker never match.
* A tokenizer with an NFC normalizer (Qwen2) holds NFC text; a request that is not NFC
  already (rare: most text is) keys differently from what the engine decodes.
* A template that adds text of its own (Qwen2.5's default system prompt when the
  request has none, Qwen3's removal of past ``<think>`` blocks) decodes to text the
  router's key never starts with: those prompts never match. The router's key format,
  not this module, would have to change for them.

One claims more: a reply is cached as the tokens the model sampled, and the next turn
tokenizes the same text afresh. Where the two tokenizations differ, the engine's hashes
differ and it recomputes from there, while the decoded text, and so the router's hash,
is the same.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol

from extproc.errors import RouterError

CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
# Normalizers that change no text already in NFC (nearly all text): the decoded text is
# then the text the client sent.
_HARMLESS_NORMALIZERS = frozenset({"NFC"})


class UnsupportedTokenizer(RouterError):
    """A tokenizer whose tokens do not decode to the router's key text (not byte-level,
    not ChatML, or changing text on the way in). The caller falls back to the router's
    own approximate index for that host."""


class UndecodableTokens(RouterError):
    """Token ids the decoder has no bytes for: an id past the vocabulary, or a code point
    past U+10FFFF. The block they are in cannot be mapped."""


class TokenDecoder(Protocol):
    """Turns a run of token ids into bytes of the router's key format, block by block.

    What a block decodes to can depend on the blocks before it: a ChatML marker spelled in
    characters can straddle a block boundary. So the decoder is pure and hands back what
    it must hold: ``pending`` is what the previous block left, and the result is the bytes
    ready now and the new ``pending``, which the caller stores with the block so that any
    block continuing it, in any later event, can resume from there.
    """

    def decode(self, pending: bytes, token_ids: Sequence[int]) -> tuple[bytes, bytes]:
        """``(key bytes, pending)`` for ``token_ids`` following a block that left
        ``pending`` (``b""`` at a prompt's start). Raises ``UndecodableTokens``."""
        ...

    def decode_blocks(
        self, pending: bytes, token_ids: Sequence[int], block_size: int
    ) -> list[tuple[bytes, bytes]]:
        """``decode`` of each block of ``block_size`` tokens in turn, pending carried:
        one ``(key bytes, pending)`` per block, stopping before the first block that
        does not decode. An event's blocks are decoded in one call, which a decoder may
        do faster than block by block."""
        decoded = []
        for start in range(0, len(token_ids), block_size):
            try:
                out, pending = self.decode(pending, token_ids[start : start + block_size])
            except UndecodableTokens:
                break
            decoded.append((out, pending))
        return decoded


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for
    each byte in a byte-level BPE vocabulary, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_ALPHABET = _byte_alphabet()


def _token_bytes(token: str) -> bytes:
    """A vocabulary entry's bytes, as the ``tokenizers`` ByteLevel decoder gives them: the
    alphabet's bytes, or the entry's own UTF-8 when it is not spelled in the alphabet (an
    added token holding a space, say, which is literal text)."""
    try:
        return bytes(_ALPHABET[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


class VocabDecoder(TokenDecoder):
    """Byte-level BPE decoding by table: one lookup and a join per block.

    Byte-level tokens never split a byte, so the bytes of a block are final at once and
    ``pending`` passes through untouched: a UTF-8 character cut between two blocks is cut
    in the router's key bytes at the same place.
    """

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = tuple(table)

    @classmethod
    def from_tokenizer_file(cls, path: str | os.PathLike[str]) -> VocabDecoder:
        """Build the id → bytes table of a HuggingFace ``tokenizer.json``, once.

        Special tokens decode to nothing, which is what takes the ChatML markers out.
        Raises ``UnsupportedTokenizer`` for anything this table cannot decode exactly.
        """
        from tokenizers import Tokenizer  # only a host with events needs the library

        try:
            tokenizer = Tokenizer.from_file(os.fspath(path))
        except Exception as error:  # the library raises plain Exception for a bad file
            raise UnsupportedTokenizer(f"cannot read tokenizer {path}: {error}") from error
        config = json.loads(tokenizer.to_str())
        _check_supported(config, path)
        specials = {
            token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        missing = [m for m in CHATML_MARKERS if tokenizer.token_to_id(m) not in specials]
        if missing:
            raise UnsupportedTokenizer(
                f"tokenizer {path} has no special token {missing[0]}: the engine's text "
                "is not ChatML, so it is not the router's key"
            )
        vocabulary = tokenizer.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocabulary.values(), default=-1) + 1)
        for token, token_id in vocabulary.items():
            if token_id not in specials:
                table[token_id] = _token_bytes(token)
        return cls(table)

    def decode(self, pending: bytes, token_ids: Sequence[int]) -> tuple[bytes, bytes]:
        return b"".join(self._gather(token_ids)), pending

    def decode_blocks(
        self, pending: bytes, token_ids: Sequence[int], block_size: int
    ) -> list[tuple[bytes, bytes]]:
        """One gather for the whole event, then a join per block: decoding is most of
        what ingesting an event costs, and this halves it."""
        try:
            pieces = self._gather(token_ids)
        except UndecodableTokens:  # find which block, the slow way
            return super().decode_blocks(pending, token_ids, block_size)
        join = b"".join
        if len(pieces) <= block_size:  # one block (most events while a reply is generated)
            return [(join(pieces), pending)] if pieces else []
        return [
            (join(pieces[start : start + block_size]), pending)
            for start in range(0, len(pieces), block_size)
        ]

    def _gather(self, token_ids: Sequence[int]) -> tuple[bytes, ...]:
        # A negative id would index from the end; vLLM never sends one, and checking
        # every id would cost a fifth of the decoding.
        try:
            if len(token_ids) > 1:
                # itemgetter looks the ids up in one C loop, twice as fast as map().
                pieces: tuple[bytes, ...] = itemgetter(*token_ids)(self._table)
                return pieces
            return tuple([self._table[token_id] for token_id in token_ids])
        except (IndexError, TypeError) as error:
            raise UndecodableTokens(f"token id out of the vocabulary: {error}") from error


def _component_types(component: Mapping[str, Any] | None, key: str) -> Iterator[str]:
    """The types of a tokenizer component, ``Sequence``'s members included."""
    if component is None:
        return
    kind = str(component.get("type"))
    if kind == "Sequence":
        for member in component.get(key) or ():
            yield from _component_types(member, key)
    else:
        yield kind


def _prefix_space(component: Mapping[str, Any] | None) -> bool:
    if component is None:
        return False
    if component.get("type") == "Sequence":
        return any(_prefix_space(member) for member in component.get("pretokenizers") or ())
    return component.get("type") == "ByteLevel" and bool(component.get("add_prefix_space"))


def _check_supported(config: Mapping[str, Any], path: object) -> None:
    """Refuse what would make decoded text differ from the text the client sent."""
    decoders = list(_component_types(config.get("decoder"), "decoders"))
    if decoders != ["ByteLevel"]:
        raise UnsupportedTokenizer(
            f"tokenizer {path} has decoder {'+'.join(decoders) or 'none'}; only a "
            "ByteLevel decoder maps tokens to bytes exactly"
        )
    normalizers = set(_component_types(config.get("normalizer"), "normalizers"))
    if not normalizers <= _HARMLESS_NORMALIZERS:
        raise UnsupportedTokenizer(
            f"tokenizer {path} has normalizer {'+'.join(sorted(normalizers))}, which "
            "changes the text before it is tokenized"
        )
    if _prefix_space(config.get("pre_tokenizer")):
        raise UnsupportedTokenizer(
            f"tokenizer {path} adds a prefix space, which is not in the client's text"
        )


_MARKER = re.compile("|".join(re.escape(marker) for marker in CHATML_MARKERS))
# Every proper prefix of a marker, longest first: what a block may end with that the next
# block could complete into a marker.
_MARKER_PREFIXES = sorted(
    {marker[:length] for marker in CHATML_MARKERS for length in range(1, len(marker))},
    key=len,
    reverse=True,
)


class CodepointDecoder(TokenDecoder):
    """The simulator's tokens: each character of its ChatML-rendered prompt as one token
    whose id is the character's code point.

    The markers are literal characters here, so they are taken out of the text, in one
    left-to-right scan as a tokenizer finds special tokens. A block that ends with the
    start of a marker holds those characters back (``pending``, at most 11) until the next
    block says whether they complete one.
    """

    def decode(self, pending: bytes, token_ids: Sequence[int]) -> tuple[bytes, bytes]:
        try:
            text = pending.decode("ascii") + "".join(map(chr, token_ids))
        except (ValueError, TypeError, OverflowError) as error:
            raise UndecodableTokens(f"not a code point: {error}") from error
        if "<" not in text:
            return _utf8(text), b""
        scanned = 0
        for match in _MARKER.finditer(text):
            scanned = match.end()
        held = _held_back(text, scanned)
        ready = _MARKER.sub("", text[: len(text) - held])
        return _utf8(ready), text[len(text) - held :].encode("ascii")


def _held_back(text: str, scanned: int) -> int:
    """How many trailing characters (none inside a marker found, so from ``scanned`` on)
    are the start of a marker the next block may complete."""
    tail = text[max(scanned, len(text) - len(_MARKER_PREFIXES[0])) :]
    for prefix in _MARKER_PREFIXES:
        if len(prefix) <= len(tail) and tail.endswith(prefix):
            return len(prefix)
    return 0


def _utf8(text: str) -> bytes:
    # surrogatepass: as the router encodes a key whose JSON held a lone surrogate.
    return text.encode("utf-8", "surrogatepass")


def find_tokenizer(model_root: str | None, model: str) -> Path | None:
    """Where a local ``tokenizer.json`` for a host's model is, or None; never downloads.

    ``model_root`` is the ``root`` vLLM's ``/v1/models`` reports: the directory or hub id
    it was started with. A directory must hold ``tokenizer.json``; a hub id (the root's,
    else the served name's) is looked up in the HuggingFace hub cache. A server started
    with a separate ``--tokenizer`` is not visible here: its root's tokenizer is used.
    """
    for name in (model_root, model):
        if not name:
            continue
        path = Path(name).expanduser()
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return path / "tokenizer.json"
        elif path.is_file() and path.name == "tokenizer.json":
            return path
        elif (found := _hub_snapshot(name)) is not None:
            return found
    return None


_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _hub_cache() -> Path:
    """The hub cache as ``huggingface_hub`` resolves it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if value := os.environ.get(variable):
            return Path(value).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _hub_snapshot(repo_id: str) -> Path | None:
    """``tokenizer.json`` in the cached snapshot ``refs/main`` names, else in the newest."""
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        return None
    repo = _hub_cache() / f"models--{repo_id.replace('/', '--')}"
    main = repo / "refs" / "main"
    if main.is_file():
        candidate = repo / "snapshots" / main.read_text().strip() / "tokenizer.json"
        if candidate.is_file():
            return candidate
    snapshots = [path for path in repo.glob("snapshots/*/tokenizer.json") if path.is_file()]
    return max(snapshots, key=_mtime, default=None)


def _mtime(path: Path) -> float:
    return path.stat().st_mtime
