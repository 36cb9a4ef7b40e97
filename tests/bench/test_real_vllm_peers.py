"""The peers' plumbing on real vLLM (real_vllm_peers.py): the event relay that hands an
engine's ZMQ publisher to vllm-router on a loopback TCP port, message by message."""

from __future__ import annotations

import time

import zmq

from extproc.bench.real_vllm_peers import PEERS, EventRelay, peer_binary


def test_the_relay_forwards_each_message_whole_and_in_order(tmp_path):
    context = zmq.Context()
    # As vLLM publishes: bound on a Unix socket, three frames a message (topic, an 8-byte
    # big-endian sequence number, the msgpack batch).
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path / 'kv-events.pub'}")
    try:
        with EventRelay(f"ipc://{tmp_path / 'kv-events.pub'}") as relay:
            assert relay.endpoint.startswith("tcp://127.0.0.1:")
            subscriber = context.socket(zmq.SUB)
            subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
            subscriber.connect(relay.endpoint)
            # A subscription reaches the publisher a moment after connecting: publish until
            # the first message comes through, then the rest in order.
            first = None
            deadline = time.monotonic() + 10
            while first is None and time.monotonic() < deadline:
                publisher.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\x93\x00\x90\x00"])
                if subscriber.poll(100):
                    first = subscriber.recv_multipart()
            assert first == [b"kv", (0).to_bytes(8, "big"), b"\x93\x00\x90\x00"]
            while subscriber.poll(100):  # the repeats sent while waiting
                subscriber.recv_multipart()
            for sequence in range(1, 51):
                publisher.send_multipart([b"kv", sequence.to_bytes(8, "big"), b"batch"])
            received = [subscriber.recv_multipart() for _ in range(50)]
            assert [int.from_bytes(m[1], "big") for m in received] == list(range(1, 51))
            assert all(len(m) == 3 and m[0] == b"kv" for m in received)
            subscriber.close(linger=0)
    finally:
        publisher.close(linger=0)
        context.term()


def test_the_relay_stops_and_frees_its_port(tmp_path):
    with EventRelay(f"ipc://{tmp_path / 'nobody.pub'}") as relay:
        endpoint = relay.endpoint
    context = zmq.Context()
    try:
        again = context.socket(zmq.XPUB)
        again.bind(endpoint)  # would raise "Address already in use" had it not stopped
        again.close(linger=0)
    finally:
        context.term()


def test_the_bench_extra_installs_both_peers():
    # pyproject's [bench] extra (which [test] includes) installs smg and vllm-router.
    assert all(peer_binary(peer) is not None for peer in PEERS)
