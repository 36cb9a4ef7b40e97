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


# A host whose index holds more than this multiple of the other candidate's share of its
# cache gives a new prefix to the other (when their weights are equal).
FILL_MARGIN = 1.5


def two_choice_order(
    anchor: int,
    hosts: tuple[Host, ...],
    weights: Mapping[str, float] | None = None,
    fills: Mapping[str, float] | None = None,
) -> tuple[Host, ...]:
    """``hosts`` best first for ``anchor``: rendezvous order, but of its first two hosts the
    one with the greater weight (the less pressed cache) goes first; of two equal weights,
    the one whose cache is clearly less full (``fills``: the share of each host's cache
    the router's index holds) goes first.

    The power of two choices: each anchor has two consistent candidates, and pressure
    only picks between them. So new prefixes avoid a pressed host and flow to an idle one,
    while a change of weights can move an anchor only between its own two candidates, and
    equal (or no) weights and fills give exactly ``placement_order``. The weights come from
    the control plane and move slowly; the fills move with every decision, so a handful of
    new prefixes on a fresh fleet are spread evenly instead of by the luck of the hash.
    """
    key = anchor.to_bytes(8, "little")
    hash_ = xxhash.xxh3_64_intdigest
    order = sorted(hosts, key=lambda host: hash_(key, host.identity), reverse=True)
    if len(order) > 1 and (weights or fills):
        first, second = order[0], order[1]
        first_weight = weights.get(first.address, 1.0) if weights else 1.0
        second_weight = weights.get(second.address, 1.0) if weights else 1.0
        if second_weight > first_weight or (
            second_weight == first_weight
            and fills
            and fills.get(first.address, 0.0) > FILL_MARGIN * fills.get(second.address, 0.0)
        ):
            order[0], order[1] = second, first
    return tuple(order)
