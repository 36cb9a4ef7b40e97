"""Routers on Unix sockets behind the real Envoy (pipe endpoints), in both Envoy modes."""

from __future__ import annotations

import httpx
import pytest

from extproc.bench import probes
from extproc.stack.local import LocalStack, start_router
from extproc.stack.processes import free_port_run

from ..prompts import document
from ..reliability.stacks import PINNED_ROUTING, reliability_spec


def decisions(metrics_url: str) -> float:
    return probes.total(probes.scrape(metrics_url), "prefix_router_decisions_total")


@pytest.mark.parametrize(
    ("mode", "body_mode"), [("override-host", "buffered-partial"), ("original-dst", "streamed")]
)
def test_router_workers_on_unix_sockets_decide_every_request(tmp_path, mode, body_mode):
    # Placement by hash alone (no cache-pressure weights, which move a new prefix while the
    # fleet's load shifts), so the two workers' choices can be compared exactly.
    spec = reliability_spec(3)
    with LocalStack(spec) as stack:
        assert spec.control_plane is not None
        path = str(tmp_path / "router.sock")
        # Two workers: worker 0 on the path, worker 1 on the path + .1 (and metrics + 1).
        metrics = free_port_run(2)
        router = start_router(
            "router-unix",
            tmp_path,
            path,
            ("127.0.0.1", metrics),
            spec.control_plane,
            workers=2,
            settings=PINNED_ROUTING,
        )
        envoy, url, admin = stack.start_envoy_beside(
            "envoy-unix", tmp_path, mode=mode, body_mode=body_mode, routers=(path, f"{path}.1")
        )
        try:
            if body_mode == "streamed":
                stack.open_completion_logs(
                    url=url,
                    admin_url=admin,
                    metrics_urls=[f"http://127.0.0.1:{metrics + i}/metrics" for i in (0, 1)],
                )
            served: dict[int, set[str]] = {}
            with httpx.Client(base_url=url, timeout=30) as client:
                for question in range(3):
                    for doc in range(4):
                        body = {
                            "model": "sim-model",
                            "max_tokens": 1,
                            "messages": [
                                {"role": "user", "content": f"{document(doc)} q{question}"}
                            ],
                        }
                        response = client.post("/v1/chat/completions", json=body)
                        assert response.status_code == 200, response.text
                        served.setdefault(doc, set()).add(response.headers["x-upstream-host"])
            per_worker = [decisions(f"http://127.0.0.1:{metrics + i}/metrics") for i in (0, 1)]
        finally:
            envoy.stop()
            router.stop()
    # Every request was decided by a worker on a socket, none failed open, and each
    # document stayed on one host (the two workers agree).
    assert sum(per_worker) >= 12 and all(n > 0 for n in per_worker), per_worker
    assert all(len(hosts) == 1 for hosts in served.values()), served
