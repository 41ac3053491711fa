#!/usr/bin/env bash
# Builds and runs the main example: trains one MoE layer on 8 simulated ranks (threads) under a
# folded mapping (attention TP2 x DP4, MoE EP4 x ETP1 x EDP2) with sub-sequence token dropping.
# Extra arguments replace the mapping (see build/examples/train_moe_cpu --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/configure.sh build
ninja -C build examples/train_moe_cpu >/dev/null
if [ $# -eq 0 ]; then
  set -- --world 8 --tp 2 --ep 4 --etp 1 --drop sub_sequence --capacity 1.25 --quiet
fi
build/examples/train_moe_cpu "$@"
