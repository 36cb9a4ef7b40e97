"""How much of the recent traffic shares each prefix.

Every routed request counts once for each of its blocks, in the current of two windows;
when the current window has seen ``window_requests`` requests, or holds ``max_keys``
distinct blocks, it becomes the previous one and the old previous one is dropped whole. A
prefix's share is its count over both windows divided by the requests they saw. Memory is
bounded by ``2 x max_keys`` counters, and each request costs one C-level
``Counter.update``.

Along one chain the share can only fall with depth (every request through block k also
went through block k-1), so the depth at which a prompt stops being popular is a binary
search.

Each request also counts where its chain of full blocks ended. A block carried by more
requests than ended there was continued past, so a new prompt that shares the chain up to
it and goes on differently branches off there: the second conversation after a shared
system prompt, known as shared before any count is hot (``branch_depth``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from extproc.picker.affinity import PrefixHeat
from extproc.picker.blocks import PromptBlocks


class PrefixPopularity:
    def __init__(self, window_requests: int = 2048, max_keys: int = 65536) -> None:
        if window_requests < 1 or max_keys < 1:
            raise ValueError("window_requests and max_keys must be at least 1")
        self.window_requests = window_requests
        self.max_keys = max_keys
        self._current: Counter[int] = Counter()
        self._previous: Counter[int] = Counter()
        # Requests whose chain of full blocks ended at each block, in the same windows.
        self._current_ends: Counter[int] = Counter()
        self._previous_ends: Counter[int] = Counter()
        self._current_requests = 0
        self._previous_requests = 0

    @property
    def requests(self) -> int:
        """Requests the share estimates rest on."""
        return self._current_requests + self._previous_requests

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def count(self, block: int) -> int:
        return self._current.get(block, 0) + self._previous.get(block, 0)

    def ended(self, block: int) -> int:
        """Requests whose chain of full blocks ended at ``block``."""
        return self._current_ends.get(block, 0) + self._previous_ends.get(block, 0)

    def observe(self, hashes: Sequence[int], last_block: int | None = None) -> None:
        """Count one request's ``hashes``; ``last_block``: where its chain of full blocks
        ended (None: not counted)."""
        self._current.update(hashes)
        if last_block is not None:
            self._current_ends[last_block] += 1
        self._current_requests += 1
        if self._current_requests >= self.window_requests or len(self._current) >= self.max_keys:
            self._previous, self._current = self._current, Counter()
            self._previous_ends, self._current_ends = self._current_ends, Counter()
            self._previous_requests, self._current_requests = self._current_requests, 0

    def observe_prompt(self, blocks: PromptBlocks) -> None:
        """Count a routed prompt: its blocks, the whole prompt, and where its blocks end."""
        self.observe(blocks.counted, blocks.hashes[-1] if blocks.hashes else None)

    def branch_depth(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a chain earlier requests carried and went on past
        differently: where a new prompt branches off a shared prefix. 0 when the chain has
        no full block past what was seen, or when what it shares ended an earlier prompt
        (a conversation's next turn continues its last one; it is no branch)."""
        seen = self.popular_depth(hashes, 1)
        if not seen or seen == len(hashes):
            return 0
        last = hashes[seen - 1]
        return seen if self.count(last) > self.ended(last) else 0

    def popular_depth(self, hashes: Sequence[int], min_count: int) -> int:
        """How many leading blocks of ``hashes`` were each carried by at least
        ``min_count`` of the recent requests."""
        if not hashes or self.count(hashes[0]) < min_count:
            return 0
        if self.count(hashes[-1]) >= min_count:
            return len(hashes)
        low, high = 1, len(hashes) - 1  # hashes[low - 1] is popular, hashes[high] is not
        while low < high:
            middle = (low + high) // 2
            if self.count(hashes[middle]) >= min_count:
                low = middle + 1
            else:
                high = middle
        return low

    def clear(self) -> None:
        self._current.clear()
        self._previous.clear()
        self._current_ends.clear()
        self._previous_ends.clear()
        self._current_requests = self._previous_requests = 0


# A prefix needs this many requests in the windows before it can count as hot: enough that
# one repeated prompt is not spread over the fleet, few enough that a shared system prompt
# is known as shared (and stops pulling new conversations to one host) almost at once.
MIN_HOT_REQUESTS = 3


def heat_of(
    popularity: PrefixPopularity, blocks: PromptBlocks, hosts: int, hot_factor: float
) -> PrefixHeat:
    """The popular prefix of a prompt placed over ``hosts`` hosts: its leading blocks each
    carried by more than ``hot_factor / hosts`` of recent requests, and how many hosts the
    deepest of them should be spread over.

    Before any prefix is that hot (the first requests after a start, or a quiet fleet),
    the prefix a new prompt branches off (``branch_depth``) stands in for it, with its
    share of the requests seen so far: so new conversations after a shared system prompt
    are placed by their own anchors from the second one on, instead of following the
    first to the system prompt's host until the count is hot."""
    requests = popularity.requests
    if not requests or hosts < 2:
        return PrefixHeat()
    # More than a fair share, by a margin of two standard deviations of a fair share's
    # count: a conversation that sent 3 of the first 9 requests is not hot.
    fair = hot_factor * requests / hosts
    min_count = max(MIN_HOT_REQUESTS, math.floor(fair + 2 * math.sqrt(fair)) + 1)
    counted = blocks.counted
    depth = popularity.popular_depth(counted, min_count)
    branch = not depth
    if branch:
        depth = popularity.branch_depth(blocks.hashes)
    if not depth:
        return PrefixHeat()
    count = popularity.count(counted[depth - 1])
    replicas = min(hosts, math.ceil(count / requests * hosts / hot_factor))
    if branch and replicas < 2:
        # A branch of a small share of the traffic stays where its prefix is held.
        return PrefixHeat()
    parent = popularity.popular_depth(counted[: depth - 1], 2 * count)
    if depth > blocks.depth:  # the whole prompt too: one prompt, repeated
        return PrefixHeat(blocks.depth, replicas, repeated=True, parent_depth=parent)
    return PrefixHeat(depth, replicas, parent_depth=parent)
