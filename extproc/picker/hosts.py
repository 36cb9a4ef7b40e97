"""The host set the picker chooses from: an immutable, validated value."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash


def parse_host_address(text: str) -> str:
    """Normalise an ``ip:port`` literal; raise ValueError naming the problem.

    Hosts must be IP literals because Envoy's override_host policy and ORIGINAL_DST
    cluster both match on ``ip:port`` exactly.
    """
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"host {text!r} is not ip:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {text!r} does not start with an IP address") from None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"host {text!r} has a port outside 1-65535")
    return f"[{ip}]:{int(port_text)}" if ip.version == 6 else f"{ip}:{int(port_text)}"


@dataclass(frozen=True, slots=True)
class Host:
    """One upstream, as published: its address and its hash identity."""

    address: str
    # Precomputed so placement hashes an int per host instead of re-encoding strings.
    identity: int
    # Models the host serves (base models and loaded LoRA adapters); empty if unknown.
    models: frozenset[str] = frozenset()

    @classmethod
    def of(cls, address: str, models: frozenset[str] = frozenset()) -> Host:
        normalised = parse_host_address(address)
        return cls(normalised, xxhash.xxh3_64_intdigest(normalised.encode()), models)


@dataclass(frozen=True, slots=True)
class HostSet:
    """An ordered-by-address, duplicate-free set of hosts."""

    hosts: tuple[Host, ...]
    # Derived once: decisions test membership on every request.
    addresses: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "addresses", frozenset(h.address for h in self.hosts))

    @classmethod
    def of(cls, addresses: Iterable[str]) -> HostSet:
        return cls.of_hosts(Host.of(a) for a in addresses)

    @classmethod
    def of_hosts(cls, hosts: Iterable[Host]) -> HostSet:
        unique = {h.address: h for h in hosts}
        return cls(tuple(unique[a] for a in sorted(unique)))

    def serving(self, model: str | None) -> HostSet:
        """The hosts that have ``model`` loaded, or all hosts if none has.

        This keeps a LoRA adapter's requests sticky within the hosts that hold it; a base
        model every host serves leaves the set unchanged.
        """
        if model is None:
            return self
        subset = tuple(h for h in self.hosts if model in h.models)
        if not subset or len(subset) == len(self.hosts):
            return self
        return HostSet(subset)

    def __len__(self) -> int:
        return len(self.hosts)
