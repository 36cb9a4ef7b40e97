"""The prefix index: stateful producers that the pure decision core reads.

``PrefixIndex`` remembers which hosts recently received which prompt blocks, bounded like
the engines' own caches; ``PrefixPopularity`` estimates how much of the traffic shares each
prefix. Both answer with immutable values; neither does I/O or reads a clock.
"""
