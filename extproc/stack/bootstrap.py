"""Envoy bootstraps for the two ways of handing Envoy the router's choice.

- ``override-host`` (default): the backend cluster uses the override_host load-balancing
  policy, fed by ``envoy.lb`` dynamic metadata. A target outside the cluster is never used,
  and if the router is down, requests fail open to a least-request fallback.
- ``original-dst``: the classic form. The router sets ``x-target-host`` and an ORIGINAL_DST
  cluster connects to it. It fails closed, and a header_mutation filter placed before
  ext_proc strips any client-supplied routing header, so a client can never choose the
  upstream.

The files in ``envoy/`` are these functions' output with the defaults below; a test keeps
them in step, and another loads each one into the real Envoy binary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import yaml

from extproc import keepalive, ports
from extproc.adapter.messages import LB_METADATA_KEY, LB_METADATA_NAMESPACE, TARGET_HEADER
from extproc.stack.upstream_tls import UpstreamTls, transport_socket

Mode = Literal["override-host", "original-dst"]
MODES: tuple[Mode, ...] = ("override-host", "original-dst")
# How the request body reaches the router: buffered-partial, its first bytes in one message
# after the headers are answered (two round trips); streamed, its chunks sent without
# waiting for the headers response, which then carries the decision (one round trip).
BodyMode = Literal["buffered-partial", "streamed"]
BODY_MODES: tuple[BodyMode, ...] = ("buffered-partial", "streamed")
# A router process Envoy connects to: (ip, port), or the path of its Unix socket.
RouterEndpoint = tuple[str, int] | str

# Headers a client might use to pick an upstream; all are removed before ext_proc runs.
CLIENT_ROUTING_HEADERS = (TARGET_HEADER, "x-envoy-original-dst-host", LB_METADATA_KEY)
# With upstream_host_header, each response also names the router's primary for it (empty
# where Envoy went without the router's answer: failed open): a response served by another
# host was failed over, retried or failed open, not placed there.
ROUTER_TARGET_HEADER = "x-router-target"
BACKEND_CLUSTER = "vllm"
ROUTER_CLUSTER = "prefix_router"
# The routers again, one cluster each, for the access log that reports completions.
COMPLETIONS_CLUSTER = "prefix_router_completions"
XDS_CLUSTER = "xds"

_TYPE = "type.googleapis.com/envoy."


@dataclass(frozen=True)
class BootstrapParams:
    mode: Mode = "override-host"
    listen: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_LISTEN)
    admin: tuple[str, int] = (ports.LOOPBACK, ports.ENVOY_ADMIN)
    # One entry per router process (Envoy keeps one HTTP/2 connection per endpoint).
    routers: tuple[RouterEndpoint, ...] = ((ports.LOOPBACK, ports.ROUTER_GRPC),)
    # The control plane's xDS address: the backend cluster then comes from EDS over ADS.
    # None gives a STATIC cluster of ``backends`` instead.
    control_plane: tuple[str, int] | None = (ports.LOOPBACK, ports.CONTROL_PLANE_XDS)
    backends: tuple[tuple[str, int], ...] = ports.DEFAULT_FLEET
    # BUFFERED_PARTIAL sends the body to the router once this many bytes have arrived, or
    # at end of stream. Envoy 1.40 intermittently loses the end of a request whose body
    # overflows this limit (the upstream then waits for the rest forever), in either body
    # mode, so it sits above the router's max_body_bytes (32 MiB): every body up to that
    # arrives whole, and the router refuses a larger one with 413. Not far above: what
    # Envoy buffers it sends the router in one message, within message_timeout (0.5 s),
    # and an 80 MiB message took 0.4 to 0.5 s on 2 cores (some timed out and failed open).
    buffer_limit_bytes: int = 40 * 1024 * 1024
    body_mode: BodyMode = "buffered-partial"
    # A gRPC access log to each router that reports every request's completion. Routers
    # whose ext_proc streams end at the decision learn there that a request is done:
    # always with streamed bodies, and with buffered-partial ones for routers set to
    # stream_end: decision (without it their load is the load feed's estimate).
    completion_log: bool = False
    message_timeout_ms: int = 500
    # x-upstream-host on every response names the backend that served it, and
    # x-router-target the router's primary: for demos and tests (`prefix-router up` and
    # the test stacks turn it on), never in the shipped bootstraps, where it would show
    # clients the fleet's addresses.
    upstream_host_header: bool = False
    retries: int = 2
    # False gives plain Envoy (least-request over the cluster): the no-router baseline.
    ext_proc: bool = True
    # With ext_proc off: Envoy's own consistent hashing (ring_hash) on this request header,
    # the baseline that needs no ext_proc at all.
    ring_hash_header: str | None = None
    # Envoy's HTTP connection manager timeouts; None keeps Envoy's defaults (stream idle
    # 5 min, no whole-request limit). A request that stops sending is then ended by Envoy.
    stream_idle_timeout_s: float | None = None
    request_timeout_s: float | None = None
    # The request headers Envoy forwards to the router (ext_proc forward_rules); None
    # forwards them all.
    forward_headers: tuple[str, ...] | None = None
    # Envoy's circuit breakers on the backend and router clusters: the most requests (and
    # connections, and requests waiting for one) each holds at once. An LLM gateway holds
    # a request, and in buffered-partial mode its ext_proc stream, for the whole
    # generation; Envoy's default of 1024 made requests past it fail open in silence.
    max_concurrent: int = 16384
    # The most ext_proc streams Envoy holds open to the routers at once (the router
    # cluster's max_requests); None: max_concurrent. Past it a request's stream fails at
    # once and the request fails open, counted in
    # cluster.prefix_router.upstream_rq_active_overflow, instead of waiting in the routers'
    # queues for message_timeout. With stream_end: response every request in flight holds
    # a stream to its end, so a cap fails open the requests past it: use it with
    # stream_end: decision, where only the undecided hold one.
    router_max_streams: int | None = None
    # Envoy closes a backend connection idle this long. vLLM's API server closes one idle
    # for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); were Envoy's limit the longer (its default is
    # an hour), a request sent as vLLM closes the connection is reset, and Envoy's retry
    # takes it to the next host, away from its cache. None keeps Envoy's default.
    backend_idle_timeout_s: float | None = 4.0
    # The router's trusted_salt_header: stripped from the client's request first, with the
    # routing headers, so only a filter placed after the strip filter can set it.
    trusted_salt_header: str | None = None
    # TLS (mTLS with a client certificate) to the routers, on the ext_proc and
    # completion-log clusters, and to the control plane, on the xds cluster; None is
    # plaintext. The routers' and the control plane's tls_* settings must match.
    router_tls: UpstreamTls | None = None
    xds_tls: UpstreamTls | None = None


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoint_address(endpoint: RouterEndpoint) -> dict[str, Any]:
    if isinstance(endpoint, str):
        return {"pipe": {"path": endpoint}}
    return _address(*endpoint)


def _endpoints(cluster: str, hosts: tuple[RouterEndpoint, ...]) -> dict[str, Any]:
    return {
        "cluster_name": cluster,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _endpoint_address(h)}} for h in hosts]}
        ],
    }


def _http2_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {
                "http2_protocol_options": {"connection_keepalive": keepalive.envoy_keepalive()}
            },
        }
    }


def backend_idle_timeout(seconds: float) -> dict[str, Any]:
    """A backend cluster's HTTP options: its connections close after ``seconds`` idle."""
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": f"{seconds:g}s"},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def circuit_breakers(max_concurrent: int, max_requests: int | None = None) -> dict[str, Any]:
    """One cluster's breakers: ``max_concurrent`` requests (or ``max_requests``), pending
    requests and connections; retries in flight at a sixteenth of that (Envoy's default
    is 3)."""
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": max_concurrent,
                "max_pending_requests": max_concurrent,
                "max_requests": max_concurrent if max_requests is None else max_requests,
                "max_retries": max(3, max_concurrent // 16),
            }
        ]
    }


