"""Consistent placement by rendezvous (highest-random-weight) hashing.

Each host scores every key; a key's placement order is the hosts by descending score.
Removing a host moves only the keys it ranked first, and adding one of N+1 hosts moves
only the keys it now wins: about 1/(N+1) of them. The second host in the order is where
an overflowing key goes, so overflow warms a consistent second cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import xxhash

from extproc.picker.hosts import Host, HostSet


def key_digest(key: bytes, salt: str | None) -> int:
    """64-bit digest of a routing key, mixed with the tenant salt.

    The salt is the seed, so two tenants with identical prompts get independent digests.
    """
    seed = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
    return xxhash.xxh3_64_intdigest(key, seed=seed)


def _score(digest: int, host: Host) -> int:
    return xxhash.xxh3_64_intdigest(digest.to_bytes(8, "little"), seed=host.identity)


def placement_order(digest: int, hosts: HostSet) -> tuple[Host, ...]:
    """All hosts, best first, for one key digest."""
    return tuple(sorted(hosts.hosts, key=lambda host: _score(digest, host), reverse=True))


_SCALE = 1.0 / 2.0**64


def weighted_order(
    anchor: int, hosts: tuple[Host, ...], weights: Mapping[str, float] | None = None
) -> tuple[Host, ...]:
    """``hosts`` best first for ``anchor``, by weighted rendezvous hashing.

    Host h scores ``w_h / -ln(u_h)`` with ``u_h`` uniform in (0, 1) from the anchor and the
    host, so each host comes first for a share of anchors proportional to its weight, and
    changing one host's weight moves only anchors to or from that host. Equal (or no)
    weights give the same order as ``placement_order``.
    """
    key = anchor.to_bytes(8, "little")
    hash_ = xxhash.xxh3_64_intdigest
    if not weights:
        return tuple(sorted(hosts, key=lambda host: hash_(key, host.identity), reverse=True))
    log = math.log

    def score(host: Host) -> float:
        uniform = (hash_(key, host.identity) + 0.5) * _SCALE
        return weights.get(host.address, 1.0) / -log(uniform)

    return tuple(sorted(hosts, key=score, reverse=True))
