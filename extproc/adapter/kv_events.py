"""The router's KV-event feed: find each host's publisher, subscribe, and keep the prefix
index's precise view of that host (``index/precise.py``) from its events.

Discovery is the router's own, per host, so that static hosts, the control plane's hosts
and ``prefix-router up --backend URL`` all work with no flag: ``GET /kv_event_sources``
(vLLM's own endpoint: where the engine publishes, per data-parallel rank) and
``GET /v1/models`` (the served model and the path it was loaded from, where the tokenizer
is). A host that publishes nothing, or whose model's tokenizer cannot be found or is of a
kind the router cannot decode, keeps the approximate index, and is asked again every
``DISCOVERY_INTERVAL_S`` (it may be restarted with events on).

Engine blocks are hashes of token ids; the router's are hashes of its key text. Each
stored block's token ids are decoded back to text in the router's key format and chained
into the router's own block hashes (``events/mirror.py``), so no tokenizer runs on the
request path. A host whose events never confirm what this router sent it (a chat
template that is not the router's key format, a wrong tokenizer) is caught by its own
numbers: once ``MISMATCH_BLOCKS`` speculative blocks expired with none confirmed, the host
goes back to the approximate index and ``prefix_router_kv_events_hosts{state="unmatched"}``
counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import structlog

from extproc.config import RouterConfig
from extproc.errors import RouterError
from extproc.events.mirror import HostMirror
from extproc.events.sources import sources_from_kv_event_sources
from extproc.events.subscriber import EventSource, EventSubscriptions, StreamStats
from extproc.events.tokens import (
    CodepointDecoder,
    TokenDecoder,
    VocabDecoder,
    find_tokenizer,
)
from extproc.events.wire import BlockRemoved, BlockStored
from extproc.http_client import host_client
from extproc.index.precise import PreciseHost, SpeculationStats
from extproc.index.prefix import PrefixIndex
from extproc.picker.blocks import chain_seed

log = structlog.get_logger("kv_events")

# How often hosts without a subscription are asked again, and each request's budget.
DISCOVERY_INTERVAL_S = 10.0
DISCOVERY_TIMEOUT_S = 2.0
# Speculative blocks expired with none confirmed before the mapping is judged wrong.
MISMATCH_BLOCKS = 256
# The simulator's extension to /kv_event_sources: its token ids are Unicode code points.
CODEPOINTS = "codepoints"
# Engine blocks per mirror, per token of cache: vLLM's smallest block is 16 tokens, and
# twice that leaves room for blocks whose removal is still on its way.
_ENGINE_BLOCKS_PER_TOKEN = 2 / 16


class HostState(StrEnum):
    """Where a host's view comes from (``prefix_router_kv_events_hosts{state}``)."""

    # Its events: the precise view.
    PRECISE = "precise"
    # Subscribed, but the stream is silent or broken: the approximate index meanwhile.
    SILENT = "silent"
    # Publishes no events (or discovery has not answered yet).
    NO_EVENTS = "no_events"
    # Publishes, but its token ids cannot be decoded here.
    NO_TOKENIZER = "no_tokenizer"
    # Its events never confirmed this router's decisions: the mapping is wrong.
    UNMATCHED = "unmatched"


@dataclass(frozen=True, slots=True)
class Discovered:
    """What a host says about its events and its model."""

    sources: tuple[EventSource, ...]
    # "codepoints" (the simulator) or "" (the model's own tokenizer).
    token_ids: str
    model: str | None
    root: str | None


