"""The snippets in docs/mesh/ load into the real Envoy binary and match the shipped bootstraps.

Most snippets are fragments, not bootstraps: a list of HTTP filters, a list of clusters, a
list of routes, or a field of a listener. ``embed`` places fragments into a minimal
bootstrap (one listener, one HTTP connection manager, the given clusters), and
``envoy --mode validate`` then checks every field, type URL and enum against Envoy 1.40's
own schema, and that routes name defined clusters. Validate mode does *not* check the
cluster an ext_proc ``envoy_grpc`` names, so ``undefined_clusters`` checks that here.

Validate mode checks schema, not behaviour, so one assembly also runs for real against a
running stack and must send each prompt where the router says. docs/mesh.md shows each
snippet verbatim: a test compares its code blocks with the files. The Istio and Envoy
Gateway manifests cannot be applied here (no Kubernetes, no controllers); what is checked
about them is said test by test below.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.adapter.messages import TARGET_HEADER
from extproc.stack.bootstrap import CLIENT_ROUTING_HEADERS, BootstrapParams, build_bootstrap
from extproc.stack.local import LocalStack, StackSpec, envoy_binary
from extproc.stack.processes import ManagedProcess, free_ports, http_ok, tcp_open, wait_until

ROOT = Path(__file__).resolve().parents[2]
MESH = ROOT / "docs" / "mesh"
GUIDE = ROOT / "docs" / "mesh.md"

_TYPE = "type.googleapis.com/envoy."
ROUTER_FILTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": _TYPE + "extensions.filters.http.router.v3.Router"},
}


def load(name: str) -> Any:
    return yaml.safe_load((MESH / name).read_text())


# --- embedding fragments into a minimal bootstrap ------------------------------------------


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def stand_in_cluster(name: str) -> dict[str, Any]:
    """A cluster for a service the reader already runs (e.g. their ext_authz server)."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address("127.0.0.1", 1)}}]}],
        },
    }


