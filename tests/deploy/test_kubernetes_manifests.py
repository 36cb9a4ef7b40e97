"""deploy/kubernetes/ and the YAML in docs/kubernetes.md, checked offline.

No API server runs here, so nothing is applied. What is checked: every manifest parses;
the InferencePool obeys the inference.networking.k8s.io/v1 rules (a checker written from
the API's validation, itself tested on broken pools); the names and ports the objects use
to find each other agree; the containers' args parse with the real ``prefix-router``
parser, and the configs they load pass the real loaders; the probes ask the health server
for services it serves; the standalone Envoy's bootstrap is the generator's output, and
the real Envoy binary accepts it. Not checked: the CRD and core schemas themselves, and
anything a controller or the kubelet does.

Regenerate deploy/kubernetes/standalone-envoy.yaml after a change to
extproc/stack/gateways.py with ``PYTHONPATH=. python tests/deploy/test_kubernetes_manifests.py``.
"""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.adapter.messages import LB_METADATA_KEY
from extproc.adapter.service import LIVENESS_SERVICE, READY_SERVICES
from extproc.cli import build_parser
from extproc.cli.epp import overrides_of
from extproc.config import load_config
from extproc.control.config import load_control_plane_config
from extproc.stack.gateways import GatewayParams, build_gateway, render_gateway
from extproc.stack.local import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
GUIDE = ROOT / "docs" / "kubernetes.md"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# The reference standalone Envoy runs beside the picker, in its pod.
STANDALONE = GatewayParams(
    gateway="standalone",
    listen=("0.0.0.0", 8081),
    admin=("127.0.0.1", 9901),
    picker=("127.0.0.1", 9002),
)
STANDALONE_FILE = MANIFESTS / "standalone-envoy.yaml"
STANDALONE_CONFIGMAP = "prefix-router-standalone-envoy"
STANDALONE_HEADER = """\
# Generated: do not edit. The reference standalone Envoy's bootstrap, exactly
#   render_gateway(GatewayParams(gateway="standalone", listen=("0.0.0.0", 8081),
#                  admin=("127.0.0.1", 9901), picker=("127.0.0.1", 9002)))
# from extproc/stack/gateways.py. tests/deploy/test_kubernetes_manifests.py keeps it in
# step (it fails when the two differ) and rewrites it:
#   PYTHONPATH=. python tests/deploy/test_kubernetes_manifests.py
# The Envoy runs as a container in the prefix-router-epp pod, beside the picker, hence the
# picker at 127.0.0.1 (docs/kubernetes.md, "The reference standalone Envoy").
"""


def standalone_manifest() -> str:
    """The text of deploy/kubernetes/standalone-envoy.yaml."""
    body = "".join(f"    {line}\n" for line in render_gateway(STANDALONE).splitlines())
    return (
        STANDALONE_HEADER
        + "apiVersion: v1\nkind: ConfigMap\nmetadata:\n"
        + f"  name: {STANDALONE_CONFIGMAP}\n  labels:\n    app: prefix-router-epp\n"
        + "data:\n  envoy.yaml: |\n"
        + body
    )


# --- loading -------------------------------------------------------------------------------


