"""PREFIX_AWARE by longest match: the decision over a prefix-index lookup.

Pure: the lookup (matched depth per host), the prompt's heat (how much of the traffic
shares its leading blocks), the loads and the placement weights are values; nothing here
reads a clock, draws a random number or mutates state.

The decision, for one prompt:

1. **Spread.** Leading blocks carried by more than a host's fair share of the traffic (a
   shared system prompt, a hot document) form the prompt's popular prefix. It is spread
   over the first ``replicas`` hosts of its own rendezvous order, so a hot prefix is
   replicated to consistent second (third, ...) hosts and every replica of the router
   picks the same ones. A prompt with no popular prefix may go anywhere.
2. **Anchor.** The first block past the popular prefix (the document, the conversation,
   the tenant context) is the prompt's anchor. Weighted rendezvous hashing of the anchor
   orders the spread, then the other hosts: a new prefix lands on a host chosen by hash
   and by the placement weights (cache pressure), from state every router replica shares,
   and every later prompt with the same anchor lands there too.
3. **Cost.** Each host below ``concurrency_threshold`` costs the share of the prompt it
   would have to prefill (on the spread, the popular prefix counts as cached: it is being
   replicated there; not for a prompt repeated as it is, which stays where it is cached)
   plus ``overload_cost`` for each request in flight beyond the balance
   bound. The cheapest host wins; ties go to the anchor's order. So a host that
   holds more of the prompt than the anchor's host wins it (a conversation that moved, a
   document placed before the fleet changed), a lightly loaded fleet never overflows, and
   a loaded host sheds the prompts it holds least of first: cold prefixes stay at home.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.errors import NoHostsError
from extproc.picker.blocks import PrefixLookup
from extproc.picker.decide import Decision, Outcome, Strategy
from extproc.picker.hosts import Host, HostSet
from extproc.picker.placement import placement_order, weighted_order


@dataclass(frozen=True, slots=True)
class PrefixHeat:
    """How widely the traffic shares a prompt's leading blocks."""

    # Leading blocks carried by more than one host's fair share of recent requests.
    depth: int = 0
    # Hosts the popular prefix is spread over (ignored when depth is 0).
    replicas: int = 1
    # The whole prompt, as it is, is popular: one prompt repeated, not a prefix continued
    # in many ways. Its holders keep it; only load spreads it.
    repeated: bool = False


@dataclass(frozen=True, slots=True)
class LoadPolicy:
    concurrency_threshold: int
    # A host over this multiple of the fleet's mean in flight (counting this request) is
    # over its balance bound; None: only the threshold bounds a host.
    balance_factor: float | None
    # The balance bound is never below this many in flight.
    balance_min_in_flight: int
    # What one request in flight beyond the balance bound costs, as a share of the prompt
    # to prefill: a host holding more than this much more of the prompt still wins it.
    overload_cost: float


def balance_bound(hosts: HostSet, loads: Mapping[str, float], policy: LoadPolicy) -> float:
    if policy.balance_factor is None:
        return float(policy.concurrency_threshold)
    total = sum(loads.get(h.address, 0) for h in hosts.hosts) + 1
    mean_bound = math.ceil(policy.balance_factor * total / len(hosts.hosts))
    return float(min(policy.concurrency_threshold, max(policy.balance_min_in_flight, mean_bound)))


def anchor_order(
    lookup: PrefixLookup, heat: PrefixHeat, hosts: HostSet, weights: Mapping[str, float]
) -> tuple[tuple[Host, ...], frozenset[str]]:
    """The anchor's order over every host (the spread first), and the spread's addresses."""
    blocks = lookup.blocks
    depth = min(heat.depth, blocks.depth)
    members = hosts.hosts
    anchor = blocks.anchor(depth)
    # Weights place new prompts only: where a host holds more than the popular prefix, the
    # plain rendezvous order breaks ties, so a cached prompt's order never drifts with load.
    if any(held > depth for held in lookup.matched.values()):
        weights = {}
    if depth and heat.replicas < len(members):
        spread = placement_order(blocks.prefix_hash(depth), hosts)[: max(1, heat.replicas)]
        rest = tuple(h for h in members if h not in spread)
        order = weighted_order(anchor, spread, weights) + weighted_order(anchor, rest, weights)
        return order, frozenset(h.address for h in spread)
    return weighted_order(anchor, members, weights), hosts.addresses


def decide_prefix(
    lookup: PrefixLookup,
    heat: PrefixHeat,
    hosts: HostSet,
    loads: Mapping[str, float],
    weights: Mapping[str, float],
    policy: LoadPolicy,
    failover: int,
) -> Decision:
    """Pick the upstream for one prompt; never a host outside ``hosts``."""
    if not hosts.hosts:
        raise NoHostsError("the published host set is empty")
    order, spread = anchor_order(lookup, heat, hosts, weights)
    blocks = lookup.blocks
    depth = min(heat.depth, blocks.depth)
    block_bytes = blocks.block_bytes
    length = max(1, blocks.length)
    matched = lookup.matched
    bound = balance_bound(hosts, loads, policy)
    cap = policy.concurrency_threshold
    overload_cost = policy.overload_cost
    # One pass in the anchor's order; strict comparisons keep the earliest of equals.
    chosen = unloaded = least = None
    chosen_cost = unloaded_prefill = least_load = math.inf
    for host in order:
        address = host.address
        held = matched.get(address, 0)
        if held < depth and address in spread and not heat.repeated:
            held = depth
        prefill = (length - held * block_bytes) / length
        if prefill < unloaded_prefill:
            unloaded, unloaded_prefill = host, prefill
        load = loads.get(address, 0)
        if load < least_load:
            least, least_load = host, load
        if load >= cap:
            continue
        cost = prefill + max(0.0, load + 1 - bound) * overload_cost
        if cost < chosen_cost:
            chosen, chosen_cost = host, cost
    if chosen is None:
        assert least is not None
        return Decision(_targets(least, order, failover), Outcome.SATURATED, Strategy.PREFIX_AWARE)
    if chosen is not unloaded:
        outcome = Outcome.OVERFLOW
    elif chosen is order[0]:
        outcome = Outcome.PLACED
    else:
        outcome = Outcome.MATCHED
    return Decision(_targets(chosen, order, failover), outcome, Strategy.PREFIX_AWARE)


def _targets(primary: Host, order: tuple[Host, ...], failover: int) -> tuple[str, ...]:
    rest = [h.address for h in order if h is not primary][:failover]
    return (primary.address, *rest)
