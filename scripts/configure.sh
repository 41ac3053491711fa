#!/usr/bin/env bash
# Configures a meson build directory (default: build) once; extra arguments go to meson setup.
# nvcc is found through a native file when it is not on PATH (login-shell PATH only on CI).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
native=()
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  native=(--native-file scripts/native-cuda.ini)
fi
if [ ! -f "$dir/build.ninja" ]; then
  meson setup "$dir" "${native[@]}" "$@" >/dev/null
fi
