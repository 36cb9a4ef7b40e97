"""Port choice for the local stack: ports a polling client can never be handed as its
own source, so it never connects to itself while a server is starting."""

import socket
from pathlib import Path

import pytest

from extproc.stack import processes
from extproc.stack.processes import free_port_run, free_ports, free_ports_on, port_is_free


def test_chosen_ports_lie_below_the_ephemeral_range_and_are_distinct() -> None:
    low = processes._ephemeral_low()
    for _ in range(20):
        ports = free_ports(6)
        assert len(set(ports)) == 6
        assert all(processes._LOWEST_PORT <= port < low for port in ports)
        assert all(port_is_free("127.0.0.1", port) for port in ports)
        base = free_port_run(3)
        assert base >= processes._LOWEST_PORT and base + 3 <= low


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hold every port of a small window but one; only that one can come back.
    monkeypatch.setattr(processes, "_LOWEST_PORT", 15000)
    monkeypatch.setattr(processes, "_MIN_SPAN", 10)
    monkeypatch.setattr(processes, "_ephemeral_low", lambda: 15050)
    monkeypatch.setattr(processes, "_HANDED_OUT", set())
    held = []
    try:
        for port in range(15000, 15050):
            if port == 15025:
                continue
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        if not port_is_free("127.0.0.1", 15025):
            pytest.fail("port 15025 is taken on this machine; the window cannot be built")
        assert free_ports(1, "127.0.0.1") == [15025]
        with pytest.raises(OSError, match="no 2 free ports"):
            free_ports(2, "127.0.0.1")
    finally:
        for sock in held:
            sock.close()


def test_a_port_handed_out_is_never_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing binds the ports between the calls, as when a benchmark asks for its ports
    # in several calls before it starts anything: each is still handed out once.
    monkeypatch.setattr(processes, "_HANDED_OUT", set())
    monkeypatch.setattr(processes, "_MIN_SPAN", 1000)
    handed: list[int] = []
    for _ in range(60):
        handed += free_ports(2)
        base = free_port_run(3)
        handed += range(base, base + 3)
    assert len(handed) == len(set(handed)) == 300


def test_a_port_is_free_on_every_host_asked() -> None:
    hosts = ("127.0.0.1", "127.0.0.2")
    (port,) = free_ports_on(1, hosts)
    assert all(port_is_free(host, port) for host in hosts)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert processes._ephemeral_low(str(setting)) == 40000
    assert processes._ephemeral_low(str(tmp_path / "absent")) == 32768
