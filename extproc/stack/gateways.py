"""Envoy bootstraps configured as the Inference Extension's gateways configure Envoy.

Each reproduces, in a static bootstrap, what that gateway generates for an InferencePool
(read from its source, docs/kubernetes.md cites them), so the endpoint picker
(``prefix-router epp``) is tested through the real Envoy binary the way each gateway
calls it:

- ``istio``: ext_proc with FULL_DUPLEX_STREAMED bodies both ways and trailers, a 1000 s
  message timeout, ``envoy.lb`` received and forwarded; the pool cluster uses the
  override_host policy on that metadata, which reports the served endpoint back
  (``selected_host_key``), with round robin as the fallback. No subset hint.
- ``kgateway``: the same body modes, a 5 s message timeout, the subset hint forwarded (every
  pool endpoint) and ``envoy.lb`` received; a ``header_to_metadata`` filter copies the
  picker's header into ``envoy.lb``, and a subset load balancer keyed on it picks the
  endpoint, falling back to any endpoint. kgateway writes the hint into the route's
  metadata, which ext_proc does not forward; here a ``set_metadata`` filter puts it in the
  stream's, where a picker can read it.
- ``standalone``: the reference chart's own Envoy: an ORIGINAL_DST cluster reading the
  ``x-gateway-destination-endpoint`` header, TLS to the picker, and gRPC health checks of
  it. It cannot fail open: without the header there is nowhere to send the request.

All three strip a client's ``x-gateway-destination-endpoint`` before ext_proc (the
gateways' own configs do not), so a client never chooses the upstream even when the
picker is down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import yaml

from extproc import ports
from extproc.adapter import epp
from extproc.adapter.messages import LB_METADATA_KEY, LB_METADATA_NAMESPACE
from extproc.adapter.service import SERVICE_NAME

Gateway = Literal["istio", "kgateway", "standalone"]
GATEWAYS: tuple[Gateway, ...] = ("istio", "kgateway", "standalone")
POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
_TYPE = "type.googleapis.com/envoy."
# What each gateway sets: Istio 1000 s (and the reference chart), kgateway and the AI
# Gateway 5 s.
MESSAGE_TIMEOUT = {"istio": "1000s", "kgateway": "5s", "standalone": "1000s"}


@dataclass(frozen=True)
class GatewayParams:
    gateway: Gateway = "istio"
    listen: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_LISTEN)
    admin: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_ADMIN)
    picker: tuple[str, int] = (ports.LOOPBACK, ports.EPP_GRPC)
    # The picker serves TLS (its default, with a self-signed certificate; not verified,
    # as every gateway does).
    picker_tls: bool = True
    # The InferencePool's failureMode: FailOpen lets requests through without the picker.
    fail_open: bool = True
    pool: tuple[tuple[str, int], ...] = ports.DEFAULT_FLEET
    # kgateway's subset hint: None sends every pool endpoint.
    subset_hint: tuple[str, ...] | None = None
    # Name the endpoint that served each response in x-upstream-host (tests, demos).
    upstream_host_header: bool = True


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _joined(endpoint: tuple[str, int]) -> str:
    return f"{endpoint[0]}:{endpoint[1]}"


def _ext_proc(params: GatewayParams) -> dict[str, Any]:
    gateway = params.gateway
    namespaces: dict[str, Any] = {}
    if gateway == "istio":
        namespaces = {
            "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
            "forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
        }
    elif gateway == "kgateway":
        namespaces = {
            "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
            "forwarding_namespaces": {"untyped": [epp.SUBSET_NAMESPACE]},
        }
    config: dict[str, Any] = {
        "@type": _TYPE + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": "10s"},
        "failure_mode_allow": params.fail_open and gateway != "standalone",
        "message_timeout": MESSAGE_TIMEOUT[gateway],
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
    }
    if namespaces:
        config["metadata_options"] = namespaces
    return {"name": "envoy.filters.http.ext_proc", "typed_config": config}


def _strip_client_destination() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _TYPE + "extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": LB_METADATA_KEY}]},
        },
    }


def _subset_hint(params: GatewayParams) -> dict[str, Any]:
    hint = params.subset_hint
    if hint is None:
        hint = tuple(_joined(e) for e in params.pool)
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": _TYPE + "extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": epp.SUBSET_NAMESPACE,
                    "value": {epp.SUBSET_KEY: list(hint)},
                }
            ],
        },
    }


def _header_to_metadata() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _TYPE + "extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {
                    "header": LB_METADATA_KEY,
                    "on_header_present": {
                        "metadata_namespace": LB_METADATA_NAMESPACE,
                        "key": LB_METADATA_KEY,
                        "type": "STRING",
                    },
                    "remove": False,
                }
            ],
        },
    }


def _http_filters(params: GatewayParams) -> list[dict[str, Any]]:
    filters = [_strip_client_destination()]
    if params.gateway == "kgateway":
        filters.append(_subset_hint(params))
    filters.append(_ext_proc(params))
    if params.gateway == "kgateway":
        filters.append(_header_to_metadata())
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "extensions.filters.http.router.v3.Router"},
        }
    )
    return filters


def _pool_endpoints(params: GatewayParams, with_metadata: bool) -> dict[str, Any]:
    endpoints = []
    for endpoint in params.pool:
        entry: dict[str, Any] = {"endpoint": {"address": _address(*endpoint)}}
        if with_metadata:
            entry["metadata"] = {
                "filter_metadata": {LB_METADATA_NAMESPACE: {LB_METADATA_KEY: _joined(endpoint)}}
            }
        endpoints.append(entry)
    return {"cluster_name": POOL_CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]}


def _policy(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    return {
        "typed_extension_config": {
            "name": name,
            "typed_config": {"@type": _TYPE + type_name, **config},
        }
    }


# Each request holds a stream to the picker for as long as its response streams, so the
# picker's cluster needs breakers as large as the pool's: Envoy's default of 1,024 requests
# per cluster would fail every stream past it open, unpicked. Istio's defaults are larger
# still; the reference chart sets 40,000 on its pool.
_BREAKERS = {
    "thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}]
}


def _pool_cluster(params: GatewayParams) -> dict[str, Any]:
    breakers = _BREAKERS
    if params.gateway == "standalone":
        return {
            "name": POOL_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1000s",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": LB_METADATA_KEY,
            },
            "circuit_breakers": breakers,
        }
    cluster: dict[str, Any] = {
        "name": POOL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "5s",
        "circuit_breakers": breakers,
    }
    if params.gateway == "kgateway":
        cluster["lb_policy"] = "ROUND_ROBIN"
        cluster["lb_subset_config"] = {
            "fallback_policy": "ANY_ENDPOINT",
            "subset_selectors": [{"keys": [LB_METADATA_KEY]}],
        }
        cluster["load_assignment"] = _pool_endpoints(params, with_metadata=True)
        return cluster
    metadata_path = {"key": LB_METADATA_NAMESPACE, "path": [{"key": LB_METADATA_KEY}]}
    cluster["load_assignment"] = _pool_endpoints(params, with_metadata=False)
    cluster["load_balancing_policy"] = {
        "policies": [
            _policy(
                "envoy.load_balancing_policies.override_host",
                "extensions.load_balancing_policies.override_host.v3.OverrideHost",
                override_host_sources=[{"metadata": metadata_path}],
                # Envoy writes the endpoint it used here: the picker reads it back.
                selected_host_key={
                    "key": LB_METADATA_NAMESPACE,
                    "path": [{"key": epp.SERVED_KEY}],
                },
                fallback_policy={
                    "policies": [
                        _policy(
                            "envoy.load_balancing_policies.round_robin",
                            "extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                        )
                    ]
                },
            )
        ]
    }
    return cluster


def _picker_cluster(params: GatewayParams) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": _BREAKERS,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(*params.picker)}}]}],
        },
    }
    if params.fail_open:
        # A picker that is gone must be known before a request's body flows: in
        # FULL_DUPLEX_STREAMED, Envoy answers 500 instead of failing open when the stream
        # fails after body chunks went to it (docs/kubernetes.md; test_epp_gateways.py).
        # A refused connection ejects the picker at once, and with no panic routing (Istio's
        # default) a stream to no healthy picker fails at its start, where failing open
        # is clean. Istio's DestinationRule and kgateway's BackendConfigPolicy can set both.
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 100,
        }
    if params.picker_tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _TYPE + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                # Not verified, as every gateway calls the picker (its certificate is
                # self-signed); the ALPN is h2, which gRPC over TLS requires.
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    if params.gateway == "standalone":
        cluster["health_checks"] = [
            {
                "timeout": "2s",
                "interval": "1s",
                "unhealthy_threshold": 3,
                "healthy_threshold": 1,
                "reuse_connection": True,
                "grpc_health_check": {"service_name": SERVICE_NAME},
                **({"tls_options": {"alpn_protocols": ["h2"]}} if params.picker_tls else {}),
            }
        ]
    return cluster


def _route_config(params: GatewayParams) -> dict[str, Any]:
    virtual_host: dict[str, Any] = {
        "name": "inference",
        "domains": ["*"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": POOL_CLUSTER, "timeout": "0s"}}],
    }
    if params.upstream_host_header:
        virtual_host["response_headers_to_add"] = [
            {
                "header": {"key": "x-upstream-host", "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    return {"name": "inference", "virtual_hosts": [virtual_host]}


def build_gateway(params: GatewayParams) -> dict[str, Any]:
    if params.gateway not in GATEWAYS:
        raise ValueError(f"gateway {params.gateway!r} is not one of {', '.join(GATEWAYS)}")
    manager = {
        "@type": _TYPE
        + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference_gateway",
        "route_config": _route_config(params),
        "http_filters": _http_filters(params),
    }
    return {
        "node": {"id": f"{params.gateway}-like", "cluster": "inference-gateway"},
        "admin": {"address": _address(*params.admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference_gateway",
                    "address": _address(*params.listen),
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
            ],
            "clusters": [_pool_cluster(params), _picker_cluster(params)],
        },
    }


def render_gateway(params: GatewayParams) -> str:
    header = f"# An Envoy configured as {params.gateway} configures it for an InferencePool.\n"
    return header + yaml.safe_dump(build_gateway(params), sort_keys=False)
