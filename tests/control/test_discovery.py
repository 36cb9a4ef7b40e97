import asyncio
import time

import pytest

from extproc.control.discovery import (
    Discovery,
    DiscoveryError,
    DnsSource,
    Source,
    StaticSource,
)
from extproc.errors import RouterError


class FakeResolver:
    """Answers from a table; a name missing from it fails like NXDOMAIN."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in self.records:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return list(self.records[host])


class ScriptedSource:
    """A source whose next answer the test sets: a frozenset, or an exception to raise."""

    def __init__(self, name: str, answer: frozenset[str] | Exception) -> None:
        self.name = name
        self.answer = answer

    async def addresses(self) -> frozenset[str]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


# --- static ---------------------------------------------------------------------------


async def test_static_source_normalises_its_addresses() -> None:
    source = StaticSource([" 127.0.0.1:8000", "127.0.0.1:08000", "[::1]:9000", "10.0.0.2:80"])
    assert await source.addresses() == frozenset({"127.0.0.1:8000", "[::1]:9000", "10.0.0.2:80"})
    assert source.name == "static"


@pytest.mark.parametrize("bad", ["vllm-0:8000", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:http"])
def test_static_source_rejects_a_bad_entry_naming_it(bad: str) -> None:
    with pytest.raises(DiscoveryError, match=repr(bad).replace("[", r"\[")) as caught:
        StaticSource(["127.0.0.1:8000", bad])
    assert isinstance(caught.value, RouterError)


def test_sources_satisfy_the_protocol() -> None:
    def accepts(source: Source) -> str:
        return source.name

    assert accepts(StaticSource([])) == "static"
    assert accepts(DnsSource([], resolver=FakeResolver({}))) == "dns"


# --- dns ------------------------------------------------------------------------------


async def test_dns_source_unites_the_a_records_of_its_names() -> None:
    resolver = FakeResolver(
        {"vllm-a": ["10.0.0.1", "10.0.0.2"], "vllm-b.svc": ["10.0.0.2", "10.0.0.3"]}
    )
    source = DnsSource(["vllm-a:8000", "vllm-b.svc:8001"], resolver=resolver)
    assert await source.addresses() == frozenset(
        {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.2:8001", "10.0.0.3:8001"}
    )
    assert sorted(resolver.calls) == [("vllm-a", 8000), ("vllm-b.svc", 8001)]


async def test_dns_source_re_resolves_on_every_call() -> None:
    resolver = FakeResolver({"vllm": ["10.0.0.1"]})
    source = DnsSource(["vllm:8000"], resolver=resolver)
    assert await source.addresses() == {"10.0.0.1:8000"}
    resolver.records["vllm"] = ["10.0.0.1", "10.0.0.9"]
    assert await source.addresses() == {"10.0.0.1:8000", "10.0.0.9:8000"}
    assert len(resolver.calls) == 2


async def test_dns_source_passes_ip_literals_through_without_dns() -> None:
    resolver = FakeResolver({})
    source = DnsSource(["127.0.0.5:8000", "[::1]:8001"], resolver=resolver)
    assert await source.addresses() == {"127.0.0.5:8000", "[::1]:8001"}
    assert resolver.calls == []


async def test_dns_source_resolves_localhost_for_real() -> None:
    assert await DnsSource(["localhost:8000"]).addresses() == {"127.0.0.1:8000"}


async def test_dns_failure_raises_discovery_error_naming_the_host() -> None:
    source = DnsSource(["vllm:8000", "missing:8000"], resolver=FakeResolver({"vllm": ["1.2.3.4"]}))
    with pytest.raises(DiscoveryError, match="'missing'"):
        await source.addresses()


async def test_a_name_with_no_records_is_a_failure() -> None:
    source = DnsSource(["empty:8000"], resolver=FakeResolver({"empty": []}))
    with pytest.raises(DiscoveryError, match="no addresses"):
        await source.addresses()


async def test_a_stalled_resolver_times_out() -> None:
    async def stall(host: str, port: int) -> list[str]:
        await asyncio.sleep(10)  # a resolver that never answers in time
        return []

    source = DnsSource(["vllm:8000"], resolver=stall, timeout_s=0.1)
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match="timed out"):
        await source.addresses()
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("bad", ["vllm", ":8000", "vllm:0", "vllm:99999", "vllm:x"])
def test_dns_source_rejects_a_bad_name(bad: str) -> None:
    with pytest.raises(DiscoveryError, match=repr(bad)):
        DnsSource([bad], resolver=FakeResolver({}))


def test_dns_source_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s=0"):
        DnsSource([], timeout_s=0)


# --- discovery ------------------------------------------------------------------------


async def test_discovery_is_the_union_of_its_sources() -> None:
    dns = DnsSource(["vllm:8000"], resolver=FakeResolver({"vllm": ["10.0.0.1", "10.0.0.2"]}))
    discovery = Discovery([StaticSource(["10.0.0.2:8000", "10.0.0.3:8000"]), dns])
    assert await discovery.addresses() == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert discovery.last_errors == {}


async def test_a_failing_source_keeps_its_last_known_addresses() -> None:
    flaky = ScriptedSource("flaky", frozenset({"10.0.0.1:8000"}))
    steady = ScriptedSource("steady", frozenset({"10.0.0.2:8000"}))
    discovery = Discovery([flaky, steady])
    assert await discovery.addresses() == {"10.0.0.1:8000", "10.0.0.2:8000"}

    flaky.answer = DiscoveryError("dns down")
    steady.answer = frozenset({"10.0.0.3:8000"})
    assert await discovery.addresses() == {"10.0.0.1:8000", "10.0.0.3:8000"}
    assert discovery.last_errors == {"flaky": "dns down"}

    # Recovery replaces the kept answer and clears the error.
    flaky.answer = frozenset({"10.0.0.4:8000"})
    assert await discovery.addresses() == {"10.0.0.4:8000", "10.0.0.3:8000"}
    assert discovery.last_errors == {}


async def test_a_source_that_never_answered_contributes_nothing() -> None:
    discovery = Discovery(
        [
            ScriptedSource("broken", DiscoveryError("no such service")),
            ScriptedSource("ok", frozenset({"10.0.0.2:8000"})),
        ]
    )
    assert await discovery.addresses() == {"10.0.0.2:8000"}
    assert discovery.last_errors == {"broken": "no such service"}


async def test_a_dns_blip_never_empties_the_fleet() -> None:
    resolver = FakeResolver({"vllm": ["10.0.0.1", "10.0.0.2"]})
    discovery = Discovery([DnsSource(["vllm:8000"], resolver=resolver)])
    before = await discovery.addresses()
    del resolver.records["vllm"]
    assert await discovery.addresses() == before
    assert "vllm" in discovery.last_errors["dns"]


def test_last_errors_is_read_only() -> None:
    discovery = Discovery([StaticSource([])])
    with pytest.raises(TypeError):
        discovery.last_errors["static"] = "x"  # type: ignore[index]


@pytest.mark.parametrize(
    "sources",
    [[], [StaticSource([]), StaticSource([])]],
    ids=["none", "duplicate-names"],
)
def test_discovery_rejects_bad_source_lists(sources: list[Source]) -> None:
    with pytest.raises(ValueError, match="sources="):
        Discovery(sources)