def _with_tls(
    cluster: dict[str, Any], tls: UpstreamTls | None, endpoints: tuple[RouterEndpoint, ...]
) -> dict[str, Any]:
    if tls is None:
        return cluster
    ips = tuple(e[0] for e in endpoints if not isinstance(e, str))
    return {**cluster, "transport_socket": transport_socket(tls, ips)}


def _router_cluster(params: BootstrapParams) -> dict[str, Any]:
    cluster = {
        "name": ROUTER_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": circuit_breakers(params.max_concurrent, params.router_max_streams),
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": _endpoints(ROUTER_CLUSTER, params.routers),
        # gRPC health checks take a draining router out before its streams are cut.
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                # Envoy does not count ext_proc's gRPC streams as cluster traffic, so
                # without this it checks only every 60 s (no_traffic_interval's default)
                # and keeps sending streams to a router that has stopped.
                "no_traffic_interval": "1s",
                # A draining router's NOT_SERVING takes it out at once whatever this says;
                # it counts only checks that time out or cannot connect. At 1, one answer
                # late on a busy machine took the only router out for a second, and every
                # request in that second failed open.
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }
    # The health checks go over the cluster's transport socket, TLS included.
    return _with_tls(cluster, params.router_tls, params.routers)


def _xds_cluster(control_plane: tuple[str, int], tls: UpstreamTls | None) -> dict[str, Any]:
    cluster = {
        "name": XDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": _endpoints(XDS_CLUSTER, (control_plane,)),
    }
    return _with_tls(cluster, tls, (control_plane,))


