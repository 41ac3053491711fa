#!/usr/bin/env bash
# Installs what moefold's build and tests need on a fresh Debian/Ubuntu machine: meson, ninja,
# doctest, Open MPI, clang-format, clang (a second compiler for the header tests; with its
# runtime, libFuzzer), CLI11 and
# nlohmann/json (the tools' flags and JSON), python3-jsonschema (the planner's schema test), and
# from PyPI the reference safetensors package (the upcycling tests), and where nvcc is, cuobjdump
# and nvdisasm (the SASS checks) and CUTLASS's headers (the Hopper grouped GEMM). The CUDA toolkit
# (nvcc, NCCL) is used when present.
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
# The reference safetensors package, which the upcycling tests write dense checkpoints with and
# read moefold-upcycle's output back with (pinned: its low-level serialize() API changed in 0.6),
# for the user, beside Debian's python3 packages (which PEP 668 guards; nothing of theirs is
# replaced: safetensors has no dependencies).
if ! python3 -c 'import safetensors, sys; sys.exit(safetensors.__version__ != "0.5.3")' 2>/dev/null; then
  pip_flags=(--quiet --disable-pip-version-check --user)
  [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ] &&
    pip_flags+=(--break-system-packages)
  python3 -m pip install "${pip_flags[@]}" 'safetensors==0.5.3' >/dev/null 2>&1 ||
    { echo "setup: pip install safetensors==0.5.3 failed"; exit 1; }
fi
# cuobjdump and nvdisasm (one matching pair of NVIDIA's PyPI wheels: the toolkit here ships
# neither) for the SASS checks of the kernels (tests/kernels/sass_check.py); 13.2 is the oldest
# release on PyPI and reads nvcc 13.0's sm_90a cubins. Only where nvcc is.
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! command -v cuobjdump >/dev/null 2>&1 &&
   ! python3 -c 'import glob, os, site, sys; sys.exit(not any(glob.glob(os.path.join(p, "nvidia", "*", "bin", "cuobjdump")) for p in site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null; then
  pip_flags=(--quiet --disable-pip-version-check --user --no-deps)
  [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ] &&
    pip_flags+=(--break-system-packages)
  python3 -m pip install "${pip_flags[@]}" 'nvidia-cuda-cuobjdump==13.2.51' \
    'nvidia-cuda-nvdisasm==13.2.51' >/dev/null 2>&1 ||
    { echo "setup: pip install nvidia-cuda-cuobjdump/nvdisasm==13.2.51 failed"; exit 1; }
fi
# CUTLASS's C++ headers (the PyPI package nvidia-cutlass, pinned; headers under
# cutlass_library/source/include) for the Hopper grouped GEMM (exec/cuda/cutlass_sm90_kernel.cuh),
# into .deps/ beside the sources, where meson's `cutlass` option finds them (auto). No
# dependencies: only the headers are used. Only where nvcc is.
cutlass_dir="$(cd "$(dirname "$0")/.." && pwd)/.deps/nvidia-cutlass-4.2.0.0"
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ ! -f "$cutlass_dir/cutlass_library/source/include/cutlass/cutlass.h" ]; then
  rm -rf "$cutlass_dir"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$cutlass_dir" \
    'nvidia-cutlass==4.2.0.0' >/dev/null 2>&1 ||
    { echo "setup: pip install nvidia-cutlass==4.2.0.0 (into $cutlass_dir) failed"; exit 1; }
fi
echo "setup: ok (${#missing[@]} package(s) installed)"
