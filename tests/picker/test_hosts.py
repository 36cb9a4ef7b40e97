import pytest

from extproc.picker.hosts import HostSet, parse_host_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", "127.0.0.1:80"),
        (" 10.0.0.1:08000", "10.0.0.1:8000"),
        ("[::1]:9", "[::1]:9"),
    ],
)
def test_addresses_are_normalised(text, expected):
    assert parse_host_address(text) == expected


@pytest.mark.parametrize(
    "text", ["localhost:80", "127.0.0.1", "127.0.0.1:0", "1.2.3.4:70000", ":80"]
)
def test_bad_addresses_name_the_input(text):
    with pytest.raises(ValueError, match="host"):
        parse_host_address(text)


def test_host_set_is_sorted_and_deduplicated():
    hosts = HostSet.of(["127.0.0.3:1", "127.0.0.2:1", "127.0.0.3:1"])
    assert [h.address for h in hosts.hosts] == ["127.0.0.2:1", "127.0.0.3:1"]


def test_serving_restricts_to_hosts_with_the_adapter_and_falls_back_to_all():
    from extproc.picker.hosts import Host

    hosts = HostSet.of_hosts(
        [
            Host.of("127.0.0.1:1", frozenset({"base", "lora-a"})),
            Host.of("127.0.0.2:1", frozenset({"base", "lora-a"})),
            Host.of("127.0.0.3:1", frozenset({"base"})),
        ]
    )
    assert hosts.serving("lora-a").addresses == {"127.0.0.1:1", "127.0.0.2:1"}
    assert hosts.serving("base") is hosts
    assert hosts.serving("lora-unknown") is hosts
    assert hosts.serving(None) is hosts