def _backend_discovery(params: BootstrapParams) -> dict[str, Any]:
    if params.control_plane is None:
        return {"type": "STATIC", "load_assignment": _endpoints(BACKEND_CLUSTER, params.backends)}
    return {
        "type": "EDS",
        # Envoy keeps the last endpoints through a control-plane outage.
        "eds_cluster_config": {
            "eds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "5s"}
        },
    }


def _ring_hash_cluster(params: BootstrapParams) -> dict[str, Any]:
    return {
        "name": BACKEND_CLUSTER,
        **_backend_discovery(params),
        "connect_timeout": "1s",
        "lb_policy": "RING_HASH",
    }


def _override_host_cluster(params: BootstrapParams) -> dict[str, Any]:
    if params.ring_hash_header is not None:
        return _ring_hash_cluster(params)
    return {
        "name": BACKEND_CLUSTER,
        **_backend_discovery(params),
        "connect_timeout": "1s",
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": _TYPE
                            + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {
                                    "metadata": {
                                        "key": LB_METADATA_NAMESPACE,
                                        "path": [{"key": LB_METADATA_KEY}],
                                    }
                                }
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.least_request",
                                            "typed_config": {
                                                "@type": _TYPE
                                                + "extensions.load_balancing_policies."
                                                "least_request.v3.LeastRequest"
                                            },
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        },
    }


def _original_dst_cluster() -> dict[str, Any]:
    return {
        "name": BACKEND_CLUSTER,
        "type": "ORIGINAL_DST",
        "connect_timeout": "1s",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": TARGET_HEADER},
    }


def _ext_proc_filter(params: BootstrapParams) -> dict[str, Any]:
    fail_open = params.mode == "override-host"
    streamed = params.body_mode == "streamed"
    config: dict[str, Any] = {
        "@type": _TYPE + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": ROUTER_CLUSTER}, "timeout": "1s"},
        # override-host falls back to least-request without the router; original-dst has
        # no safe fallback, so it fails closed with a 503.
        "failure_mode_allow": fail_open,
        "message_timeout": f"{params.message_timeout_ms / 1000:g}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SKIP",
            "request_body_mode": "STREAMED" if streamed else "BUFFERED_PARTIAL",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
        # Without this, Envoy silently drops the router's envoy.lb metadata.
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
    }
    if params.forward_headers is not None:
        config["forward_rules"] = {
            "allowed_headers": {"patterns": [{"exact": h} for h in params.forward_headers]}
        }
    if streamed:
        # The router holds its headers response until it has read the body.
        config["send_body_without_waiting_for_header_response"] = True
        # The router extends message_timeout while the body is still arriving.
        config["max_message_timeout"] = "30s"
    if not fail_open:
        config["status_on_error"] = {"code": "ServiceUnavailable"}
    return {"name": "envoy.filters.http.ext_proc", "typed_config": config}


def logs_completions(params: BootstrapParams) -> bool:
    return params.ext_proc and (params.body_mode == "streamed" or params.completion_log)


def _completion_log_cluster(
    index: int, router: RouterEndpoint, params: BootstrapParams
) -> dict[str, Any]:
    name = f"{COMPLETIONS_CLUSTER}_{index}"
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "circuit_breakers": circuit_breakers(params.max_concurrent),
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": _endpoints(name, (router,)),
    }
    return _with_tls(cluster, params.router_tls, (router,))


def _completion_logs(params: BootstrapParams) -> list[dict[str, Any]]:
    """One gRPC access log per router process: each must see its own requests complete
    (their streams end at the decision), and a cluster of several would send each entry
    to one of them only. A router ignores the others' tickets."""
    return [
        {
            "name": "envoy.access_loggers.http_grpc",
            "typed_config": {
                "@type": _TYPE + "extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": "prefix_router_completions",
                    "grpc_service": {"envoy_grpc": {"cluster_name": f"{COMPLETIONS_CLUSTER}_{i}"}},
                    "transport_api_version": "V3",
                    # A completion logged late counts its request in flight against the
                    # next ones: each entry goes at once (0 turns batching off), and the
                    # flush interval only bounds a batch were that ever changed.
                    "buffer_flush_interval": "0.01s",
                    "buffer_size_bytes": 0,
                },
            },
        }
        for i in range(len(params.routers))
    ]


