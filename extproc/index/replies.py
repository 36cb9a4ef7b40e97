"""The replies an engine has cached: what a prefix index of prompts alone misses.

vLLM caches the blocks its replies generate, and a conversation's next turn resends the
reply, so it hits them. An index of prompts only sees the prompt the turn continues: where
a prompt's match on a host ends exactly at the last whole block of a prompt that host
served, it continues that prompt, and it matches to the end of the message that follows
that prompt (the reply, resent), but for the reply's last token, which the engine never
computed. Where the prompt's messages are not known, a reply of ``reply_tokens`` is
assumed.

Each host keeps the last-block hash and length of its recent prompts, no more of them
than its cache holds blocks.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class ServedPrompts:
    def __init__(self, chars_per_token: float, reply_tokens: int) -> None:
        self.chars_per_token = chars_per_token
        self.reply_tokens = reply_tokens
        # host -> (hash of a prompt's last whole block -> the prompt's bytes), oldest first
        self._ends: dict[str, OrderedDict[int, int]] = {}

    def matched(
        self,
        host: str,
        hashes: Sequence[int],
        depth: int,
        ends: Sequence[int],
        block_bytes: int,
    ) -> int:
        """The depth (in blocks of ``block_bytes``) ``host`` holds of a prompt whose cache
        match is ``depth``, counting the reply of a prompt it continues; ``ends``: where
        the prompt's messages end."""
        if not depth:
            return depth
        host_ends = self._ends.get(host)
        served = None if host_ends is None else host_ends.get(hashes[depth - 1])
        if served is None:
            return depth
        at = bisect.bisect_right(ends, served)
        if at < len(ends):
            reply_end = ends[at] - self.chars_per_token
        else:
            reply_end = served + (self.reply_tokens - 1) * self.chars_per_token
        return max(depth, min(len(hashes), int(reply_end // block_bytes)))

    def note(self, host: str, last_block: int, length: int, capacity: int) -> None:
        """``host`` served a prompt of ``length`` bytes whose last whole block is
        ``last_block``; it remembers at most ``capacity`` prompts."""
        ends = self._ends.setdefault(host, OrderedDict())
        ends[last_block] = length
        ends.move_to_end(last_block)
        while len(ends) > max(1, capacity):
            ends.popitem(last=False)

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        for host in [h for h in self._ends if h not in keep]:
            del self._ends[host]

    def forget(self, host: str) -> None:
        self._ends.pop(host, None)

    def __len__(self) -> int:
        return sum(len(ends) for ends in self._ends.values())
