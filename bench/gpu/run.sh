#!/usr/bin/env bash
# GPU tier: real vLLM (CUDA) behind Envoy, the control plane and the router, RANDOM vs
# PREFIX_AWARE on the long-context workload, on one GPU machine with no network.
#
#   bash bench/gpu/run.sh            # writes $OUT/real-vllm-cuda.md (OUT defaults to ./out)
#
# Needs on that machine: python3 with vllm (CUDA build) importable, or its wheels in
# $VLLM_WHEELS to install offline; this repository's Python dependencies, installed or as
# wheels in $PROJECT_WHEELS. Starts 4 vLLM instances sharing the GPU (0.2 of its memory
# each), each serving a Llama-3.1-8B-shaped model with dummy weights and a locally made
# tokenizer, so prefill costs are real. Bounded at 7.5 minutes including start-up.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! python3 -c "import vllm" 2>/dev/null; then
  [ -n "${VLLM_WHEELS:-}" ] || { echo "no vllm: set VLLM_WHEELS to a folder of wheels" >&2; exit 2; }
  python3 -m pip install -q --no-index --find-links "$VLLM_WHEELS" vllm
fi
if ! python3 -c "import extproc, grpc, jiter, xxhash, envoy.service.ext_proc" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links "${PROJECT_WHEELS:-.whl}" -e .
fi
# DEVICE=cpu runs the same path against the CPU build, 3 instances: the dry run.
DEVICE=${DEVICE:-cuda}
INSTANCES=4
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
else
  INSTANCES=3
fi

export PREFIX_ROUTER_VLLM_PYTHON=${PREFIX_ROUTER_VLLM_PYTHON:-$(command -v python3)}
set -o pipefail
timeout 450 python3 -m extproc bench --workload real-vllm --device "$DEVICE" \
  --instances "$INSTANCES" --out "$OUT" 2>&1 | tee "$OUT/log.txt"
