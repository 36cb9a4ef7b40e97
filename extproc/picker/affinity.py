"""PREFIX_AWARE by longest match: the decision over a prefix-index lookup.

Pure: the lookup (matched depth per host), the prompt's heat (how much of the traffic
shares its leading blocks), the loads, the prefill queues and the placement weights are
values; nothing here reads a clock, draws a random number or mutates state.

The decision, for one prompt:

1. **Spread.** Leading blocks carried by more than a host's fair share of the traffic (a
   shared system prompt, a hot document) form the prompt's popular prefix. It is spread
   over the first ``replicas`` hosts of its own rendezvous order, so a hot prefix is
   replicated to consistent second (third, ...) hosts and every replica of the router
   picks the same ones. A prompt with no popular prefix may go anywhere.
2. **Anchor.** The first block past the popular prefix (the document, the conversation,
   the tenant context) is the prompt's anchor. Rendezvous hashing of the anchor orders the
   spread, then the other hosts; of the first two, the one with the greater placement
   weight (the less pressed cache) goes first. So a new prefix lands on a host chosen by
   hash and by cache pressure, from state every router replica shares, and every later
   prompt with the same anchor lands there too.
3. **Cost.** Each host below ``concurrency_threshold`` costs the share of the prompt it
   would have to prefill (on the spread, the popular prefix counts as cached: it is being
   replicated there; not for a prompt repeated as it is, which stays where it is cached),
   plus half the prefill already queued there (as a share of the prompt), plus
   ``overload_cost`` for each request in flight beyond the balance bound. The cheapest
   host wins; ties go to the anchor's order, but of hosts that hold the prompt equally
   (and of a hot document's spread, for a request that adds less than a block to it) the
   less loaded. So a host that holds more of the prompt than the anchor's host wins it (a
   conversation that moved, a document placed before the fleet changed), a lightly
   loaded fleet never overflows, a burst of new prompts spreads instead of queueing its
   prefills on one host, and a loaded host sheds the prompts it holds least of first:
   cold prefixes stay at home.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.errors import NoHostsError
from extproc.picker.blocks import PrefixLookup
from extproc.picker.decide import Decision, Outcome, Strategy
from extproc.picker.hosts import Host, HostSet
from extproc.picker.placement import placement_order, two_choice_order

# Waiting behind prefill queued on a host costs this prompt time only; prefilling it
# elsewhere costs the same time plus compute and a second copy in cache. So queued bytes
# weigh half as much as the prompt's own: a prompt leaves a host holding part of it only
# behind more than twice that part queued there, and two requests for one new prompt that
# overlap at an idle fleet stay together (the first one's prefill is the whole queue).
QUEUE_WEIGHT = 0.5


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
    # Leading blocks carried by at least twice as many requests as the popular prefix:
    # what it continues (a preamble every document shares), 0 if nothing. The popular
    # prefix's anchor there is where it lived before it grew hot; its spread starts there.
    parent_depth: int = 0


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
        # Ordered by the anchor it had before it grew hot, so its first host stays its home.
        home_anchor = blocks.anchor(min(heat.parent_depth, depth - 1))
        spread = placement_order(home_anchor, hosts)[: max(1, heat.replicas)]
        rest = tuple(h for h in members if h not in spread)
        order = two_choice_order(anchor, spread, weights) + two_choice_order(anchor, rest, weights)
        return order, frozenset(h.address for h in spread)
    return two_choice_order(anchor, members, weights), hosts.addresses


def decide_prefix(
    lookup: PrefixLookup,
    heat: PrefixHeat,
    hosts: HostSet,
    loads: Mapping[str, float],
    weights: Mapping[str, float],
    policy: LoadPolicy,
    failover: int,
    queued: Mapping[str, float] | None = None,
) -> Decision:
    """Pick the upstream for one prompt; never a host outside ``hosts``.

    ``queued``: bytes of prompt each host is estimated to have yet to prefill before
    this one (its prefill queue); they delay this prompt's first token as its own
    uncached bytes do, so they count in its cost alike."""
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
    queued = queued or {}
    # One pass in the anchor's order; strict comparisons keep the earliest of equals, but of
    # two equals that both hold the prompt, the less loaded: they cost the same cache, so
    # load decides, and a prompt cached twice is shared between its holders. So does a hot
    # document's spread for the requests that add less than a block to it (a question):
    # there is nothing after it worth keeping in one place. Not a preamble spread over the
    # whole fleet: what follows it (a conversation) goes by its anchor.
    by_load_on_spread = (
        depth > 0
        and len(spread) < len(hosts.hosts)
        and not heat.repeated
        and blocks.length - depth * block_bytes < block_bytes
    )
    chosen = least = unloaded = None
    chosen_cost = chosen_load = chosen_prefill = unloaded_prefill = least_load = math.inf
    chosen_holds = unloaded_holds = False
    for host in order:
        address = host.address
        held = held_really = matched.get(address, 0)
        on_spread = address in spread
        if held < depth and on_spread and not heat.repeated:
            held = depth
        # Holds it: more than the popular prefix (all of it, if repeated as it is), or a
        # hot document and little else, on its spread.
        holds = (
            held_really > depth
            or (heat.repeated and held_really >= depth > 0)
            or (by_load_on_spread and on_spread)
        )
        prefill = (length - held * block_bytes) / length
        if prefill < unloaded_prefill:  # where it would go, were load no object
            unloaded, unloaded_prefill, unloaded_holds = host, prefill, holds
        load = loads.get(address, 0)
        if load < least_load:
            least, least_load = host, load
        if load >= cap:
            continue
        cost = prefill + QUEUE_WEIGHT * queued.get(address, 0.0) / length
        cost += max(0.0, load + 1 - bound) * overload_cost
        if cost < chosen_cost or (
            cost == chosen_cost and holds and chosen_holds and load < chosen_load
        ):
            chosen, chosen_cost, chosen_load, chosen_prefill = host, cost, load, prefill
            chosen_holds = holds
    if chosen is None:
        assert least is not None
        return Decision(_targets(least, order, failover), Outcome.SATURATED, Strategy.PREFIX_AWARE)
    assert unloaded is not None
    shared = chosen_prefill == unloaded_prefill and chosen_holds and unloaded_holds
    if chosen is not unloaded and not shared:  # load moved it, not a holder's tie
        outcome = Outcome.OVERFLOW
    elif chosen is order[0]:
        outcome = Outcome.PLACED
    else:
        outcome = Outcome.MATCHED
    return Decision(_targets(chosen, order, failover), outcome, Strategy.PREFIX_AWARE)


def _targets(primary: Host, order: tuple[Host, ...], failover: int) -> tuple[str, ...]:
    rest = [h.address for h in order if h is not primary][:failover]
    return (primary.address, *rest)
