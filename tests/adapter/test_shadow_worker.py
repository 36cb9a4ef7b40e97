"""Shadow mode's thread: events applied in the order they were queued, a request left out
(and counted) rather than delayed when the thread is far behind, and a failing event
neither ends the thread nor reaches the request."""

import threading

import pytest
from prometheus_client import REGISTRY

from extproc.adapter import shadow_worker
from extproc.adapter.shadow_worker import ShadowWorker
from extproc.index.prefix import IndexSizing
from extproc.index.shadow import Shadow
from extproc.picker.affinity import LoadPolicy
from extproc.picker.blocks import prompt_blocks
from extproc.picker.hosts import HostSet

HOSTS = HostSet.of(["127.0.0.51:8000", "127.0.0.52:8000"])
SIZING = IndexSizing(block_bytes=64, max_blocks=10_000, default_host_tokens=100_000,
                     chars_per_token=4.0)  # fmt: skip


def worker() -> ShadowWorker:
    return ShadowWorker(Shadow(SIZING, LoadPolicy(32, 2.0, 2, 0.25), 1.0, None))


def blocks(n: int):  # type: ignore[no-untyped-def]
    return prompt_blocks(f"document {n} ".encode() * 40, 64, 0)


def test_events_apply_in_order():
    w = worker()
    for token in range(20):
        w.place(token, blocks(token % 3), HOSTS, {}, float(token))
    for token in range(0, 20, 2):
        w.release(token)
    w.sync()
    assert sum(w.shadow.requests.values()) == 20
    assert sum(w.shadow.in_flight.values()) == 10 == w.pending
    w.retain([HOSTS.hosts[0].address])
    w.sync()
    assert set(w.shadow.requests) <= {HOSTS.hosts[0].address}
    w.stop()


def test_a_request_is_left_out_not_delayed_when_the_thread_is_behind(monkeypatch):
    monkeypatch.setattr(shadow_worker, "QUEUE_EVENTS", 3)
    w = worker()
    gate = threading.Event()
    w._events.put((gate.wait,))  # the thread is stuck until the gate opens
    before = REGISTRY.get_sample_value("prefix_router_shadow_dropped_total") or 0
    for token in range(10):
        w.place(token, blocks(token), HOSTS, {}, 0.0)  # returns at once
        w.release(token)
    assert w.dropped == 7
    assert REGISTRY.get_sample_value("prefix_router_shadow_dropped_total") == before + 7
    gate.set()
    w.sync()
    assert sum(w.shadow.requests.values()) == 3 and not w.shadow.in_flight
    w.stop()


def test_a_failing_event_is_logged_and_the_thread_goes_on(capsys):
    w = worker()
    w.place(1, blocks(1), HostSet(()), {}, 0.0)  # no hosts: the placement raises
    w.place(2, blocks(2), HOSTS, {}, 0.0)
    w.sync()
    assert sum(w.shadow.requests.values()) == 1
    w.stop()
    assert "shadow_event_failed" in capsys.readouterr().out


@pytest.mark.parametrize("events", [0, 100])
def test_stop_ends_the_thread(events):
    w = worker()
    for token in range(events):
        w.place(token, blocks(token), HOSTS, {}, 0.0)
    w.stop()
    assert not w._thread.is_alive()
