"""Sources of candidate hosts, and their union.

A `Source` yields normalised "ip:port" addresses; `Discovery` merges several and rides out
a failing one with its last known answer. Kubernetes endpoints can be one more Source.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import structlog

from extproc.errors import RouterError
from extproc.picker.hosts import parse_host_address

log = structlog.get_logger("discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


class DiscoveryError(RouterError):
    """A source could not say which hosts exist."""


class Source(Protocol):
    """Anything that can list candidate hosts."""

    name: str

    async def addresses(self) -> frozenset[str]:
        """Normalised "ip:port" strings; raises DiscoveryError when the source fails."""
        ...


class StaticSource:
    """A fixed list of "ip:port" addresses, checked once at construction."""

    def __init__(self, addresses: Iterable[str], name: str = "static") -> None:
        self.name = name
        self._addresses = frozenset(_normalise(entry, name) for entry in addresses)

    async def addresses(self) -> frozenset[str]:
        return self._addresses


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """The IPv4 addresses (A records) of `host`, through the system resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return [str(sockaddr[0]) for *_, sockaddr in infos]


class DnsSource:
    """ "host:port" names, re-resolved on every call; one name may stand for many hosts."""

    def __init__(
        self,
        names: Iterable[str],
        resolver: Resolver | None = None,
        name: str = "dns",
        timeout_s: float = 2.0,
    ) -> None:
        valid = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if not valid or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r}: allowed a finite number of seconds > 0")
        self.name = name
        self._names = tuple(dict.fromkeys(_split_name(entry, name) for entry in names))
        self._resolver = resolver or resolve_ipv4
        # The system resolver can stall for many seconds; a stalled name fails the call.
        self._timeout_s = timeout_s

    async def addresses(self) -> frozenset[str]:
        per_name = await asyncio.gather(*(self._resolve(host, port) for host, port in self._names))
        return frozenset().union(*per_name)

    async def _resolve(self, host: str, port: int) -> frozenset[str]:
        if _is_ip_literal(host):
            return frozenset({_normalise(_join(host, port), self.name)})
        try:
            async with asyncio.timeout(self._timeout_s):
                ips = await self._resolver(host, port)
        except TimeoutError:
            raise DiscoveryError(
                f"source {self.name}: resolving {host!r} timed out after {self._timeout_s} s"
            ) from None
        except DiscoveryError:
            raise
        except Exception as exc:
            raise DiscoveryError(f"source {self.name}: resolving {host!r} failed: {exc}") from exc
        if not ips:
            raise DiscoveryError(f"source {self.name}: {host!r} resolved to no addresses")
        return frozenset(_normalise(_join(ip, port), self.name) for ip in ips)


class Discovery:
    """The union of several sources; a failing source contributes its last known answer."""

    def __init__(self, sources: Sequence[Source]) -> None:
        names = [source.name for source in sources]
        if not names:
            raise ValueError("sources=[]: allowed one or more sources")
        if len(set(names)) != len(names):
            raise ValueError(f"sources={names!r}: allowed sources with distinct names")
        self._sources = tuple(sources)
        self._last_known: dict[str, frozenset[str]] = {}
        self._last_errors: dict[str, str] = {}

    @property
    def last_errors(self) -> Mapping[str, str]:
        """Source name -> its latest error; a source's entry clears when it answers again."""
        return MappingProxyType(dict(self._last_errors))

    async def addresses(self) -> frozenset[str]:
        results = await asyncio.gather(
            *(source.addresses() for source in self._sources), return_exceptions=True
        )
        for source, result in zip(self._sources, results, strict=True):
            if isinstance(result, frozenset):
                self._last_known[source.name] = result
                self._last_errors.pop(source.name, None)
            elif isinstance(result, Exception):
                # Keep the last answer, so a DNS blip never empties the fleet.
                self._last_errors[source.name] = str(result) or type(result).__name__
                log.warning(
                    "discovery.source_failed",
                    source=source.name,
                    error=self._last_errors[source.name],
                    kept_addresses=len(self._last_known.get(source.name, ())),
                )
            else:
                raise result  # a cancellation, not a source failure
        return frozenset().union(*self._last_known.values())


def _split_name(entry: str, source: str) -> tuple[str, int]:
    host, sep, port_text = entry.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host:
        raise DiscoveryError(f"source {source}: entry {entry!r} is not host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DiscoveryError(f"source {source}: entry {entry!r} has a port outside 1-65535")
    return host, int(port_text)


def _normalise(entry: str, source: str) -> str:
    try:
        return parse_host_address(entry)
    except ValueError as exc:
        raise DiscoveryError(f"source {source}: bad entry {entry!r}: {exc}") from None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
