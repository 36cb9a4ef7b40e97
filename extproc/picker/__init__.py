"""The pure decision core: key extraction, hashing, placement and overflow.

Nothing in this package does I/O, reads a clock, draws random numbers or imports grpc.
"""
