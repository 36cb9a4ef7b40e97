"""Prompt texts the tests send through the stack.

``document(n)`` is about 8,800 characters, all but its first few the same for every n:
the tests' stacks route on the first 4,096 characters, so document n's requests share
their prefix and only n tells documents apart. The fleet-events benchmark sends the same
text from its own copy: tests don't import the benchmarks.
"""

from __future__ import annotations


def document(n: int) -> str:
    return f"document {n}: " + "the quick brown fox jumps over the lazy dog " * 200
