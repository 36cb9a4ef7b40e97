"""Immutable fleet snapshots and the store that publishes them.

No grpc or protobuf here: the xDS server translates snapshots into Envoy's messages. A
snapshot's version is a hash of its content, so publishing identical content is a no-op,
and every watcher wakes only when something really changed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import xxhash

from extproc.control.model import HostLoad
from extproc.errors import RouterError
from extproc.picker.hosts import parse_host_address

LOAD_SUFFIX = "/load"


class SnapshotError(RouterError):
    """A snapshot failed validation and was not published."""


def content_version(payload: object) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canonical.encode())


class Snapshot(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def check(self) -> None:
        """Raise SnapshotError unless the snapshot is internally consistent."""


@dataclass(frozen=True, slots=True)
class PublishedHost:
    address: str
    # Draining: Envoy keeps its in-flight requests, routers send it nothing new.
    draining: bool = False
    # Models served: base models and loaded LoRA adapters.
    models: tuple[str, ...] = ()
    zone: str = ""


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The hosts of one cluster that Envoy and the routers may use."""

    name: str
    hosts: tuple[PublishedHost, ...]
    version: str

    @classmethod
    def build(cls, name: str, hosts: Collection[PublishedHost]) -> FleetSnapshot:
        """Validate inputs, normalise and sort them, and stamp the content version."""
        if not name:
            raise SnapshotError("a fleet snapshot needs a cluster name")
        normalised = []
        for host in hosts:
            try:
                address = parse_host_address(host.address)
            except ValueError as error:
                raise SnapshotError(f"cluster {name}: {error}") from None
            normalised.append(
                PublishedHost(address, host.draining, tuple(sorted(set(host.models))), host.zone)
            )
        ordered = tuple(sorted(normalised, key=lambda h: h.address))
        snapshot = cls(name, ordered, content_version([name, [asdict(h) for h in ordered]]))
        snapshot.check()
        return snapshot

    def check(self) -> None:
        addresses = [h.address for h in self.hosts]
        if len(set(addresses)) != len(addresses):
            raise SnapshotError(f"cluster {self.name}: duplicate host addresses")
        if self.version != content_version([self.name, [asdict(h) for h in self.hosts]]):
            raise SnapshotError(f"cluster {self.name}: version does not match content")

    @property
    def serving(self) -> tuple[PublishedHost, ...]:
        """Hosts that may take new requests."""
        return tuple(h for h in self.hosts if not h.draining)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The load feed for one cluster: one scrape round of every host that answered."""

    name: str
    loads: tuple[tuple[str, HostLoad], ...]
    version: str

    @classmethod
    def build(cls, cluster: str, loads: Mapping[str, HostLoad]) -> LoadSnapshot:
        ordered = tuple(sorted(loads.items()))
        name = cluster + LOAD_SUFFIX
        # scraped_at is in the content, so every scrape round is a new version and the
        # routers can tell a live feed from a dead one by when updates arrive.
        return cls(name, ordered, content_version([name, [(a, asdict(h)) for a, h in ordered]]))

    def check(self) -> None:
        if not self.name.endswith(LOAD_SUFFIX):
            raise SnapshotError(f"load snapshot name {self.name!r} lacks {LOAD_SUFFIX}")


class SnapshotStore:
    """The latest snapshot of each resource name, and a way to wait for changes."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._changed = asyncio.Event()
        self.generation = 0

    def publish(self, snapshot: Snapshot) -> bool:
        """Check and publish; returns False (and wakes nobody) if the version is unchanged."""
        snapshot.check()
        current = self._snapshots.get(snapshot.name)
        if current is not None and current.version == snapshot.version:
            return False
        self._snapshots[snapshot.name] = snapshot
        self.generation += 1
        # Wake every watcher, then arm a fresh event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    def get(self, name: str) -> Snapshot | None:
        return self._snapshots.get(name)

    def names(self) -> frozenset[str]:
        return frozenset(self._snapshots)

    async def wait_past(self, generation: int) -> int:
        """Return once the store has moved past ``generation``; returns the new one."""
        while self.generation <= generation:
            await self._changed.wait()
        return self.generation
