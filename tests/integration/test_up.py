"""`prefix-router up` end to end: serves with affinity, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from extproc import ports
from extproc.bench.probes import scrape
from extproc.stack.processes import free_port, free_ports_on, tcp_open, wait_until


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # Field 4 of /proc/PID/stat is the parent pid (after "pid (comm) state").
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_banner(up: subprocess.Popen[str]) -> str:
    """What ``prefix-router up`` printed until it said it is up (within 60 s)."""
    deadline = time.monotonic() + 60
    banner = ""
    while "is up" not in banner and time.monotonic() < deadline:
        line = up.stdout.readline() if up.stdout else ""
        assert line, f"prefix-router up exited early: {banner}"
        banner += line
    return banner


def test_up_serves_with_affinity_and_stops_cleanly(tmp_path):
    port = free_port()
    work_dir = tmp_path / "stack"
    argv = [
        sys.executable,
        "-m",
        "extproc",
        "up",
        "--listen",
        f"127.0.0.1:{port}",
        "--admin",
        f"127.0.0.1:{free_port()}",
        "--router-listen",
        f"127.0.0.1:{free_port()}",
        "--router-metrics",
        f"127.0.0.1:{free_port()}",
        "--sim-port",
        str(free_port("127.0.0.11")),
        "--sim-ttft-ms",
        "0",
        "--sim-itl-ms",
        "0",
        "--work-dir",
        str(work_dir),
    ]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = wait_for_banner(up)
        assert f"http://127.0.0.1:{port}" in banner
        children = children_of(up.pid)
        assert len(children) == 6  # 3 simulators, the control plane, the router and Envoy

        hosts: dict[int, set[str]] = {}
        for question in range(3):
            for document in range(6):
                text = f"document {document} " * 1000 + f"question {question}"
                body = {"model": "sim-model", "messages": [{"role": "user", "content": text}]}
                response = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=10
                )
                assert response.status_code == 200
                hosts.setdefault(document, set()).add(response.headers["x-upstream-host"])
        assert all(len(served) == 1 for served in hosts.values())

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        up.stdout.close()
    assert [pid for pid in children if alive(pid)] == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


def test_up_starts_every_default_port_together_with_two_workers(tmp_path):
    """No address flag at all: Envoy, two router workers, the control plane and the
    simulators each bind their default ports (worker 1's metrics port once collided with
    the control plane's)."""
    argv = [sys.executable, "-m", "extproc", "up", "--workers", "2"]
    argv += ["--sim-ttft-ms", "0", "--sim-itl-ms", "0", "--work-dir", str(tmp_path / "stack")]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = wait_for_banner(up)
        url = f"http://{ports.loopback(ports.ENVOY_LISTEN)}"
        assert url in banner
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200
        for worker in range(2):
            metrics = ports.loopback(ports.ROUTER_METRICS + worker)
            assert "prefix_router_hosts" in httpx.get(f"http://{metrics}/metrics").text
        control = ports.loopback(ports.CONTROL_PLANE_METRICS)
        assert httpx.get(f"http://{control}/metrics").status_code == 200
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        up.stdout.close()


def test_up_with_a_backend_that_publishes_reads_its_events_with_no_extra_flag(tmp_path):
    """``up --backend URL`` against an engine started with KV events: the router finds its
    publisher at GET /kv_event_sources and reads it, with no flag about events."""
    host = "127.0.0.31"
    sim_port, publish, replay = free_ports_on(3, (host,))
    sim = subprocess.Popen(
        [sys.executable, "-m", "extproc", "sim", "--address", f"{host}:{sim_port}",
         "--kv-events", "--kv-events-port", str(publish),
         "--kv-events-replay-port", str(replay)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "extproc", "up", "--backend", f"http://{host}:{sim_port}"]
    argv += ["--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}"]
    argv += ["--router-listen", f"127.0.0.1:{free_port()}"]
    argv += ["--router-metrics", f"127.0.0.1:{metrics}", "--work-dir", str(tmp_path / "stack")]
    up = None
    try:
        wait_until(lambda: tcp_open(host, sim_port), 30, "the simulator")
        up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for_banner(up)

        def precise_hosts() -> float:
            samples = scrape(f"http://127.0.0.1:{metrics}/metrics")
            return samples.get(("prefix_router_kv_events_hosts", (("state", "precise"),)), 0.0)

        wait_until(lambda: precise_hosts() == 1, 30, "the router reading the engine's events")
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi " * 300}]}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 200
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    finally:
        if up is not None:
            if up.poll() is None:
                up.kill()
                up.wait()
            if up.stdout is not None:
                up.stdout.close()
        sim.terminate()
        sim.wait(timeout=10)
