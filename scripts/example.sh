#!/usr/bin/env bash
# Builds and runs the main example: the folded groups of a Mixtral-8x22B-like mapping on 128 GPUs
# (attention TP2 x PP8 x DP8, MoE EP8 x ETP1 x PP8). Extra arguments go to moefold-mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/configure.sh build
ninja -C build examples/moefold-mesh >/dev/null
if [ $# -eq 0 ]; then set -- --world 128 --tp 2 --pp 8 --ep 8 --etp 1; fi
build/examples/moefold-mesh "$@"
