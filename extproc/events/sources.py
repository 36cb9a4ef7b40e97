"""Where an engine publishes its KV events, from vLLM's ``GET /kv_event_sources``.

vLLM 0.32's API server answers with its engine client's ``get_kv_event_sources()``: one
``KVEventsConfig`` per data-parallel rank, as JSON keyed by the rank (a string)::

    {"0": {"enable_kv_cache_events": true, "publisher": "zmq",
           "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
           "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
           "topic": "kv"}}

``{}`` means events are off (or a render-only server). Each rank's config is the one its
publisher resolved: ports are already offset by the rank.

The addresses are the engine's *bind* addresses, so they are rewritten before we connect:

* a wildcard host (``*``, ``0.0.0.0``, ``::``, ``[::]``) becomes the engine's own host, as
  the router names it;
* a concrete host is kept. vLLM reports one in two cases it does not tell apart: it bound
  ``tcp://*:0`` and reports the node IP and port it got (connectable), or it was told to
  *connect out* to a consumer that binds (then nothing answers us, and the stream reports
  the host silent);
* ``ipc://`` is kept (reachable from the same machine); ``inproc://`` cannot be reached
  from another process, so that rank is left out, as is a rank whose publisher is not zmq.

A replay buffer of 0 batches (``buffer_steps``) answers every replay with nothing, which
the subscriber would take for a restarted publisher; such a rank gets no replay endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.errors import RouterError
from extproc.events.subscriber import EventSource

__all__ = ["EventSourceError", "sources_from_kv_event_sources"]

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", ""})


class EventSourceError(RouterError, ValueError):
    """``/kv_event_sources`` answered something that is not vLLM's shape; ``field`` names
    the bad part (``"0".endpoint``)."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"kv_event_sources: {field}: expected {expected}, got {value!r}")


def sources_from_kv_event_sources(body: object, host: str) -> list[EventSource]:
    """The event sources of the engine ``host`` (``ip:port``), one per reachable rank."""
    if not isinstance(body, Mapping):
        raise EventSourceError("(body)", body, "an object keyed by data-parallel rank")
    sources = [_source(_rank(key), config, host) for key, config in body.items()]
    return sorted(
        (source for source in sources if source is not None),
        key=lambda source: source.data_parallel_rank,
    )


def _rank(key: object) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isdecimal() and key.isascii():
        return int(key)
    raise EventSourceError(f"{key!r}", key, "a data-parallel rank (a non-negative integer)")


def _source(rank: int, config: object, host: str) -> EventSource | None:
    where = f'"{rank}"'
    if not isinstance(config, Mapping):
        raise EventSourceError(where, config, "an object (vLLM's KVEventsConfig)")
    enabled = config.get("enable_kv_cache_events", True)
    publisher = config.get("publisher", "zmq")
    if not isinstance(enabled, bool):
        raise EventSourceError(f"{where}.enable_kv_cache_events", enabled, "true or false")
    if not isinstance(publisher, str):
        raise EventSourceError(f"{where}.publisher", publisher, "a publisher name")
    endpoint = _endpoint(config.get("endpoint"), f"{where}.endpoint", host)
    replay = config.get("replay_endpoint")
    replay_endpoint = (
        None if replay is None else _endpoint(replay, f"{where}.replay_endpoint", host)
    )
    topic = config.get("topic", "")
    if not isinstance(topic, str):
        raise EventSourceError(f"{where}.topic", topic, "a string")
    buffer_steps = config.get("buffer_steps", 10_000)
    if not isinstance(buffer_steps, int) or isinstance(buffer_steps, bool) or buffer_steps < 0:
        raise EventSourceError(f"{where}.buffer_steps", buffer_steps, "an integer >= 0")
    if not enabled or publisher != "zmq" or endpoint is None:
        return None
    if buffer_steps == 0:
        replay_endpoint = None
    return EventSource(host, endpoint, replay_endpoint, topic, data_parallel_rank=rank)


def _endpoint(value: object, field: str, host: str) -> str | None:
    """A connectable form of a bind address; ``None``: unreachable from here (inproc)."""
    if not isinstance(value, str) or "://" not in value:
        raise EventSourceError(field, value, "a zmq endpoint such as tcp://*:5557")
    scheme, _, address = value.partition("://")
    if scheme == "inproc":
        return None
    if scheme == "ipc":
        return value
    if scheme != "tcp":
        raise EventSourceError(field, value, "a tcp://, ipc:// or inproc:// endpoint")
    bind_host, sep, port = address.rpartition(":")
    if not sep or not port.isdecimal() or not 0 < int(port) < 65536:
        raise EventSourceError(field, value, "tcp://HOST:PORT with a port in 1..65535")
    if bind_host.strip("[]") in _WILDCARDS:
        return f"tcp://{_engine_ip(host, field)}:{port}"
    return value


def _engine_ip(host: str, field: str) -> str:
    """``host``'s address part, bracketed when IPv6, as zmq wants it."""
    address, sep, _ = host.rpartition(":")
    if not sep or not address:
        raise EventSourceError(f"{field} (host)", host, "the engine as ip:port")
    if address.startswith("["):
        return address
    return f"[{address}]" if ":" in address else address
