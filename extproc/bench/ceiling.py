"""The hit-rate ceiling of a fleet run: the most of its prompt tokens any routing could find
cached, computed from the request schedule alone (regenerated from the stored run's
workload) with the simulator's own accounting (``served.serve``: vLLM's
``prefix_cache_queries`` and ``prefix_cache_hits``, in tokens, over full blocks, with the
blocks of generated replies cached too).

**Ceiling.** Replay every request, in arrival order, through one ``PrefixCache`` that never
evicts. A block's hash names its whole prefix, so the replay misses each distinct block at
most once: the first time a prompt brings it, unless an earlier request's reply computed it.
A fleet starts cold and misses each block at least once on every instance it is asked of,
and caches a reply's blocks only once its request is served, before any prompt that resends
the reply arrives (a client's next turn). So a fleet misses at least the replay's tokens and
hits at most its hits (the engine model's rule that a fully cached prompt recomputes its last
block only lowers a fleet's hits): the replay's hit rate (cold misses only) bounds every
routing of the whole schedule. A run that lost requests queried fewer prompts; the stored
runs lost none.

**With no instance above a share cap** (20%, the headline's busiest-instance target). An
instance may then take at most k = floor(cap * N) of the N requests, so a group (a
document, conversation or tenant) of n > k requests needs at least m = ceil(n / k)
instances. Its exclusive shared prefix is the leading full blocks that every prompt of the
group starts with, less any block a request outside the group computes (prompt or reply).
Only the group's own requests can put those blocks in a cache, so each of the m instances
misses all of them once, where the replay missed each once in all: (m - 1) times the prefix
more misses, at least. Subtracted from the replay's hits, that bounds the hit rate of any
routing that keeps every instance under the cap. It leaves out evictions and every other
cost of spreading a group: a bound, not an estimate.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from extproc.bench.served import prompt_of, reply_of, serve
from extproc.bench.workloads import BenchRequest, WorkloadSpec, generate
from extproc.sim.cache import CacheResult, PrefixCache
from extproc.sim.options import SimOptions

SHARE_CAP = 0.20  # the headline's target for the busiest instance's share of requests


@dataclass(frozen=True)
class Ceiling:
    requests: int
    query_tokens: int
    hit_tokens: int  # of one unbounded cache serving every request, in order
    busiest_group: str
    busiest_requests: int
    share_cap: float
    per_instance_limit: int  # the most requests an instance may take under share_cap
    capped_extra_misses: int  # tokens an instance cap costs at least, beyond cold misses

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.query_tokens)

    @property
    def busiest_share(self) -> float:
        return self.busiest_requests / max(1, self.requests)

    @property
    def over_cap(self) -> bool:
        """Whether the busiest group alone is more than one instance may take."""
        return self.busiest_requests > self.per_instance_limit

    @property
    def capped_hit_rate(self) -> float:
        """An upper bound on the hit rate with no instance above ``share_cap``."""
        return (self.hit_tokens - self.capped_extra_misses) / max(1, self.query_tokens)


def unbounded_cache(block_size_tokens: int, chars_per_token: int) -> PrefixCache:
    """A simulator prefix cache that never evicts."""
    return PrefixCache(sys.maxsize, block_size_tokens, chars_per_token)


def replay(requests: Sequence[BenchRequest], cache: PrefixCache) -> CacheResult:
    """Serve ``requests`` in order from ``cache``; their query and hit tokens, summed."""
    queries = hits = 0
    for request in requests:
        result = serve(cache, request)
        queries += result.query_tokens
        hits += result.hit_tokens
    return CacheResult(query_tokens=queries, hit_tokens=hits)


def per_instance_limit(requests: int, share_cap: float) -> int:
    """The most of ``requests`` one instance may take without exceeding ``share_cap``; exact
    (0.2 is read as 1/5, not as the float above it), and at least one."""
    return max(1, math.floor(Fraction(str(share_cap)) * requests))


def _common_prefix(block_lists: Sequence[Sequence[int]]) -> Sequence[int]:
    first = block_lists[0]
    length = len(first)
    for blocks in block_lists[1:]:
        length = min(length, len(blocks))
        length = next((i for i in range(length) if blocks[i] != first[i]), length)
    return first[:length]


def _groups_computing(requests: Sequence[BenchRequest], hasher: PrefixCache) -> dict[int, set[str]]:
    """Every block some request computes (its prompt and its reply), with the groups whose
    requests compute it."""
    computing: dict[int, set[str]] = {}
    for request in requests:
        reply = reply_of(request, hasher.chars_per_token)
        for block in hasher.sequence_hashes(prompt_of(request), reply):
            computing.setdefault(block, set()).add(request.group)
    return computing


def capped_extra_misses(
    requests: Sequence[BenchRequest], share_cap: float, hasher: PrefixCache
) -> int:
    """Tokens any routing with no instance above ``share_cap`` misses beyond the replay's
    cold misses, at least: per group over the limit, (instances it needs - 1) times its
    exclusive shared prefix (see the module docstring). ``hasher`` only hashes blocks."""
    limit = per_instance_limit(len(requests), share_cap)
    sizes = Counter(request.group for request in requests)
    instances_needed = {group: -(-n // limit) for group, n in sizes.items() if n > limit}
    if not instances_needed:
        return 0
    computing = _groups_computing(requests, hasher)
    extra_blocks = 0
    for group, instances in instances_needed.items():
        prompts = [hasher.block_hashes(prompt_of(r)) for r in requests if r.group == group]
        shared = _common_prefix(prompts)
        exclusive = [block for block in shared if computing[block] == {group}]
        extra_blocks += (instances - 1) * len(exclusive)
    return extra_blocks * hasher.block_size_tokens


def ceiling(
    requests: Sequence[BenchRequest],
    block_size_tokens: int = SimOptions.block_size_tokens,
    chars_per_token: int = SimOptions.chars_per_token,
    share_cap: float = SHARE_CAP,
) -> Ceiling:
    """The ceilings of ``requests`` (see the module docstring)."""
    cache = unbounded_cache(block_size_tokens, chars_per_token)
    totals = replay(requests, cache)
    busiest, count = Counter(r.group for r in requests).most_common(1)[0] if requests else ("", 0)
    return Ceiling(
        requests=len(requests),
        query_tokens=totals.query_tokens,
        hit_tokens=totals.hit_tokens,
        busiest_group=busiest,
        busiest_requests=count,
        share_cap=share_cap,
        per_instance_limit=per_instance_limit(len(requests), share_cap),
        capped_extra_misses=capped_extra_misses(requests, share_cap, cache),
    )


def _block_size(sim_args: Sequence[str]) -> int:
    """The instances' block size: the run's ``--block-size``, else the simulator's default."""
    args = list(sim_args)
    for index, arg in enumerate(args):
        if arg == "--block-size":
            return int(args[index + 1])
        if arg.startswith("--block-size="):
            return int(arg.split("=", 1)[1])
    return SimOptions.block_size_tokens


@lru_cache(maxsize=16)
def _schedule_ceiling(spec: WorkloadSpec, block_size_tokens: int) -> Ceiling:
    # Reports and the headline ask for the same runs' ceilings; each replay takes a second.
    return ceiling(generate(spec), block_size_tokens)


def stored_ceiling(document: Mapping[str, Any]) -> Ceiling | None:
    """The ceilings of a stored fleet run's schedule, regenerated from its workload; None when
    the run names no workload, or when the workload no longer generates the run's number of
    requests (the generator changed since: another schedule's ceiling bounds nothing)."""
    workload = document.get("workload")
    if workload is None:
        return None
    block_size = _block_size(document["simulator"]["args"])
    found = _schedule_ceiling(WorkloadSpec(**workload), block_size)
    return found if found.requests == document["requests"] else None
