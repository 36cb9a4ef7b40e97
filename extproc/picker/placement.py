"""Consistent placement by rendezvous (highest-random-weight) hashing.

Each host scores every key; a key's placement order is the hosts by descending score.
Removing a host moves only the keys it ranked first, and adding one of N+1 hosts moves
only the keys it now wins: about 1/(N+1) of them. The second host in the order is where
an overflowing key goes, so overflow warms a consistent second cache.
"""

from __future__ import annotations

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


def two_choice_order(
    anchor: int, hosts: tuple[Host, ...], weights: Mapping[str, float] | None = None
) -> tuple[Host, ...]:
    """``hosts`` best first for ``anchor``: rendezvous order, but of its first two hosts the
    one with the greater weight (the less pressed cache) goes first.

    The power of two choices: each anchor has two consistent candidates, and pressure
    only picks between them. So new prefixes avoid a pressed host and flow to an idle one,
    while a change of weights can move an anchor only between its own two candidates, and
    equal (or no) weights give exactly ``placement_order``.
    """
    key = anchor.to_bytes(8, "little")
    hash_ = xxhash.xxh3_64_intdigest
    order = sorted(hosts, key=lambda host: hash_(key, host.identity), reverse=True)
    if weights and len(order) > 1:
        first, second = order[0], order[1]
        if weights.get(second.address, 1.0) > weights.get(first.address, 1.0):
            order[0], order[1] = second, first
    return tuple(order)