def embed(
    *,
    http_filters: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    routes: list[dict[str, Any]],
    listener_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A minimal bootstrap around fragments.

    One listener (plus ``listener_fields``) whose HTTP connection manager runs
    ``http_filters``, with the router filter appended unless they already end with it, and
    one virtual host of ``routes``; ``clusters`` are the static clusters.
    """
    filters = list(http_filters)
    if not filters or filters[-1]["name"] != ROUTER_FILTER["name"]:
        filters.append(ROUTER_FILTER)
    manager = {
        "@type": _TYPE
        + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "name": "llm",
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": routes}],
        },
        "http_filters": filters,
    }
    listener = {
        "name": "ingress",
        "address": _address("127.0.0.1", 10000),
        **(listener_fields or {}),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {
        "node": {"id": "mesh-snippet", "cluster": "mesh-snippet"},
        "admin": {"address": _address("127.0.0.1", 9901)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def undefined_clusters(bootstrap: dict[str, Any]) -> set[str]:
    """Cluster names referenced anywhere (routes, gRPC services) but not defined."""
    defined = {c["name"] for c in bootstrap["static_resources"]["clusters"]}
    config = {k: v for k, v in bootstrap.items() if k != "node"}  # node.cluster is no cluster
    referenced = {
        value
        for key, value in _walk(config)
        if key in ("cluster", "cluster_name") and isinstance(value, str)
    }
    return referenced - defined


def validate(bootstrap: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_valid(bootstrap: dict[str, Any], tmp_path: Path) -> None:
    assert not undefined_clusters(bootstrap), undefined_clusters(bootstrap)
    result = validate(bootstrap, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


# --- the snippets, assembled the way docs/mesh.md tells a reader to ------------------------


def override_host_proxy(ext_proc: str = "ext-proc-filter.yaml") -> dict[str, Any]:
    return embed(
        listener_fields=load("listener-buffer-limit.yaml"),
        http_filters=load("header-strip-filter.yaml") + load(ext_proc),
        routes=load("route.yaml"),
        clusters=load("cluster-router.yaml") + load("cluster-override-host.yaml"),
    )


def original_dst_proxy() -> dict[str, Any]:
    return embed(
        listener_fields=load("listener-buffer-limit.yaml"),
        http_filters=load("header-strip-filter.yaml") + load("ext-proc-filter-fail-closed.yaml"),
        routes=load("route.yaml"),
        clusters=load("cluster-router.yaml") + load("cluster-original-dst.yaml"),
    )


def full_filter_chain() -> dict[str, Any]:
    return embed(
        http_filters=load("filter-order.yaml"),
        routes=load("route.yaml"),
        clusters=[
            *load("cluster-router.yaml"),
            *load("cluster-override-host.yaml"),
            stand_in_cluster("ext_authz"),
        ],
    )


# Each Envoy snippet, and a bootstrap that contains it.
ASSEMBLIES: dict[str, Callable[[], dict[str, Any]]] = {
    "header-strip-filter.yaml": override_host_proxy,
    "ext-proc-filter.yaml": override_host_proxy,
    "ext-proc-filter-fail-closed.yaml": original_dst_proxy,
    "filter-order.yaml": full_filter_chain,
    "cluster-router.yaml": override_host_proxy,
    "cluster-override-host.yaml": override_host_proxy,
    "cluster-original-dst.yaml": original_dst_proxy,
    "route.yaml": override_host_proxy,
    "listener-buffer-limit.yaml": override_host_proxy,
}


def test_every_envoy_snippet_is_validated():
    assert {p.name for p in MESH.glob("*.yaml")} == set(ASSEMBLIES)


@pytest.mark.parametrize("snippet", sorted(ASSEMBLIES))
def test_snippet_loads_into_envoy(tmp_path, snippet):
    assert_valid(ASSEMBLIES[snippet](), tmp_path)


def test_validation_rejects_a_broken_snippet(tmp_path):
    broken = (
        (MESH / "ext-proc-filter.yaml").read_text().replace("BUFFERED_PARTIAL", "BUFFERED_PARTLY")
    )
    bootstrap = override_host_proxy()
    http_filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    http_filters["typed_config"]["http_filters"][1] = yaml.safe_load(broken)[0]
    result = validate(bootstrap, tmp_path)
    assert result.returncode != 0
    assert "BUFFERED_PARTLY" in result.stdout + result.stderr


def test_validation_rejects_a_route_to_a_missing_cluster(tmp_path):
    bootstrap = embed(
        http_filters=load("header-strip-filter.yaml"),
        routes=load("route.yaml"),
        clusters=load("cluster-router.yaml"),
    )
    result = validate(bootstrap, tmp_path)
    assert result.returncode != 0
    assert "unknown cluster 'vllm'" in result.stdout + result.stderr


def test_an_ext_proc_filter_without_its_cluster_is_caught_here():
    # Envoy's validate mode accepts this; the router would only fail at request time.
    bootstrap = embed(
        http_filters=load("ext-proc-filter.yaml"),
        routes=load("route.yaml"),
        clusters=load("cluster-override-host.yaml"),
    )
    assert undefined_clusters(bootstrap) == {"prefix_router"}


# --- an Envoy built from the snippets routes real traffic -----------------------------------
#
# validate mode checks the schema, not behaviour. This runs the override-host assembly for
# real, against a running stack's control plane (over plain EDS, as the snippet configures
# it, not the ADS the shipped bootstrap uses) and router, and checks that it sends each
# prompt where the stack's own Envoy does: to the router's choice, not to a fallback.


def _endpoints(address: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"lb_endpoints": [{"endpoint": {"address": _address(*address)}}]}]


def _chat(text: str) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
        "max_tokens": 1,
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(
        StackSpec.ephemeral(3, sim_args=("--ttft-ms", "0", "--itl-ms", "0"))
    ) as running:
        yield running


def same_hosts_as_the_stack(stack: LocalStack, bootstrap: dict[str, Any], tmp_path: Path) -> bool:
    """Run ``bootstrap`` pointed at ``stack``; does it send each prompt where the stack does?"""
    spec = stack.spec
    assert spec.control_plane is not None
    listen, admin = free_ports(2)
    bootstrap["admin"]["address"] = _address("127.0.0.1", admin)
    bootstrap["static_resources"]["listeners"][0]["address"] = _address("127.0.0.1", listen)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    # The snippets' placeholder addresses, pointed at the running stack.
    clusters["prefix_router"]["load_assignment"]["endpoints"] = _endpoints(spec.router)
    clusters["prefix_router_xds"]["load_assignment"]["endpoints"] = _endpoints(spec.control_plane)
    config = tmp_path / "snippets.yaml"
    config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    argv = [envoy_binary(), "-c", str(config), "--log-level", "warning", "--disable-hot-restart"]
    envoy = ManagedProcess("snippet-envoy", argv, tmp_path / "envoy.log").start()
    try:
        wait_until(
            lambda: http_ok(f"http://127.0.0.1:{admin}/ready") and tcp_open("127.0.0.1", listen),
            30,
            "the snippet-built Envoy",
            envoy,
        )
        fleet = {f"{h}:{p}" for h, p in spec.backends}
        same = []
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30) as snippets,
            httpx.Client(base_url=stack.url, timeout=30) as shipped,
        ):
            for n in range(10):
                body = _chat(f"document {n}: " + "lorem ipsum dolor sit amet " * 400)
                expected = shipped.post("/v1/chat/completions", json=body)
                assert expected.status_code == 200
                for _ in range(2):
                    got = snippets.post("/v1/chat/completions", json=body)
                    assert got.status_code == 200, got.text
                    assert got.headers["x-served-by"] in fleet
                    same.append(got.headers["x-served-by"] == expected.headers["x-served-by"])
        return all(same)
    finally:
        envoy.stop()


def test_an_envoy_built_from_the_snippets_follows_the_router(stack, tmp_path):
    assert same_hosts_as_the_stack(stack, override_host_proxy(), tmp_path)


def test_without_the_metadata_option_envoy_ignores_the_router(stack, tmp_path):
    # The control for the test above: Envoy then falls back to least-request, and 20
    # requests over 3 idle hosts do not all land where the router said by chance.
    bootstrap = override_host_proxy()
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    del manager["typed_config"]["http_filters"][1]["typed_config"]["metadata_options"]
    assert not same_hosts_as_the_stack(stack, bootstrap, tmp_path)


# --- the snippets say what the shipped bootstraps (extproc/stack/bootstrap.py) say ----------


def _generated(mode: str, **params: Any) -> dict[str, Any]:
    bootstrap = build_bootstrap(BootstrapParams(mode=mode, **params))  # type: ignore[arg-type]
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return {
        "listener": listener,
        "filters": manager["http_filters"],
        "routes": manager["route_config"]["virtual_hosts"][0]["routes"],
        "clusters": {c["name"]: c for c in bootstrap["static_resources"]["clusters"]},
    }


def test_filters_match_the_generated_bootstraps():
    override_host = _generated("override-host")
    original_dst = _generated("original-dst")
    strip, ext_proc, router = override_host["filters"]
    assert load("header-strip-filter.yaml") == [strip]
    assert load("ext-proc-filter.yaml") == [ext_proc]
    assert load("ext-proc-filter-fail-closed.yaml") == [original_dst["filters"][1]]
    # The full chain carries the same three, in the same order, after the reader's own filters.
    assert load("filter-order.yaml")[-3:] == [strip, ext_proc, router]


def test_clusters_match_the_generated_bootstraps():
    replicas = tuple((f"10.0.0.{n}", 9290) for n in (21, 22, 23))
    generated = _generated("override-host", routers=replicas)
    assert load("cluster-router.yaml") == [generated["clusters"]["prefix_router"]]
    vllm, xds = load("cluster-override-host.yaml")
    shipped = generated["clusters"]["vllm"]
    assert vllm["load_balancing_policy"] == shipped["load_balancing_policy"]
    assert vllm["connect_timeout"] == shipped["connect_timeout"]
    assert vllm["typed_extension_protocol_options"] == shipped["typed_extension_protocol_options"]
    eds = vllm["eds_cluster_config"]["eds_config"]
    assert eds["api_config_source"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == xds["name"]
    assert (
        xds["typed_extension_protocol_options"]
        == generated["clusters"]["xds"]["typed_extension_protocol_options"]
    )
    assert load("cluster-original-dst.yaml") == [_generated("original-dst")["clusters"]["vllm"]]


def test_route_and_listener_match_the_generated_bootstraps():
    generated = _generated("override-host")
    assert load("route.yaml") == generated["routes"]
    assert load("listener-buffer-limit.yaml") == {
        "per_connection_buffer_limit_bytes": generated["listener"][
            "per_connection_buffer_limit_bytes"
        ]
    }


# --- docs/mesh.md shows the files verbatim -------------------------------------------------

_SNIPPET_BLOCK = re.compile(r"\[`docs/mesh/([^`]+)`\]\([^)]*\):\n\n```yaml\n(.*?)```", re.S)


def test_guide_shows_every_snippet_verbatim():
    guide = GUIDE.read_text()
    shown = {name: body for name, body in _SNIPPET_BLOCK.findall(guide)}
    files = {str(p.relative_to(MESH)) for p in MESH.rglob("*.yaml")}
    assert set(shown) == files
    for name, body in shown.items():
        assert body == (MESH / name).read_text(), f"docs/mesh.md's copy of {name} is stale"
    # No YAML in the guide escapes these checks.
    assert guide.count("```yaml") == len(shown)


# --- Istio: docs/mesh/istio/envoyfilter.yaml -----------------------------------------------
#
# Checked: the manifest parses; its patch values equal the Envoy snippets above; and the
# patches, applied the way Istio documents them (INSERT_BEFORE the router filter, ADD a
# cluster, MERGE into a listener or into the cluster Istio generates for a Service) to a
# bootstrap shaped like an Istio gateway's, load into Envoy. Not checked: the EnvoyFilter
# CRD schema, istiod's real proto merge, and the configuration istiod actually generates.

ISTIO_VLLM = "outbound|8000||vllm.llm.svc.cluster.local"


def istio_like_gateway() -> dict[str, Any]:
    """The parts of an Istio gateway's config the patches touch: a listener whose HTTP
    filters end with the router filter, and an EDS (over ADS) cluster for the vLLM Service."""
    bootstrap = embed(
        http_filters=[],
        routes=[{"match": {"prefix": "/"}, "route": {"cluster": ISTIO_VLLM, "timeout": "0s"}}],
        clusters=[
            {
                "name": ISTIO_VLLM,
                "type": "EDS",
                "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
                "connect_timeout": "10s",
                "lb_policy": "LEAST_REQUEST",
            },
            {
                **stand_in_cluster("xds-grpc"),
                "typed_extension_protocol_options": load("cluster-router.yaml")[0][
                    "typed_extension_protocol_options"
                ],
            },
        ],
    )
    bootstrap["dynamic_resources"] = {
        "ads_config": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}],
        }
    }
    return bootstrap


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    # Enough of proto merge for these patches: new fields and nested messages only.
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            assert not isinstance(target.get(key), list), f"list merge of {key} not emulated"
            target[key] = copy.deepcopy(value)


def apply_envoy_filter(bootstrap: dict[str, Any], envoy_filter: dict[str, Any]) -> None:
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    clusters = bootstrap["static_resources"]["clusters"]
    for patch in envoy_filter["spec"]["configPatches"]:
        apply_to, match = patch["applyTo"], patch["match"]
        operation, value = patch["patch"]["operation"], patch["patch"]["value"]
        assert match["context"] == "GATEWAY"
        if (apply_to, operation) == ("LISTENER", "MERGE"):
            _merge(listener, value)
        elif (apply_to, operation) == ("HTTP_FILTER", "INSERT_BEFORE"):
            chain = match["listener"]["filterChain"]["filter"]
            assert chain["name"] == "envoy.filters.network.http_connection_manager"
            names = [f["name"] for f in manager["http_filters"]]
            manager["http_filters"].insert(names.index(chain["subFilter"]["name"]), value)
        elif (apply_to, operation) == ("CLUSTER", "ADD"):
            clusters.append(value)
        elif (apply_to, operation) == ("CLUSTER", "MERGE"):
            name = f"outbound|{match['cluster']['portNumber']}||{match['cluster']['service']}"
            _merge(next(c for c in clusters if c["name"] == name), value)
        else:
            raise AssertionError(f"patch {apply_to}/{operation} is not emulated")


def _istio_filter() -> dict[str, Any]:
    (envoy_filter,) = yaml.safe_load_all((MESH / "istio" / "envoyfilter.yaml").read_text())
    assert envoy_filter["apiVersion"] == "networking.istio.io/v1alpha3"
    assert envoy_filter["kind"] == "EnvoyFilter"
    return envoy_filter


def test_istio_patches_carry_the_envoy_snippets():
    values = [p["patch"]["value"] for p in _istio_filter()["spec"]["configPatches"]]
    listener, strip, ext_proc, router_cluster, vllm = values
    assert listener == load("listener-buffer-limit.yaml")
    assert [strip] == load("header-strip-filter.yaml")
    assert [ext_proc] == load("ext-proc-filter.yaml")
    policy = load("cluster-override-host.yaml")[0]["load_balancing_policy"]
    assert vllm == {"load_balancing_policy": policy}
    # The router cluster differs only in how it finds the replicas (a headless Service).
    how = {"type", "dns_lookup_family", "load_assignment"}
    static = load("cluster-router.yaml")[0]
    assert {k: v for k, v in router_cluster.items() if k not in how} == {
        k: v for k, v in static.items() if k not in how
    }


def test_istio_patched_gateway_loads_into_envoy(tmp_path):
    bootstrap = istio_like_gateway()
    apply_envoy_filter(bootstrap, _istio_filter())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in manager["typed_config"]["http_filters"]]
    assert names == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    assert_valid(bootstrap, tmp_path)


# --- Envoy Gateway: docs/mesh/envoy-gateway/ -----------------------------------------------
#
# Checked: the manifests parse, and each setting agrees with the Envoy snippet it stands
# for. Not checked: the CRD schemas, and the Envoy config Envoy Gateway would generate.


def _gateway_manifests() -> dict[str, dict[str, Any]]:
    manifests = {}
    for path in sorted((MESH / "envoy-gateway").glob("*.yaml")):
        (manifest,) = yaml.safe_load_all(path.read_text())
        assert manifest["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
        manifests[manifest["kind"]] = manifest["spec"]
    return manifests


def _seconds(duration: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(ms|s)", duration).groups()  # type: ignore[union-attr]
    return float(number) / (1000 if unit == "ms" else 1)


def test_envoy_gateway_settings_match_the_envoy_snippets():
    manifests = _gateway_manifests()
    assert set(manifests) == {"EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy"}
    (ext_proc,) = manifests["EnvoyExtensionPolicy"]["extProc"]
    envoy = load("ext-proc-filter.yaml")[0]["typed_config"]
    assert ext_proc["processingMode"] == {"request": {"body": "BufferedPartial"}}
    assert _seconds(ext_proc["messageTimeout"]) == _seconds(envoy["message_timeout"])
    assert ext_proc["failOpen"] is envoy["failure_mode_allow"]
    assert (
        ext_proc["metadataOptions"]["receivingNamespaces"]
        == envoy["metadata_options"]["receiving_namespaces"]
    )
    traffic = manifests["BackendTrafficPolicy"]
    assert traffic["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": TARGET_HEADER}]
    retry = load("route.yaml")[0]["route"]["retry_policy"]
    assert traffic["retry"]["numRetries"] == retry["num_retries"]
    assert ",".join(traffic["retry"]["retryOn"]["triggers"]) == retry["retry_on"]
    limit = manifests["ClientTrafficPolicy"]["connection"]["bufferLimit"]
    assert int(limit.removesuffix("Mi")) * 1024 * 1024 == BootstrapParams.buffer_limit_bytes
    # The same client routing headers the other recipes strip, before any filter runs.
    early = manifests["ClientTrafficPolicy"]["headers"]["earlyRequestHeaders"]
    assert early == {"remove": list(CLIENT_ROUTING_HEADERS)}