def _strip_client_routing_headers(params: BootstrapParams) -> dict[str, Any]:
    # Must run before ext_proc: route-level header removal happens too late.
    headers = list(CLIENT_ROUTING_HEADERS)
    if params.trusted_salt_header is not None:
        headers.append(params.trusted_salt_header)
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _TYPE + "extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in headers]},
        },
    }


def _route_config(params: BootstrapParams) -> dict[str, Any]:
    virtual_host: dict[str, Any] = {
        "name": "llm",
        "domains": ["*"],
        "routes": [
            {
                "match": {"prefix": "/"},
                "route": {
                    "cluster": BACKEND_CLUSTER,
                    # LLM responses stream for minutes; the client decides when to give up.
                    "timeout": "0s",
                    **(
                        {
                            "retry_policy": {
                                "retry_on": "connect-failure,reset,refused-stream",
                                "num_retries": params.retries,
                            }
                        }
                        if params.retries
                        else {}
                    ),
                },
            }
        ],
    }
    if params.ring_hash_header is not None:
        route = virtual_host["routes"][0]["route"]
        route["hash_policy"] = [{"header": {"header_name": params.ring_hash_header}}]
    if params.upstream_host_header:
        virtual_host["response_headers_to_add"] = [
            {
                "header": {"key": "x-upstream-host", "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            },
            {
                "header": {"key": ROUTER_TARGET_HEADER, "value": f"%REQ({TARGET_HEADER})%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            },
        ]
    return {"name": "llm", "virtual_hosts": [virtual_host]}


def build_bootstrap(params: BootstrapParams) -> dict[str, Any]:
    if params.mode not in MODES:
        raise ValueError(f"mode {params.mode!r} is not one of {', '.join(MODES)}")
    if params.router_tls is not None and any(isinstance(r, str) for r in params.routers):
        # The router serves TLS on ip:port only; a Unix socket is guarded by its permissions.
        raise ValueError("router_tls needs ip:port routers, not Unix sockets")
    backend = (
        _override_host_cluster(params)
        if params.mode == "override-host"
        else _original_dst_cluster()
    )
    # An HTTP/1 upstream takes a connection per request in flight: all three at one size.
    backend["circuit_breakers"] = circuit_breakers(params.max_concurrent)
    if params.backend_idle_timeout_s is not None:
        backend["typed_extension_protocol_options"] = backend_idle_timeout(
            params.backend_idle_timeout_s
        )
    http_connection_manager = {
        "@type": _TYPE
        + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        **(
            {"stream_idle_timeout": f"{params.stream_idle_timeout_s:g}s"}
            if params.stream_idle_timeout_s is not None
            else {}
        ),
        **(
            {"request_timeout": f"{params.request_timeout_s:g}s"}
            if params.request_timeout_s is not None
            else {}
        ),
        "route_config": _route_config(params),
        **({"access_log": _completion_logs(params)} if logs_completions(params) else {}),
        "http_filters": [
            _strip_client_routing_headers(params),
            *([_ext_proc_filter(params)] if params.ext_proc else []),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _TYPE + "extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    clusters = [backend, _router_cluster(params)]
    if logs_completions(params):
        clusters += [_completion_log_cluster(i, r, params) for i, r in enumerate(params.routers)]
    bootstrap: dict[str, Any] = {
        "node": {"id": "envoy", "cluster": "prefix-router-ingress"},
        "admin": {"address": _address(*params.admin)},
    }
    uses_eds = params.mode == "override-host" and params.control_plane is not None
    if params.xds_tls is not None and not uses_eds:
        raise ValueError("xds_tls needs the control plane: override-host mode with EDS")
    if uses_eds:
        assert params.control_plane is not None
        clusters.append(_xds_cluster(params.control_plane, params.xds_tls))
        bootstrap["dynamic_resources"] = {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            }
        }
    return {
        **bootstrap,
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": _address(*params.listen),
                    "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": http_connection_manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def render(params: BootstrapParams) -> str:
    header = (
        f"# Generated by `prefix-router envoy-config --mode {params.mode}`; edit the generator.\n"
    )
    return header + yaml.safe_dump(build_bootstrap(params), sort_keys=False)