def _base_model(listing: object) -> tuple[str | None, str | None]:
    """The base model's id and root (the path or hub id vLLM loaded it from)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, dict) and entry.get("parent") is None:
            model, root = entry.get("id"), entry.get("root")
            return (
                model if isinstance(model, str) else None,
                root if isinstance(root, str) else None,
            )
    return None, None


async def discover(client: httpx.AsyncClient, host: str) -> Discovered:
    """Ask ``host`` where it publishes; raises on any failure (asked again later)."""
    async with asyncio.timeout(DISCOVERY_TIMEOUT_S):
        response = await client.get(f"http://{host}/kv_event_sources")
        if response.status_code == 404:  # an engine without the endpoint: no events
            return Discovered((), "", None, None)
        body: Any = response.raise_for_status().json()
        sources = tuple(sources_from_kv_event_sources(body, host))
        if not sources:
            return Discovered((), "", None, None)
        token_ids = ""
        if isinstance(body, dict):
            for rank in body.values():
                if isinstance(rank, dict) and rank.get("token_ids") == CODEPOINTS:
                    token_ids = CODEPOINTS
        response = await client.get(f"http://{host}/v1/models")
        model, root = _base_model(response.raise_for_status().json())
    return Discovered(sources, token_ids, model, root)


@cache
def _vocab_decoder(path: Path) -> VocabDecoder:
    """One table per tokenizer file, however many hosts serve its model."""
    return VocabDecoder.from_tokenizer_file(path)


def decoder_for(found: Discovered, configured: str | None) -> TokenDecoder | None:
    """How to read this host's token ids, or None (it keeps the approximate index)."""
    if found.token_ids == CODEPOINTS:
        return CodepointDecoder()
    path: Path | None
    if configured is not None:
        path = Path(configured)
        if path.is_dir():
            path = path / "tokenizer.json"
    else:
        path = find_tokenizer(found.root, found.model or "")
    if path is None or not path.is_file():
        return None
    try:
        return _vocab_decoder(path)
    except RouterError as exc:
        log.warning("kv_events_tokenizer_unsupported", path=str(path), error=str(exc))
        return None