def load_manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object in deploy/kubernetes/*.yaml, by (kind, name)."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert isinstance(document, dict), f"{path.name}: a document that is no object"
            key = (document["kind"], document["metadata"]["name"])
            assert key not in objects, f"{path.name}: {key} defined twice"
            objects[key] = document
    return objects


OBJECTS = load_manifests()
EPP = "prefix-router-epp"
CONTROL_PLANE_CONFIG = "/etc/prefix-router/control-plane.yaml"


def get(kind: str, name: str) -> dict[str, Any]:
    return OBJECTS[(kind, name)]


def pod_spec() -> dict[str, Any]:
    return get("Deployment", EPP)["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec()["containers"] if c["name"] == name]
    return found


def expanded_args(spec: dict[str, Any]) -> list[str]:
    """The container's args with $(VAR) replaced as the kubelet would; every VAR must be
    one of the container's env entries (else the kubelet leaves the text as it is)."""
    env = {e["name"] for e in spec.get("env", [])}

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in {spec['name']}'s env"
        return "default"

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg) for arg in spec["args"]]


def parsed(name: str) -> argparse.Namespace:
    """The container's command line as ``prefix-router`` (the image's ENTRYPOINT) parses it.
    argparse exits on an unknown flag or a bad value: that fails the test."""
    spec = container(name)
    assert "command" not in spec, "the image's ENTRYPOINT (prefix-router) must stay"
    return build_parser().parse_args(expanded_args(spec))


def mounted_file(spec: dict[str, Any], path: str) -> str:
    """The text a container sees at ``path``, through a ConfigMap volume of the pod."""
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    for mount in spec["volumeMounts"]:
        directory = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(directory):
            configmap = volumes[mount["name"]]["configMap"]["name"]
            return get("ConfigMap", configmap)["data"][path.removeprefix(directory)]
    raise AssertionError(f"{path} is not mounted in {spec['name']}")


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def container_port(spec: dict[str, Any], port: int | str) -> dict[str, Any]:
    """The container's port entry that ``port`` (a number or a port name) resolves to."""
    key = "name" if isinstance(port, str) else "containerPort"
    (found,) = [p for p in spec.get("ports", []) if p[key] == port]
    return found


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


# --- the InferencePool: inference.networking.k8s.io/v1 ------------------------------------

POOL_SPEC_FIELDS = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
PICKER_REF_FIELDS = {"group", "kind", "name", "port", "failureMode"}


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def inference_pool_problems(pool: dict[str, Any]) -> list[str]:
    """What the v1 API would refuse in ``pool`` (Gateway API Inference Extension v1.5.0,
    api/v1/inferencepool_types.go); [] when nothing."""
    problems = []
    if pool.get("apiVersion") != "inference.networking.k8s.io/v1":
        problems.append("apiVersion is not inference.networking.k8s.io/v1")
    if pool.get("kind") != "InferencePool":
        problems.append("kind is not InferencePool")
    spec = pool.get("spec") or {}
    problems += [f"spec.{k} is not a field" for k in sorted(set(spec) - POOL_SPEC_FIELDS)]
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not 1 <= len(labels) <= 64:
        problems.append("selector.matchLabels needs 1 to 64 entries")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        problems.append("selector.matchLabels keys and values are strings")
    ports = spec.get("targetPorts") or []
    if not 1 <= len(ports) <= 8:
        problems.append("targetPorts needs 1 to 8 items")
    numbers = [p.get("number") if isinstance(p, dict) else None for p in ports]
    if not all(_is_port(n) for n in numbers):
        problems.append("targetPorts[].number is a port from 1 to 65535")
    elif len(set(numbers)) != len(numbers):
        problems.append("targetPorts numbers are unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        problems.append("appProtocol is http or kubernetes.io/h2c")
    ref = spec.get("endpointPickerRef")
    if not isinstance(ref, dict):
        return [*problems, "endpointPickerRef is required"]
    problems += [
        f"endpointPickerRef.{k} is not a field" for k in sorted(set(ref) - PICKER_REF_FIELDS)
    ]
    if not isinstance(ref.get("name"), str) or not ref["name"]:
        problems.append("endpointPickerRef.name is required")
    if ref.get("kind", "Service") == "Service":
        if ref.get("group", "") != "":
            problems.append('endpointPickerRef.group of a Service is ""')
        if not _is_port((ref.get("port") or {}).get("number")):
            problems.append("endpointPickerRef.port.number is required for a Service")
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        problems.append("endpointPickerRef.failureMode is FailOpen or FailClose")
    return problems


POOL = get("InferencePool", "vllm-pool")


def test_the_inference_pool_obeys_the_v1_api():
    assert inference_pool_problems(POOL) == []
    ref = POOL["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service"
    # Set explicitly: the API's default is FailClose.
    assert ref["failureMode"] == "FailOpen"
    assert POOL["spec"]["selector"]["matchLabels"] == {"app": "vllm"}
    assert POOL["spec"]["targetPorts"] == [{"number": 8000}]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(pool: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = pool
        for key in parents:
            node = node.setdefault(key, {})
        if value is KeyError:
            del node[last]
        else:
            node[last] = value

    return change


BROKEN_POOLS = {
    "alpha API": _set("apiVersion", "inference.networking.x-k8s.io/v1alpha2"),
    "no labels": _set("spec.selector.matchLabels", {}),
    "65 labels": _set("spec.selector.matchLabels", {f"k{n}": "v" for n in range(65)}),
    "no target ports": _set("spec.targetPorts", []),
    "9 target ports": _set("spec.targetPorts", [{"number": 8000 + n} for n in range(9)]),
    "repeated port": _set("spec.targetPorts", [{"number": 8000}, {"number": 8000}]),
    "port 0": _set("spec.targetPorts", [{"number": 0}]),
    "port 65536": _set("spec.targetPorts", [{"number": 65536}]),
    "port as text": _set("spec.targetPorts", [{"number": "8000"}]),
    "grpc protocol": _set("spec.appProtocol", "grpc"),
    "no picker": _set("spec.endpointPickerRef", KeyError),
    "picker without port": _set("spec.endpointPickerRef.port", KeyError),
    "picker without name": _set("spec.endpointPickerRef.name", ""),
    "open": _set("spec.endpointPickerRef.failureMode", "Open"),
    "unknown field": _set("spec.extensionRef", {"name": "old"}),
}


@pytest.mark.parametrize("change", BROKEN_POOLS.values(), ids=list(BROKEN_POOLS))
def test_the_pool_checker_refuses_what_the_api_refuses(change):
    pool = copy.deepcopy(POOL)
    change(pool)
    assert inference_pool_problems(pool)


# --- the objects find each other -----------------------------------------------------------


def test_the_picker_ref_names_the_picker_service_and_its_ext_proc_port():
    ref = POOL["spec"]["endpointPickerRef"]
    service = get("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "http2"  # gRPC
    target = container_port(container("epp"), port["targetPort"])
    assert target["containerPort"] == parsed("epp").grpc_port


def test_the_picker_service_reaches_the_epp_container_ports():
    service = get("Service", EPP)["spec"]
    deployment = get("Deployment", EPP)["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"] == labels
    assert service["selector"].items() <= labels.items()
    epp = container("epp")
    for port in service["ports"]:
        entry = container_port(epp, port["targetPort"])
        assert entry["protocol"] == port["protocol"] == "TCP"
    served = {container_port(epp, p["targetPort"])["containerPort"] for p in service["ports"]}
    args = parsed("epp")
    assert served == {args.grpc_port, args.metrics_port}


def test_the_headless_service_selects_the_pool():
    headless = get("Service", "vllm-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert not headless.get("publishNotReadyAddresses", False)
    assert headless["selector"] == POOL["spec"]["selector"]["matchLabels"]
    pool_ports = {p["number"] for p in POOL["spec"]["targetPorts"]}
    assert {p["targetPort"] for p in headless["ports"]} == pool_ports
    # The control plane resolves it on the pool's port: what it publishes is the pool.
    names = yaml.safe_load(mounted_file(container("control-plane"), CONTROL_PLANE_CONFIG))["dns"]
    assert names == [f"vllm-headless.default.svc.cluster.local:{port}" for port in pool_ports]


# --- the containers' command lines and configs ---------------------------------------------


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_the_image_entrypoint_is_prefix_router():
    assert 'ENTRYPOINT ["prefix-router"]' in DOCKERFILE.read_text()
    images = {c["image"] for c in pod_spec()["containers"]}
    assert images == {"prefix-router:latest"}


def test_the_epp_args_parse_with_the_chart_flags():
    args = parsed("epp")
    assert args.command == "epp"
    # The reference chart's flags, accepted and ignored.
    assert args.ignored_pool_name == "vllm-pool"
    assert args.ignored_pool_namespace == "default"
    # The ports the container declares are the ones the command listens on.
    epp = container("epp")
    assert container_port(epp, "grpc")["containerPort"] == args.grpc_port == 9002
    assert container_port(epp, "grpc-health")["containerPort"] == args.grpc_health_port == 9003
    assert container_port(epp, "metrics")["containerPort"] == args.metrics_port == 9090
    # The defaults are the reference's: the flags only say them out loud.
    defaults = build_parser().parse_args(["epp"])
    assert (defaults.grpc_port, defaults.grpc_health_port, defaults.metrics_port) == (
        args.grpc_port,
        args.grpc_health_port,
        args.metrics_port,
    )
    assert args.bind_address == "0.0.0.0"  # the kubelet and the gateway reach the pod IP
    assert args.secure_serving is True  # the gateways call the picker over TLS


def test_the_reference_charts_args_parse():
    # The args the reference chart gives its picker, with the switches it can add.
    chart = [
        "epp",
        "--pool-name",
        "vllm-pool",
        "--pool-namespace",
        "default",
        "--pool-group",
        "inference.networking.k8s.io",
        "--zap-encoder",
        "json",
        "--config-file",
        "/config/default-plugins.yaml",
        "--v",
        "1",
        "--ha-enable-leader-election",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
    ]
    args = build_parser().parse_args(chart)
    assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)


def test_the_probes_ask_the_health_port_for_a_service_it_serves():
    epp = container("epp")
    health_port = parsed("epp").grpc_health_port
    for probe, served in (
        ("livenessProbe", (LIVENESS_SERVICE, *READY_SERVICES)),
        ("readinessProbe", READY_SERVICES),
    ):
        check = epp[probe]["grpc"]
        assert check["port"] == health_port
        assert check["service"] in served
    # As the reference chart has them.
    assert epp["livenessProbe"]["initialDelaySeconds"] == 5
    assert epp["livenessProbe"]["periodSeconds"] == 10
    assert epp["readinessProbe"]["periodSeconds"] == 2


def test_the_epp_config_loads(tmp_path):
    args = parsed("epp")
    text = mounted_file(container("epp"), str(args.config))
    # The flags' overrides as the command applies them; no certificate exists here, so TLS
    # is left out (the command makes one at start).
    config = load_config(
        _write(tmp_path, "router.yaml", text), env={}, overrides=overrides_of(args, None)
    )
    assert config.epp is True
    assert port_of(config.listen) == args.grpc_port
    assert config.health_listen is not None and port_of(config.health_listen) == 9003
    assert port_of(config.metrics_listen) == args.metrics_port
    assert config.control_plane == args.control_plane
    assert config.epp_conformance_hooks is False  # never outside a conformance run
    assert config.epp_endpoint_list is False  # kgateway honours one endpoint


def test_the_control_plane_config_loads_and_the_picker_reaches_it(tmp_path):
    args = parsed("control-plane")
    assert args.command == "control-plane"
    assert str(args.config) == CONTROL_PLANE_CONFIG
    text = mounted_file(container("control-plane"), CONTROL_PLANE_CONFIG)
    config = load_control_plane_config(_write(tmp_path, "control-plane.yaml", text))
    # The two containers share the pod's network: the picker dials the control plane on
    # loopback.
    assert parsed("epp").control_plane == config.listen == "127.0.0.1:18000"
    metrics = container_port(container("control-plane"), "cp-metrics")
    assert metrics["containerPort"] == port_of(config.metrics_listen)
    assert config.metrics_listen.startswith("0.0.0.0:")  # Prometheus scrapes the pod IP
    liveness = container("control-plane")["livenessProbe"]["httpGet"]
    assert container_port(container("control-plane"), liveness["port"]) == metrics


def test_no_two_processes_in_the_pod_listen_on_one_port(tmp_path):
    epp = parsed("epp")
    control = load_control_plane_config(
        _write(tmp_path, "cp.yaml", mounted_file(container("control-plane"), CONTROL_PLANE_CONFIG))
    )
    envoy = build_gateway(STANDALONE)
    listener = envoy["static_resources"]["listeners"][0]["address"]["socket_address"]
    ports = [
        epp.grpc_port,
        epp.grpc_health_port,
        epp.metrics_port,
        port_of(control.listen),
        port_of(control.metrics_listen),
        listener["port_value"],
        envoy["admin"]["address"]["socket_address"]["port_value"],
    ]
    assert len(set(ports)) == len(ports), ports


# --- namespaces and loopback -----------------------------------------------------------------


def test_the_namespace_is_named_only_where_kubernetes_needs_it():
    for (kind, name), document in OBJECTS.items():
        assert document["metadata"].get("namespace", "default") == "default", (kind, name)
        body = {k: v for k, v in document.items() if k not in ("metadata", "subjects")}
        assert "namespace" not in [key for key, _ in walk(body)], f"{kind} {name}"
    (subject,) = get("RoleBinding", EPP)["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": EPP, "namespace": "default"}
    texts = [yaml.safe_dump(d) for d in OBJECTS.values()]
    # The one other place: the headless Service's DNS name in control-plane.yaml.
    assert sum(t.count(".default.svc") for t in texts) == 1


def test_loopback_appears_only_inside_the_pod():
    inside = {("Deployment", EPP), ("ConfigMap", EPP), ("ConfigMap", STANDALONE_CONFIGMAP)}
    for key, document in OBJECTS.items():
        if key not in inside:
            text = yaml.safe_dump(document)
            assert "127.0.0.1" not in text and "localhost" not in text, key
    # Inside, each loopback address names a process of the same pod.
    loopback = [a for a in expanded_args(container("epp")) if a.startswith("127.")]
    assert loopback == [parsed("epp").control_plane]
    picker = build_gateway(STANDALONE)["static_resources"]["clusters"][1]
    endpoint = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["port_value"] == parsed("epp").grpc_port


def test_the_role_grants_what_the_reference_picker_needs():
    rules = {
        (group, resource): set(rule["verbs"])
        for rule in get("Role", EPP)["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    read = {"get", "watch", "list"}
    assert rules == {("", "pods"): read, ("inference.networking.k8s.io", "inferencepools"): read}
    binding = get("RoleBinding", EPP)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": EPP,
    }
    assert pod_spec()["serviceAccountName"] == get("ServiceAccount", EPP)["metadata"]["name"]


def test_the_pod_matches_the_reference_chart():
    deployment = get("Deployment", EPP)["spec"]
    assert deployment["strategy"]["type"] == "Recreate"
    assert pod_spec()["terminationGracePeriodSeconds"] == 130
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container("epp")["env"]}
    assert env == {"NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}


# --- the reference standalone Envoy ------------------------------------------------------------


def standalone_bootstrap() -> str:
    return get("ConfigMap", STANDALONE_CONFIGMAP)["data"]["envoy.yaml"]


def test_the_standalone_envoy_is_the_generators_output():
    assert standalone_bootstrap() == render_gateway(STANDALONE)
    assert STANDALONE_FILE.read_text() == standalone_manifest(), (
        "stale: PYTHONPATH=. python tests/deploy/test_kubernetes_manifests.py"
    )


@pytest.mark.envoy
def test_the_standalone_envoy_loads_into_envoy(tmp_path):
    path = _write(tmp_path, "envoy.yaml", standalone_bootstrap())
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


# --- the YAML in docs/kubernetes.md ------------------------------------------------------------

_YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def guide_documents() -> list[dict[str, Any]]:
    documents = []
    for block in _YAML_BLOCK.findall(GUIDE.read_text()):
        documents += [d for d in yaml.safe_load_all(block) if d is not None]
    return documents


def guide_object(kind: str) -> dict[str, Any]:
    (found,) = [d for d in guide_documents() if d.get("kind") == kind]
    return found


def test_the_guides_routes_send_to_the_pool():
    route = guide_object("HTTPRoute")
    gateway = guide_object("Gateway")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-pool"}
    ]


def test_the_guides_destination_rule_says_what_the_istio_like_envoy_does():
    rule = guide_object("DestinationRule")
    assert rule["spec"]["host"] == EPP
    policy = rule["spec"]["trafficPolicy"]
    assert policy["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    clusters = build_gateway(GatewayParams(gateway="istio"))["static_resources"]["clusters"]
    outlier = clusters[1]["outlier_detection"]
    assert policy["outlierDetection"] == {
        "splitExternalLocalOriginErrors": outlier["split_external_local_origin_errors"],
        "consecutiveLocalOriginFailures": outlier["consecutive_local_origin_failure"],
        "interval": outlier["interval"],
        "baseEjectionTime": outlier["base_ejection_time"],
        "maxEjectionPercent": outlier["max_ejection_percent"],
    }
    # Istio routes to no ejected picker unless minHealthPercent is set (no panic routing),
    # as the Istio-like Envoy's healthy_panic_threshold 0.
    assert "minHealthPercent" not in policy["outlierDetection"]
    assert clusters[1]["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}


def test_the_guides_envoy_filter_strips_the_header_before_ext_proc():
    envoy_filter = guide_object("EnvoyFilter")
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER"
    assert patch["patch"]["operation"] == "INSERT_FIRST"  # ahead of Istio's ext_proc
    manager = build_gateway(GatewayParams(gateway="istio"))["static_resources"]["listeners"][0]
    filters = manager["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    assert patch["patch"]["value"] == filters[0]
    assert filters[0]["typed_config"]["mutations"]["request_mutations"] == [
        {"remove": LB_METADATA_KEY}
    ]


def test_the_guides_standalone_patch_runs_the_generated_envoy():
    (patch,) = [d for d in guide_documents() if "kind" not in d]
    spec = patch["spec"]["template"]["spec"]
    (envoy,) = spec["containers"]
    (volume,) = spec["volumes"]
    assert volume["configMap"]["name"] == STANDALONE_CONFIGMAP
    if pod_spec()["securityContext"].get("runAsNonRoot"):
        assert envoy["securityContext"]["runAsUser"] > 0  # the Envoy image runs as root
    (mount,) = envoy["volumeMounts"]
    assert mount["name"] == volume["name"]
    assert f"{mount['mountPath'].rstrip('/')}/envoy.yaml" in envoy["args"]
    listener = build_gateway(STANDALONE)["static_resources"]["listeners"][0]
    port = listener["address"]["socket_address"]["port_value"]
    assert container_port(envoy, "http")["containerPort"] == port
    service = [d for d in guide_documents() if d.get("kind") == "Service"]
    (gateway_service,) = service
    assert gateway_service["spec"]["selector"] == {"app": EPP}
    assert [p["targetPort"] for p in gateway_service["spec"]["ports"]] == [port]


if __name__ == "__main__":
    STANDALONE_FILE.write_text(standalone_manifest())
    print(f"wrote {STANDALONE_FILE.relative_to(ROOT)}", file=sys.stderr)
