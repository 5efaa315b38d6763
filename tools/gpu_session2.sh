#!/usr/bin/env bash
# Second device call: check fast AQR on the GPU (tools/gpu_check_aqr.py), then benchmarks/speed.py there.
set -u
OUT=${OUT:-/tmp/aqr-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 AQR_SHARED_DATA=$PWD/.gpu
exec > >(tee -a "$OUT/session2.log") 2>&1
date -u; nvidia-smi -L
timeout "${1:-150}" python3 tools/gpu_check_aqr.py
date -u
timeout "${2:-300}" python3 benchmarks/speed.py --device cuda --repeats 20 --json "$OUT/speed_gpu2.json"
date -u
