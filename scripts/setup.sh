#!/usr/bin/env bash
# Installs what moefold's build and tests need on a fresh Debian/Ubuntu machine: meson, ninja,
# doctest, Open MPI, clang-format, clang (a second compiler for the header tests; with its
# runtime, libFuzzer), CLI11 and
# nlohmann/json (the tools' flags and JSON), python3-jsonschema (the planner's schema test). The
# CUDA toolkit (nvcc, NCCL) is used when present.
set -euo pipefail
pkgs=(meson ninja-build pkg-config cmake doctest-dev libopenmpi-dev openmpi-bin clang-format python3 g++
      clang libclang-rt-14-dev libcli11-dev nlohmann-json3-dev python3-jsonschema)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >/dev/null
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: ok (${#missing[@]} package(s) installed)"
