"""compose/: every profile renders, the GPU profile is wired as documented, and the CPU
profile comes up for real and routes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from extproc import metrics as shared_metrics
from extproc.adapter import metrics as router_metrics
from extproc.control import metrics as control_plane_metrics
from extproc.stack import prometheus
from extproc.stack.bootstrap import BootstrapParams, render
from extproc.stack.local import envoy_binary

from .containers import document, wait_for

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
PROFILES = ["gpu", "cpu", "observability", "cpu,observability", "gpu,observability"]


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("CI"):
        pytest.fail("CI installs Debian's docker-compose for this tier")
    pytest.skip("no docker-compose")


def compose(*args: str, profiles: str, env: dict[str, str] | None = None, files=()) -> str:
    command = [*compose_command(), "--env-file", str(COMPOSE_DIR / ".env.example")]
    for name in ("docker-compose.yaml", *files):
        command += ["-f", str(COMPOSE_DIR / name)]
    result = subprocess.run(
        [*command, *args],
        cwd=COMPOSE_DIR,
        env={**os.environ, "COMPOSE_PROFILES": profiles, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{' '.join(args)}: {result.stderr[-2000:]}"
    return result.stdout


@pytest.mark.parametrize("profiles", PROFILES)
def test_every_profile_renders(profiles: str):
    rendered = yaml.safe_load(compose("config", profiles=profiles))
    assert rendered["services"]


def test_gpu_profile_runs_vllm_with_prefix_caching_on_its_own_gpu():
    services = yaml.safe_load(compose("config", profiles="gpu"))["services"]
    gpus = []
    for name in ("vllm-0", "vllm-1"):
        vllm = services[name]
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert "--enable-prefix-caching" in vllm["command"]
        assert "--model=Qwen/Qwen2.5-1.5B-Instruct" in vllm["command"]  # from .env.example
        (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
    assert gpus == ["0", "1"]
    for name in ("router", "control-plane"):
        assert services[name]["network_mode"] == "service:envoy"
    # The control plane finds the vLLM containers by their service names.
    plane = yaml.safe_load((COMPOSE_DIR / "config/gpu/control-plane.yaml").read_text())
    assert plane["dns"] == ["vllm-0:8000", "vllm-1:8000"]


def test_gpu_envoy_bootstrap_is_generated_and_loads():
    path = COMPOSE_DIR / "config/gpu/envoy.yaml"
    # The compose quick start shows which vLLM served each response (x-upstream-host).
    params = BootstrapParams(
        listen=("0.0.0.0", 10000), admin=("0.0.0.0", 9901), upstream_host_header=True
    )
    expected = render(params)
    body = "".join(path.read_text().splitlines(keepends=True)[2:])  # after the two comments
    assert body == expected, "regenerate: see the first line of compose/config/gpu/envoy.yaml"
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b((?:prefix_router|vllm:|envoy_)[\w:]*)", expr))
    return {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in names}


def test_dashboard_queries_name_metrics_that_exist():
    dashboard = json.loads(
        (COMPOSE_DIR / "observability/grafana/dashboards/prefix-router.json").read_text()
    )
    titles = {panel["title"] for panel in dashboard["panels"]}
    for wanted in (
        "hit rate",
        "Overflow",
        "share",
        "first token",
        "Routing latency",
        "feed",
        "Shadow mode",
    ):
        assert any(wanted.lower() in title.lower() for title in titles), wanted
    declared = [
        metric
        for module in (router_metrics, control_plane_metrics, shared_metrics)
        for metric in vars(module).values()
    ]
    router_names = {metric._name for metric in declared if hasattr(metric, "_name")}
    # Collectors that export several families name them in describe().
    for metric in declared:
        if (
            not isinstance(metric, type)
            and not hasattr(metric, "_name")
            and hasattr(metric, "describe")
        ):
            router_names |= {family.name for family in metric.describe()}
    sim_names = set(
        re.findall(r'"(vllm:\w+)"', (COMPOSE_DIR.parent / "extproc/sim/metrics.py").read_text())
    )
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in _metric_names(target["expr"]):
                if name.startswith("envoy_"):
                    continue  # Envoy's own stats, checked against a live Envoy elsewhere
                assert name in router_names | sim_names, f"{panel['title']}: {name}"


def test_prometheus_scrapes_every_component():
    config = yaml.safe_load((COMPOSE_DIR / "observability/prometheus.yaml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"prefix-router", "control-plane", "envoy", "vllm"}
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    targets = [t for job in jobs.values() for sc in job["static_configs"] for t in sc["targets"]]
    assert all(t.startswith("127.0.0.1:") for t in targets)


def test_cpu_profile_comes_up_and_routes_by_prefix(docker, images):
    project = f"prtest{os.getpid()}"
    env = {"TAG": "local"}
    run = {"profiles": "cpu", "env": env, "files": ("host-network-only.yaml",)}
    compose("-p", project, "up", "-d", "--no-build", **run)
    try:
        fleet = {"127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"}
        url = "http://127.0.0.1:10000/v1/chat/completions"

        def post(doc: int) -> httpx.Response:
            body = {
                "model": "model",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": document(doc)}],
            }
            return httpx.post(url, json=body, timeout=30)

        def ask(doc: int) -> str:
            response = post(doc)
            assert response.status_code == 200, response.text[:300]
            return response.headers["x-served-by"]

        def routed() -> bool:
            if post(0).status_code != 200:
                return False
            text = httpx.get("http://127.0.0.1:9190/metrics", timeout=2).text
            # The router places over the fleet and has made at least one decision.
            return "prefix_router_hosts 3.0" in text and "prefix_router_decisions_total{" in text

        def shed() -> float:
            samples = prometheus.scrape("http://127.0.0.1:9190/metrics")
            return prometheus.total(samples, "prefix_router_shed_total")

        def home(doc: int) -> str:
            """The one host of ``doc``'s asks. Asks the router shed (its loop ran late:
            on a 2-core CI machine the OS alone can delay it) are placed by load on
            purpose, so a round with a shed is asked again, at most three times."""
            for _ in range(3):
                before = shed()
                seen = {ask(doc) for _ in range(4)}
                if shed() == before:
                    assert len(seen) == 1, f"document {doc} went to {seen}"
                    return seen.pop()
            pytest.fail(f"the router shed in each of 3 rounds of document {doc}")

        wait_for(routed, "the CPU profile to route", timeout=90)
        homes = {doc: home(doc) for doc in range(10)}
        assert set(homes.values()) <= fleet
        assert len(set(homes.values())) >= 2
        # No project network was made: the CPU profile lives on the host network.
        assert not docker.networks.list(names=[f"{project}_fleet"])
    finally:
        compose("-p", project, "down", "--timeout", "10", **run)
    label = f"com.docker.compose.project={project}"
    assert not docker.containers.list(all=True, filters={"label": label})
