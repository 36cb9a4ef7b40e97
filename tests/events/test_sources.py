"""``GET /kv_event_sources`` as vLLM 0.32 answers it, turned into connectable sources."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.errors import RouterError
from extproc.events.sources import EventSourceError, sources_from_kv_event_sources
from extproc.events.subscriber import EventSource

# vLLM's own answer for two data-parallel ranks started with endpoint tcp://*:5557 and
# replay tcp://*:5558: FastAPI's jsonable_encoder over {rank: KVEventsConfig}, each port
# offset by the rank (ZmqEventPublisher.offset_endpoint_port), printed by .venv-vllm.
VLLM_TWO_RANKS = json.loads(
    '{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
    ' "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,'
    ' "max_queue_size": 100000, "topic": "kv"},'
    ' "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",'
    ' "replay_endpoint": "tcp://*:5559", "buffer_steps": 10000, "hwm": 100000,'
    ' "max_queue_size": 100000, "topic": "kv"}}'
)


def one_rank(**overrides: Any) -> dict[str, Any]:
    config = dict(VLLM_TWO_RANKS["0"])
    config.update(overrides)
    return {"0": config}


def test_vllms_answer_becomes_one_source_per_rank() -> None:
    assert sources_from_kv_event_sources(VLLM_TWO_RANKS, "10.0.0.7:8000") == [
        EventSource("10.0.0.7:8000", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv"),
        EventSource("10.0.0.7:8000", "tcp://10.0.0.7:5558", "tcp://10.0.0.7:5559", "kv", 1),
    ]
    keys = [s.key for s in sources_from_kv_event_sources(VLLM_TWO_RANKS, "10.0.0.7:8000")]
    assert keys == ["10.0.0.7:8000", "10.0.0.7:8000#dp1"]


def test_no_sources_means_events_are_off() -> None:
    assert sources_from_kv_event_sources({}, "10.0.0.7:8000") == []


@pytest.mark.parametrize(
    ("endpoint", "host", "connect_to"),
    [
        ("tcp://*:5557", "10.0.0.7:8000", "tcp://10.0.0.7:5557"),
        ("tcp://0.0.0.0:5557", "10.0.0.7:8000", "tcp://10.0.0.7:5557"),
        ("tcp://[::]:5557", "10.0.0.7:8000", "tcp://10.0.0.7:5557"),
        ("tcp://*:5557", "[fd00::7]:8000", "tcp://[fd00::7]:5557"),
        ("tcp://[::]:5557", "fd00::7:8000", "tcp://[fd00::7]:5557"),
        ("tcp://*:5557", "engine-0:8000", "tcp://engine-0:5557"),
        # What vLLM reports after binding tcp://*:0: the node's address, kept.
        ("tcp://10.0.0.9:41234", "10.0.0.7:8000", "tcp://10.0.0.9:41234"),
        ("ipc:///tmp/kv", "10.0.0.7:8000", "ipc:///tmp/kv"),
    ],
)
def test_bind_addresses_become_connectable(endpoint: str, host: str, connect_to: str) -> None:
    (source,) = sources_from_kv_event_sources(one_rank(endpoint=endpoint), host)
    assert source.endpoint == connect_to
    assert source.host == host


@pytest.mark.parametrize(
    "overrides",
    [
        {"endpoint": "inproc://kv"},
        {"enable_kv_cache_events": False},
        {"publisher": "null"},
    ],
)
def test_unreachable_or_disabled_ranks_are_left_out(overrides: dict[str, Any]) -> None:
    assert sources_from_kv_event_sources(one_rank(**overrides), "10.0.0.7:8000") == []


def test_no_replay_endpoint_or_an_empty_buffer_means_no_replay() -> None:
    for overrides in ({"replay_endpoint": None}, {"buffer_steps": 0}):
        (source,) = sources_from_kv_event_sources(one_rank(**overrides), "10.0.0.7:8000")
        assert source.replay_endpoint is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "(body)"),
        ({"zero": {}}, "'zero'"),
        ({"-1": {}}, "'-1'"),
        ({"0": "tcp://*:5557"}, '"0"'),
        (one_rank(endpoint=5557), '"0".endpoint'),
        (one_rank(endpoint="*:5557"), '"0".endpoint'),
        (one_rank(endpoint="udp://*:5557"), '"0".endpoint'),
        (one_rank(endpoint="tcp://*:port"), '"0".endpoint'),
        (one_rank(endpoint="tcp://*:70000"), '"0".endpoint'),
        (one_rank(replay_endpoint=["tcp://*:1"]), '"0".replay_endpoint'),
        (one_rank(topic=None), '"0".topic'),
        (one_rank(buffer_steps=-1), '"0".buffer_steps'),
        (one_rank(enable_kv_cache_events="yes"), '"0".enable_kv_cache_events'),
        (one_rank(publisher=1), '"0".publisher'),
    ],
)
def test_malformed_answers_name_the_field(body: object, field: str) -> None:
    with pytest.raises(EventSourceError) as caught:
        sources_from_kv_event_sources(body, "10.0.0.7:8000")
    assert caught.value.field == field
    assert field in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RouterError)


def test_a_host_without_a_port_is_named() -> None:
    with pytest.raises(EventSourceError, match="host"):
        sources_from_kv_event_sources(one_rank(), "10.0.0.7")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)
_configs = st.fixed_dictionaries(
    {},
    optional={
        "endpoint": st.sampled_from(["tcp://*:5557", "tcp://h:1", "ipc://x", "x"]) | _json,
        "replay_endpoint": st.none() | st.just("tcp://*:5558") | _json,
        "topic": st.text(max_size=4) | _json,
        "buffer_steps": st.integers(-1, 3) | _json,
        "publisher": st.just("zmq") | _json,
        "enable_kv_cache_events": st.booleans() | _json,
    },
)


@given(st.dictionaries(st.sampled_from(["0", "1", "x"]), _configs | _json) | _json)
def test_any_json_gives_sources_or_a_value_error(body: object) -> None:
    try:
        sources = sources_from_kv_event_sources(body, "10.0.0.7:8000")
    except EventSourceError:
        return
    assert all(isinstance(source, EventSource) for source in sources)
