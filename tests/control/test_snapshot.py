import asyncio
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.control.model import HostLoad
from extproc.control.snapshot import (
    LOAD_SUFFIX,
    FleetSnapshot,
    LoadSnapshot,
    PublishedHost,
    SnapshotError,
    SnapshotStore,
    content_version,
)

A = "127.0.0.1:8001"
B = "127.0.0.2:8002"
C = "127.0.0.3:8003"


def fleet(*hosts: PublishedHost, name: str = "vllm") -> FleetSnapshot:
    return FleetSnapshot.build(name, hosts)


BASE = (
    PublishedHost(A, models=("m",), zone="z1"),
    PublishedHost(B, models=("m", "lora"), zone="z2"),
)


# --- versions -------------------------------------------------------------------------


def test_identical_content_gives_identical_version() -> None:
    first = fleet(*BASE)
    second = fleet(*reversed(BASE))
    assert first.version == second.version
    assert first == second
    assert len(first.version) == 32  # a 128-bit hex digest
    int(first.version, 16)


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param((*BASE, PublishedHost(C)), id="host-added"),
        pytest.param(BASE[:1], id="host-removed"),
        pytest.param((replace(BASE[0], draining=True), BASE[1]), id="draining"),
        pytest.param((replace(BASE[0], models=("m", "other")), BASE[1]), id="models"),
        pytest.param((replace(BASE[0], zone="z9"), BASE[1]), id="zone"),
        pytest.param((replace(BASE[0], address="127.0.0.1:8009"), BASE[1]), id="port"),
    ],
)
def test_any_change_gives_a_new_version(changed: tuple[PublishedHost, ...]) -> None:
    assert fleet(*changed).version != fleet(*BASE).version


def test_cluster_name_is_part_of_the_version() -> None:
    assert fleet(*BASE, name="a").version != fleet(*BASE, name="b").version


def test_version_ignores_model_order_and_duplicates() -> None:
    one = fleet(PublishedHost(A, models=("b", "a", "a")))
    two = fleet(PublishedHost(A, models=("a", "b")))
    assert one.version == two.version
    assert one.hosts[0].models == ("a", "b")


@given(
    st.lists(
        st.tuples(st.integers(1, 254), st.integers(1, 65535), st.booleans()),
        unique_by=lambda t: (t[0], t[1]),
        max_size=8,
    ),
    st.randoms(use_true_random=False),
)
def test_version_is_independent_of_input_order(
    entries: list[tuple[int, int, bool]], rng: object
) -> None:
    hosts = [PublishedHost(f"127.0.0.{ip}:{port}", draining) for ip, port, draining in entries]
    shuffled = list(hosts)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    built = FleetSnapshot.build("c", hosts)
    assert built.version == FleetSnapshot.build("c", shuffled).version
    assert [h.address for h in built.hosts] == sorted(h.address for h in built.hosts)


# --- build validation and normalisation ----------------------------------------------------


def test_build_normalises_and_sorts() -> None:
    built = fleet(
        PublishedHost(" 127.0.0.9:80 ", models=("z", "a", "z")),
        PublishedHost("[::1]:0080"),
        PublishedHost("127.0.0.10:080", draining=True),
    )
    assert [h.address for h in built.hosts] == sorted(["127.0.0.9:80", "[::1]:80", "127.0.0.10:80"])
    by_address = {h.address: h for h in built.hosts}
    assert by_address["127.0.0.9:80"].models == ("a", "z")
    assert by_address["127.0.0.10:80"].draining
    assert [h.address for h in built.serving] == sorted(["127.0.0.9:80", "[::1]:80"])
    built.check()  # a built snapshot is internally consistent


@pytest.mark.parametrize(
    "address", ["localhost:80", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "", ":80"]
)
def test_build_rejects_bad_addresses(address: str) -> None:
    with pytest.raises(SnapshotError, match="cluster vllm"):
        fleet(PublishedHost(A), PublishedHost(address))


@pytest.mark.parametrize(
    "duplicate", [A, " 127.0.0.1:8001", "127.0.0.1:08001"], ids=["same", "space", "zero"]
)
def test_build_rejects_duplicate_addresses(duplicate: str) -> None:
    with pytest.raises(SnapshotError, match="duplicate"):
        fleet(PublishedHost(A), PublishedHost(duplicate, draining=True))


def test_build_rejects_an_empty_name() -> None:
    with pytest.raises(SnapshotError):
        FleetSnapshot.build("", [PublishedHost(A)])


