"""The control plane: discovery, health checks and the load feed produce immutable
records; the snapshot store publishes the healthy fleet; the xDS server streams it to
Envoy and to the routers."""