class KvEventsFeed:
    """Every host's event stream, mirrored into the prefix index (an ``EventSink``)."""

    def __init__(self, index: PrefixIndex, config: RouterConfig) -> None:
        self._index = index
        self._config = config
        self._hosts: frozenset[str] = frozenset()
        self._state: dict[str, HostState] = {}
        self._mirrors: dict[str, HostMirror] = {}
        self._discovered: dict[str, Discovered] = {}
        self._subscriptions = EventSubscriptions(
            self, silent_after_s=config.kv_events_silent_after_s
        )
        self._wake = asyncio.Event()
        index.speculative_ttl_s = config.kv_events_speculative_ttl_s

    # --- what the router tells it

    def set_hosts(self, hosts: frozenset[str]) -> None:
        """The published host set changed: subscribe to new hosts, drop gone ones."""
        self._hosts = hosts
        for host in [h for h in self._state if h not in hosts]:
            self._drop(host)
        self._resubscribe()
        self._wake.set()

    def restart(self) -> None:
        """The index's block settings changed: every mirror's hashes mean nothing now."""
        for host in list(self._mirrors):
            self._drop(host, HostState.NO_EVENTS)
        self._resubscribe()
        self._wake.set()

    def states(self) -> Mapping[str, HostState]:
        return {host: self._state.get(host, HostState.NO_EVENTS) for host in self._hosts}

    def stream_stats(self) -> Mapping[str, StreamStats]:
        return self._subscriptions.stats()

    def mirrors(self) -> Mapping[str, HostMirror]:
        return self._mirrors

    def speculation(self) -> Mapping[str, SpeculationStats]:
        views = {host: self._index.precise(host) for host in self._mirrors}
        return {host: view.stats for host, view in views.items() if view is not None}

    # --- discovery

    async def run(self, stop: asyncio.Event) -> None:
        """Discovery rounds for hosts without a subscription, until ``stop``."""
        async with host_client() as client:
            try:
                while not stop.is_set():
                    await self._discover_round(client)
                    self.check_mapping()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), DISCOVERY_INTERVAL_S)
            finally:
                await self._subscriptions.close()

    async def _discover_round(self, client: httpx.AsyncClient) -> None:
        pending = [h for h in self._hosts if h not in self._mirrors]
        results = await asyncio.gather(
            *(discover(client, h) for h in pending), return_exceptions=True
        )
        for host, found in zip(pending, results, strict=True):
            if host not in self._hosts:
                continue  # left while we asked
            if isinstance(found, BaseException):
                log.debug("kv_events_discovery_failed", host=host, error=repr(found))
                continue
            self._adopt(host, found)
        self._resubscribe()

    def _adopt(self, host: str, found: Discovered) -> None:
        if not found.sources:
            self._state[host] = HostState.NO_EVENTS
            return
        decoder = decoder_for(found, self._config.kv_events_tokenizer)
        if decoder is None:
            if self._state.get(host) is not HostState.NO_TOKENIZER:
                log.warning("kv_events_no_tokenizer", host=host, model=found.model)
            self._state[host] = HostState.NO_TOKENIZER
            return
        base = found.model

        def seed_of(lora: str | None, salt: str | None) -> int:
            return chain_seed(lora or base, salt)

        capacity = self._index.capacity_tokens(host)
        speculative = self._index.speculative_of(host)
        view: PreciseHost | None = None

        def stored(router_hashes: tuple[int, ...]) -> None:
            if view is not None:
                view.confirm(router_hashes)

        mirror = HostMirror(
            self._index.sizing.block_bytes,
            decoder,
            seed_of,
            max(1024, int(capacity * _ENGINE_BLOCKS_PER_TOKEN)),
            # A key is at most match_depth_chars characters, 4 bytes each at most.
            max_key_bytes=4 * self._config.match_depth_chars,
            on_stored=stored,
        )
        self._mirrors[host] = mirror
        self._discovered[host] = found
        view = PreciseHost(mirror, speculative)
        self._index.set_precise(host, view)
        self._state[host] = HostState.PRECISE
        log.info("kv_events_subscribed", host=host, sources=len(found.sources), model=base)

    def _drop(self, host: str, state: HostState | None = None) -> None:
        """Forget what ``host``'s events said; ``state`` is what it is meanwhile."""
        self._mirrors.pop(host, None)
        self._discovered.pop(host, None)
        if state is None:
            self._state.pop(host, None)
        else:
            self._state[host] = state
        self._index.set_precise(host, None)

    def _resubscribe(self) -> None:
        sources = {
            f"{host}#{i}": source
            for host, found in self._discovered.items()
            for i, source in enumerate(found.sources)
        }
        self._subscriptions.update(sources)

    # --- the EventSink the streams write to

    def stored(self, host: str, event: BlockStored) -> None:
        mirror = self._mirrors.get(host)
        if mirror is not None:
            mirror.stored(event)

    def removed(self, host: str, event: BlockRemoved) -> None:
        mirror = self._mirrors.get(host)
        if mirror is not None:
            mirror.removed(event)

    def cleared(self, host: str, reason: str) -> None:
        mirror = self._mirrors.get(host)
        if mirror is not None:
            mirror.clear()
        self._index.speculative_of(host).clear()
        log.info("kv_events_host_cleared", host=host, reason=reason)

    def live(self, host: str, live: bool) -> None:
        """A silent stream (the engine died, or moved its ports on a restart) gives its
        host back to the approximate index and to discovery: what it held is unknown now,
        and a restarted engine may publish elsewhere. A stream that comes back resumes."""
        if live or host not in self._mirrors:
            return
        log.info("kv_events_host_silent", host=host)
        self._drop(host, HostState.SILENT)
        self._resubscribe()
        self._wake.set()

    def check_mapping(self) -> None:
        """Send hosts whose events never confirm this router's decisions back to the
        approximate index (called now and then, off the request path)."""
        for host, state in list(self._state.items()):
            view = self._index.precise(host)
            if state is HostState.UNMATCHED or view is None:
                continue
            stats = view.stats
            if stats.confirmed == 0 and stats.unconfirmed >= MISMATCH_BLOCKS:
                view.live = False
                self._state[host] = HostState.UNMATCHED
                log.warning(
                    "kv_events_unmatched",
                    host=host,
                    unconfirmed=stats.unconfirmed,
                    hint="the engine's chat template or tokenizer is not the router's key "
                    "format; the approximate index serves this host",
                )