def test_check_rejects_a_version_that_does_not_match() -> None:
    built = fleet(*BASE)
    forged = FleetSnapshot(built.name, built.hosts, "0" * 32)
    with pytest.raises(SnapshotError, match="version"):
        forged.check()
    with pytest.raises(SnapshotError):
        SnapshotStore().publish(forged)


def test_load_snapshot_name_and_version() -> None:
    loads = {B: HostLoad(running=2), A: HostLoad(waiting=1, scraped_at=5.0)}
    snap = LoadSnapshot.build("vllm", loads)
    assert snap.name == "vllm" + LOAD_SUFFIX
    assert [a for a, _ in snap.loads] == [A, B]
    assert snap.version == LoadSnapshot.build("vllm", dict(reversed(loads.items()))).version
    # scraped_at is content: a new scrape round is a new version even with equal counts.
    later = {**loads, A: HostLoad(waiting=1, scraped_at=6.0)}
    assert LoadSnapshot.build("vllm", later).version != snap.version
    snap.check()
    with pytest.raises(SnapshotError):
        LoadSnapshot("vllm", snap.loads, snap.version).check()


def test_content_version_is_canonical() -> None:
    assert content_version({"a": 1, "b": 2}) == content_version({"b": 2, "a": 1})
    assert content_version([1, 2]) != content_version([2, 1])


# --- store --------------------------------------------------------------------------------


def test_publish_unchanged_version_is_a_noop() -> None:
    store = SnapshotStore()
    assert store.generation == 0
    first = fleet(*BASE)
    assert store.publish(first) is True
    assert store.generation == 1
    assert store.publish(fleet(*reversed(BASE))) is False
    assert store.generation == 1
    assert store.get("vllm") is first
    changed = fleet(*BASE, PublishedHost(C))
    assert store.publish(changed) is True
    assert store.generation == 2
    assert store.get("vllm") is changed


def test_store_keeps_one_snapshot_per_name() -> None:
    store = SnapshotStore()
    store.publish(fleet(*BASE))
    store.publish(LoadSnapshot.build("vllm", {A: HostLoad(running=1)}))
    store.publish(fleet(PublishedHost(C), name="other"))
    assert store.names() == frozenset({"vllm", "vllm/load", "other"})
    assert store.generation == 3
    assert store.get("missing") is None


async def test_wait_past_wakes_on_publish() -> None:
    store = SnapshotStore()
    store.publish(fleet(*BASE))
    waiter = asyncio.create_task(store.wait_past(store.generation))
    await asyncio.sleep(0)  # one turn of the loop: the waiter starts waiting
    assert not waiter.done()
    store.publish(fleet(*BASE, PublishedHost(C)))
    assert await asyncio.wait_for(waiter, timeout=1.0) == 2


async def test_wait_past_returns_at_once_when_already_past() -> None:
    store = SnapshotStore()
    store.publish(fleet(*BASE))
    assert await asyncio.wait_for(store.wait_past(0), timeout=1.0) == 1


async def test_wait_past_does_not_wake_on_a_noop_publish() -> None:
    store = SnapshotStore()
    store.publish(fleet(*BASE))
    waiter = asyncio.create_task(store.wait_past(store.generation))
    await asyncio.sleep(0)  # one turn of the loop: the waiter starts waiting
    assert store.publish(fleet(*BASE)) is False
    done, _ = await asyncio.wait({waiter}, timeout=0.2)
    assert not done
    # Still waiting on the same generation: a real change wakes it.
    store.publish(fleet(PublishedHost(C)))
    assert await asyncio.wait_for(waiter, timeout=1.0) == 2


async def test_wait_past_noop_times_out_with_wait_for() -> None:
    store = SnapshotStore()
    store.publish(fleet(*BASE))
    store.publish(fleet(*BASE))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.wait_past(store.generation), timeout=0.1)


async def test_wait_past_wakes_every_waiter() -> None:
    store = SnapshotStore()
    waiters = [asyncio.create_task(store.wait_past(0)) for _ in range(5)]
    await asyncio.sleep(0)  # one turn of the loop: the waiters start waiting
    store.publish(fleet(*BASE))
    results = await asyncio.wait_for(asyncio.gather(*waiters), timeout=1.0)
    assert results == [1] * 5


def test_snapshot_module_imports_no_grpc() -> None:
    code = textwrap.dedent(
        """
        import sys
        import extproc.control.snapshot
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "envoy"))
        bad += sorted(m for m in sys.modules if m.startswith("google.protobuf"))
        print(",".join(bad))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""
